"""Dynamic batching: 8 questions on one held document, answered one after another and then as one batch of
branches (`Session.generate_branches`), in one process on the same read document.

The document is Python's own documentation (`pydoc_data.topics`, about `--length` tokens); it is read once, with
the neutral question's reading that sources are ranked against (`local.evidence_baseline`), as `ask` does; then both
ways answer the same questions greedily with up to `-n` new tokens each (a question whose first reading finds a line
to quote is read again with the quote, both ways). Prints each way's wall time (the questions' reading and the
answers), the ratio, how many answers quoted, and whether the answers and their sources are the same.

    .venv/bin/python -m benchmarks.batching --length 32768 --threads 1
"""

from __future__ import annotations

import argparse
import time

from benchmarks.common import machine_description, natural_text, text_document

QUESTIONS = ["What does the pass statement do?", "What is a lambda expression?", "What does the with statement do?",
             "What does the global statement do?", "What is the assert statement for?",
             "What does a yield expression do?", "What does the break statement do?", "What does the del statement do?"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--length", type=int, default=32768, help="document tokens (about)")
    parser.add_argument("--questions", type=int, default=8)
    parser.add_argument("-n", "--max-new-tokens", type=int, default=32)
    parser.add_argument("--threads", type=int, default=None)
    args = parser.parse_args()

    from indexpool.model.sessions import SessionOptions
    from indexpool.jobs import ask_request, request_messages
    from indexpool.local import PROBE_QUESTION, DocumentTokens, LocalBackend, batch_size, document_prompt, run_batch, run_request
    from indexpool.model.generate import Sampler, SamplingParams
    from indexpool.model.runtime import load_engine, set_threads

    threads = set_threads(args.threads)
    print(machine_description())
    loaded = load_engine(None)
    tok = loaded.tokenizer
    questions = (QUESTIONS * (args.questions // len(QUESTIONS) + 1))[: args.questions]
    document = text_document(natural_text(args.length), "manual.txt")
    tokens = DocumentTokens.encode(tok, document)
    prompts = [document_prompt(tok, tokens, request_messages(ask_request(q))) for q in questions]
    n = args.max_new_tokens
    greedy = Sampler(SamplingParams(temperature=0))
    backend = LocalBackend(lambda: loaded, SessionOptions(), greedy)
    session = backend.open_session(max(p.max_tokens for p in prompts) + n, auto="indexpool")
    held = backend.hold(session, document, prompts[0], request_messages(ask_request(PROBE_QUESTION)))
    read = held.read_seconds

    t0 = time.perf_counter()
    alone = [run_request(held, p, greedy, n) for p in prompts]
    one_by_one = time.perf_counter() - t0
    size = batch_size(session, prompts, n, None)
    t0 = time.perf_counter()
    batched = []
    for start in range(0, len(prompts), size):
        batched += run_batch(held, prompts[start : start + size], greedy, n)
    together = time.perf_counter() - t0

    print(f"document: {prompts[0].doc_end - prompts[0].doc_start:,} tokens, read in {read:.1f} s; "
          f"{len(prompts)} questions, up to {n} new tokens each; threads {threads}; batch size {size}")
    print(f"{'way':>12} {'wall s':>8} {'new tokens':>11}")
    for name, seconds, results in (("one by one", one_by_one, alone), ("batched", together, batched)):
        print(f"{name:>12} {seconds:8.1f} {sum(r.new_tokens for r in results):11d}")
    print(f"one by one / batched: {one_by_one / together:.2f}x")
    quoted = [sum(bool(r.quotes) for r in results) for results in (alone, batched)]
    print(f"answers read with a quote: {quoted[0]}/{len(prompts)} one by one, {quoted[1]}/{len(prompts)} batched")
    same_text = sum(a.text == b.text for a, b in zip(alone, batched))
    same_sources = sum([s["cite"] for s in a.sources] == [s["cite"] for s in b.sources] for a, b in zip(alone, batched))
    print(f"same answer: {same_text}/{len(prompts)}; same sources: {same_sources}/{len(prompts)}")


if __name__ == "__main__":
    main()
