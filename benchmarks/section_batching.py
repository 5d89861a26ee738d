"""The section step of hierarchical summaries, one section after another vs decoded as batches.

Builds a document of `--length` tokens from chapters of Python's own documentation (`pydoc_data.topics`, as
benchmarks/summary_coverage.py does), splits it into sections that fit the default model's context as
`summarize --strategy hierarchical` does (4 sections at the default length), and summarizes every section
greedily twice in one process, each time on a fresh dense session: one by one (`generate_each` with a batch
of 1, the path used before batching) and in batches of the size `section_batch_size` picks from the prompts'
lengths and the memory available. Prints both wall times and their ratio, the same past the time reading the
prompts alone takes (measured first: prefill is the same work either way), and how many summaries came out
identical.

    taskset -c 0 .venv/bin/python -m benchmarks.section_batching --threads 1
"""

from __future__ import annotations

import argparse
import time

from benchmarks.common import chapters_document, machine_description


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--length", type=int, default=26000, help="document tokens (default: 4 sections)")
    parser.add_argument("--section-tokens", type=int, default=None, help="most tokens per section (default: as "
                        "summarize: the model's context less 1024)")
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--dtype", default="auto", help="auto, bf16, fp16 or fp32 (fp32: summaries should all be "
                        "identical; in bf16 greedy decoding amplifies rounding differences)")
    args = parser.parse_args()

    import dataclasses

    from indexpool.model.sessions import SessionOptions, available_memory_bytes, open_session
    from indexpool.jobs import SECTION_SUMMARY_TOKENS, request_messages, split_sections, summary_request
    from indexpool.local import SECTION_RESERVE, DocumentTokens, document_prompt, generate_each, section_batch_size
    from indexpool.model.generate import Sampler, SamplingParams
    from indexpool.model.runtime import load_engine, set_threads

    threads = set_threads(args.threads)
    print(machine_description())
    loaded = load_engine(None, args.dtype)
    tok = loaded.tokenizer
    document, _ = chapters_document(tok, args.length)
    context = loaded.config.context_length
    budget = min(args.section_tokens or context, context - SECTION_RESERVE)
    sections = split_sections(document, lambda part: len(tok.encode(part)), budget)
    request = request_messages(summary_request("short", None))  # what `summarize` asks of each section
    prompts = [document_prompt(tok, DocumentTokens.encode(tok, section), request) for section in sections]
    dense = dataclasses.replace(SessionOptions(), attention="dense")
    size = section_batch_size(open_session(loaded, dense, context), [len(p.ids) for p in prompts],
                              SECTION_SUMMARY_TOKENS, available_memory_bytes())
    print(f"{loaded.name}, {loaded.model.dtype}, {threads} thread(s); {len(sections)} sections, prompts of "
          f"{', '.join(str(len(p.ids)) for p in prompts)} tokens; batches of {size}", flush=True)

    session = open_session(loaded, dense, context)
    t0 = time.perf_counter()
    for prompt in prompts:  # what both runs read alike, to tell the decoding's share
        session.prefill(prompt.ids)
    prefill_seconds = time.perf_counter() - t0
    print(f"reading the prompts alone: {prefill_seconds:.1f}s", flush=True)
    runs = {}
    for name, batch in (("one by one", 1), ("batched", size)):
        session = open_session(loaded, dense, context)  # fresh: neither run finds the other's tokens held
        t0 = time.perf_counter()
        results = generate_each(session, tok, prompts, sections, Sampler(SamplingParams(temperature=0)),
                                SECTION_SUMMARY_TOKENS, batch)
        summaries = [result.text.strip() for result in results]
        runs[name] = (time.perf_counter() - t0, summaries)
        print(f"{name:>10}: {runs[name][0]:.1f}s, {runs[name][0] - prefill_seconds:.1f}s past reading", flush=True)
    (alone_seconds, alone), (batched_seconds, batched) = runs["one by one"], runs["batched"]
    same = sum(a == b for a, b in zip(alone, batched))
    print(f"one by one / batched: {alone_seconds / batched_seconds:.2f}x, past reading "
          f"{(alone_seconds - prefill_seconds) / (batched_seconds - prefill_seconds):.2f}x; identical summaries: "
          f"{same}/{len(sections)}")
    for i, (a, b) in enumerate(zip(alone, batched)):
        if a != b:
            print(f"  section {i + 1} one by one: {a[:160]!r}\n  section {i + 1} batched:    {b[:160]!r}")


if __name__ == "__main__":
    main()
