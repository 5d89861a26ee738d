"""Which signal finds the passage that answers: the question's words, the model's reading of the whole document
(IndexPool attention evidence), the model's likelihood of the question after a candidate passage, or all three as
`ask` combines them (indexpool_cli/local.py `passage_quote`). On the real-document set of benchmarks/doc_qa.py.

For every question, after the document is read as `ask` reads it, the passage each scorer puts first is checked:
does it hold an accepted answer, and is its part a ground-truth location (the first source `ask` cites)?

    .venv/bin/python -m benchmarks.passage_choice --install
"""

from __future__ import annotations

import argparse

from benchmarks.common import machine_description
from benchmarks.doc_qa import answer_holds, location_matches
from benchmarks.doc_qa_documents import DocumentMissing, data_files, documents_folder, load_set, materialize

# (label, attention weight, model weight, words): the scorers compared
SCORERS = [("words", 0.0, 0.0, True), ("attention", 1.0, 0.0, False), ("words + attention", None, 0.0, True),
           ("words + model", 0.0, None, True), ("all three (ask)", None, None, True)]


def choose(lexical, attention, likelihood, candidates, attention_weight, model_weight, words) -> int:
    """The passage a scorer puts first: attention alone over every passage; the others among the candidates, as
    `passage_quote` ranks them (`ranked_passages`; a weight None: ask's)."""
    from indexpool import local, retrieval

    if not words:
        return max(range(len(attention)), key=attention.__getitem__)
    a = retrieval.ATTENTION_WEIGHT if attention_weight is None else attention_weight
    m = local.MODEL_WEIGHT if model_weight is None else model_weight
    return local.ranked_passages(lexical, attention, candidates, likelihood, a, m)[0]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--docs", default="", help="comma-separated names (benchmarks/data/doc_qa_NAME.json)")
    parser.add_argument("--install", action="store_true", help="apt-get install the documents' Debian packages")
    parser.add_argument("--threads", type=int, default=None)
    args = parser.parse_args()

    from indexpool.model.sessions import SessionOptions
    from indexpool.ingest import load_document
    from indexpool.jobs import ask_request, request_messages
    from indexpool.local import (PROBE_QUESTION, RERANK_CONTEXT_TOKENS, DocumentTokens, LocalBackend, document_prompt,
                                 passage_attention, question_likelihoods, request_evidence, rerank_candidates)
    from indexpool.model.runtime import load_engine, set_threads

    set_threads(args.threads)
    print(machine_description())
    loaded = load_engine(None)
    tok = loaded.tokenizer
    names = [n for n in args.docs.split(",") if n] or [load_set(str(p))["name"] for p in data_files()]
    totals = {label: [0, 0] for label, *_ in SCORERS}
    count = 0
    print(f"| document | q | {' | '.join(f'{label}: answer, source' for label, *_ in SCORERS)} |\n"
          + "|---" * (len(SCORERS) + 2) + "|")
    with documents_folder() as folder:
        for name in names:
            doc_set = load_set(name)
            try:
                path = materialize(doc_set["document"], folder, install=args.install)
            except DocumentMissing as e:
                print(f"| {name} | skipped: {e} |")
                continue
            document = load_document([str(path)])
            tokens = DocumentTokens.encode(tok, document)
            prompts = [document_prompt(tok, tokens, request_messages(ask_request(q["question"])))
                       for q in doc_set["questions"]]
            backend = LocalBackend(lambda: loaded, SessionOptions(), None)
            session = backend.open_session(max(p.max_tokens for p in prompts), auto="indexpool")
            baseline = backend.hold(session, document, prompts[0],
                                    request_messages(ask_request(PROBE_QUESTION))).baseline
            index = tokens.index(tok)
            spans = [index.passage_span(p) for p in index.lexical.passages]
            texts = ["".join(text for _, text in index.lexical.lines[p.first_line : p.last_line])
                     for p in index.lexical.passages]
            hits = {label: [0, 0] for label, *_ in SCORERS}
            for q, prompt in zip(doc_set["questions"], prompts):
                evidence = request_evidence(session.cache, prompt)
                session.prefill(prompt.ids[: prompt.quote_at], evidence=evidence, question_from=prompt.doc_end)
                session.tokens = session.tokens[: session.cache.truncate(prompt.reusable)]
                lexical = index.lexical.passage_scores(prompt.question)
                attention = passage_attention(evidence.beyond(baseline), evidence.start - prompt.doc_start, spans)
                candidates = rerank_candidates(lexical)
                likelihood = question_likelihoods(loaded.model, tok, [tokens.ids[a:b][:RERANK_CONTEXT_TOKENS]
                                                                      for a, b in (spans[i] for i in candidates)],
                                                  prompt.question)
                for label, a, m, words in SCORERS:
                    best = choose(lexical, attention, likelihood, candidates, a, m, words)
                    part = document.parts[index.lexical.passages[best].part]
                    hits[label][0] += answer_holds(texts[best], q["answers"])
                    hits[label][1] += any(location_matches(part.location(), part.source, w) for w in q["where"])
            n = len(prompts)
            count += n
            for label in hits:
                totals[label] = [t + h for t, h in zip(totals[label], hits[label])]
            print(f"| {name} | {n} | " + " | ".join(f"{a}, {s}" for a, s in hits.values()) + " |", flush=True)
    if count:
        print(f"| all | {count} | " + " | ".join(f"{a} ({100 * a / count:.0f}%), {s} ({100 * s / count:.0f}%)"
                                               for a, s in totals.values()) + " |")


if __name__ == "__main__":
    main()
