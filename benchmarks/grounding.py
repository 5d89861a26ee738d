"""Grounding: does `ask` find planted facts in a long document, cite where they are, and not invent them?

Builds a text document of about `--length` tokens from Python's own documentation (`pydoc_data.topics`) with 10
facts of different shapes planted at depths 5% ... 95% (a password, a ship's name, a pier number, a town...), asks one
question per fact
with the default `ask` settings (greedy, IndexPool, sources from the indexer, the lines the question's reading
found quoted before the answer; `--no-quote` answers without), and counts: answers containing the right value,
answers whose first cited line range holds the fact, quotes holding it, and, on the same document without the
facts, answers that still contain the planted value (invented). One document read, every question asked on it (the
document cache is off: one process holds the read document).

    .venv/bin/python -m benchmarks.grounding --length 30000 --threads 1
"""

from __future__ import annotations

import argparse
import random

from benchmarks.common import leading_pieces, machine_description, natural_text, text_document

# Ten facts of different shapes (a templated set, "the access code of X is N" ten times, mostly measured the model
# confusing look-alike sentences: 4/10 even with dense attention at 7.5K). {} is filled per seed from the lists.
FACTS = [
    ("The secret password of the blue vault is {}.", "What is the secret password of the blue vault?", "number"),
    ("Captain Ilse Morrow sails a ship called the {}.", "What is the name of Captain Ilse Morrow's ship?", "ship"),
    ("The Kelp Island ferry leaves from pier number {}.", "From which pier number does the Kelp Island ferry leave?", "small"),
    ("The chemist Arno Pell was born in the town of {}.", "In which town was the chemist Arno Pell born?", "town"),
    ("Tickets for the Harbor Jazz Festival cost {} crowns.", "How many crowns does a ticket for the Harbor Jazz Festival cost?", "small"),
    ("The robot in the museum basement is named {}.", "What is the name of the robot in the museum basement?", "robot"),
    ("Professor Lin keeps her spare keys inside a {}.", "Where does Professor Lin keep her spare keys?", "object"),
    ("The winning lottery number last spring was {}.", "What was the winning lottery number last spring?", "number"),
    ("The mountain village of Ostra mostly grows {}.", "What does the mountain village of Ostra mostly grow?", "crop"),
    ("The night train to Velden departs at {}.", "At what time does the night train to Velden depart?", "time"),
]
VALUES = {
    "ship": ["Saltwind", "Marigold", "Bluefin", "Stormpetrel", "Quillback"],
    "town": ["Rennick", "Dovecrest", "Hallowmere", "Tarnby", "Westmoor"],
    "robot": ["Brassfoot", "Tinker-9", "Olo", "Copperjack", "Mavis"],
    "object": ["green teapot", "violin case", "hollow book", "tin of biscuits", "flower pot"],
    "crop": ["saffron", "buckwheat", "lentils", "hops", "chestnuts"],
}


def fact_value(kind: str, rng: random.Random) -> str:
    if kind == "number":
        return str(rng.randrange(10000, 99999))
    if kind == "small":
        return str(rng.randrange(12, 98))
    if kind == "time":
        return f"{rng.randrange(19, 24)}:{rng.choice(['05', '15', '25', '35', '45', '55'])}"
    return rng.choice(VALUES[kind])


def build_document(tokenizer, length: int, seed: int, with_facts: bool) -> tuple[str, list[tuple[str, str, int]]]:
    """Text of about `length` tokens; the facts as (question, answer, line number where planted)."""
    rng = random.Random(seed)
    kept = leading_pieces(tokenizer, [line + "\n" for line in natural_text().split("\n")], length - 400)
    planted = []
    for i, (sentence, question, kind) in enumerate(FACTS):
        value = fact_value(kind, rng)
        planted.append((sentence.format(value), question, value, int(len(kept) * (0.05 + 0.1 * i))))
    if with_facts:
        for sentence, _, _, at in reversed(planted):  # from the end, so earlier line numbers stay right
            kept.insert(at, sentence + "\n")
    # 1-based line numbers after the inserts
    facts = [(question, value, at + 1 + i) for i, (_, question, value, at) in enumerate(planted)]
    return "".join(kept), facts


def cited_lines(cite: str) -> tuple[int, int] | None:
    try:
        span = cite.rsplit(":", 1)[1]
        start, _, end = span.partition("-")
        return int(start), int(end or start)
    except (IndexError, ValueError):
        return None


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--length", type=int, default=30000)
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--indexer", default="auto")
    parser.add_argument("--attention", default="auto", help="auto (IndexPool, as ask runs) or dense (up to 8K)")
    parser.add_argument("--topk", type=int, default=None, help="IndexPool far tokens per query (default: ask's)")
    parser.add_argument("--prune-index", action=argparse.BooleanOptionalAction, default=None,
                        help="pruned index keys (default: as the command line, on for the training-free indexer)")
    parser.add_argument("--plain-sources", action="store_true",
                        help="rank sources on the plain attention mass, not beyond a neutral question's (as ask does)")
    parser.add_argument("--control", action=argparse.BooleanOptionalAction, default=True,
                        help="also ask on the document without the facts")
    parser.add_argument("--quote", action=argparse.BooleanOptionalAction, default=True,
                        help="quote the lines the question's reading found before answering (as ask does)")
    args = parser.parse_args()

    from indexpool.model.sessions import SessionOptions
    from indexpool.jobs import ask_request, plain_request, request_messages
    from indexpool.local import PROBE_QUESTION, DocumentTokens, LocalBackend, document_prompt, run_request
    from indexpool.model.generate import Sampler, SamplingParams
    from indexpool.model.runtime import load_engine, set_threads

    set_threads(args.threads)
    print(machine_description())
    loaded = load_engine(None)
    tok = loaded.tokenizer
    choice = SessionOptions(indexer=args.indexer, attention=args.attention, prune_index=args.prune_index)
    if args.topk:
        choice.indexpool.topk = args.topk
    runs = [True, False] if args.control else [True]
    for with_facts in runs:
        text, facts = build_document(tok, args.length, args.seed, with_facts)
        document = text_document(text, "report.txt")
        doc_tokens = DocumentTokens.encode(tok, document)
        request = ask_request if args.quote else lambda question: plain_request(ask_request(question))
        prompts = [document_prompt(tok, doc_tokens, request_messages(request(question))) for question, _, _ in facts]
        greedy = Sampler(SamplingParams(temperature=0))
        backend = LocalBackend(lambda: loaded, choice, greedy)
        session = backend.open_session(max(len(p.ids) for p in prompts) + 40, auto="indexpool")
        held = backend.hold(session, document, prompts[0], request_messages(ask_request(PROBE_QUESTION)))
        read_s = held.read_seconds
        if args.plain_sources:
            held.baseline = None
        print(f"\n{'with' if with_facts else 'WITHOUT'} facts: {prompts[0].doc_end - prompts[0].doc_start:,} document "
              f"tokens read in {read_s:.0f}s")
        correct = cited = invented = quoted = 0
        for (question, code, line), prompt in zip(facts, prompts):
            result = run_request(held, prompt, greedy, 40)
            answer = result.text.strip().replace("\n", " ")
            hit = code.lower() in answer.lower()
            first = cited_lines(result.sources[0]["cite"]) if result.sources else None
            where = first is not None and first[0] <= line <= first[1]
            in_quote = any(code.lower() in quoted["text"].lower() for quoted in result.quotes)
            if with_facts:
                correct += hit
                cited += where
                quoted += in_quote
            else:
                invented += hit
            shown = "; ".join(s["cite"].rsplit(":", 1)[-1] for s in result.sources)
            print(f"  {question[:40]:40} {code:>15} line {line:5}  {'OK ' if hit else '-- '} {'cite-OK' if where else 'cite--'}"
                  f" {'quote-OK' if in_quote else 'quote--'}"
                  f"  [{shown}]  {answer[:70]!r}  ({result.answer_seconds:.1f}s)", flush=True)
        if with_facts:
            print(f"answered {correct}/10, first source holds the fact {cited}/10, the quote holds it {quoted}/10")
        else:
            print(f"planted answers invented without the facts: {invented}/10")


if __name__ == "__main__":
    main()
