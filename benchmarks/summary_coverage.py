"""Summaries, single pass vs hierarchical: how many of a document's chapters does the summary mention?

Builds a document of `--length` tokens from chapters of Python's own documentation (`pydoc_data.topics`), each
headed "Chapter N: <topic>", and summarizes it both ways with the default model (greedy, `--length long`):
`single` reads the whole document in one context (IndexPool); `hierarchical` summarizes sections that fit the
model's context, then the summaries. Coverage = the share of chapter topics named in the summary; a crude measure
of a summary (no reference summaries exist offline), but it is the one `summarize --strategy auto` is chosen by.

    .venv/bin/python -m benchmarks.summary_coverage --length 16000 --threads 1
"""

from __future__ import annotations

import argparse
import time

from benchmarks.common import chapters_document, machine_description


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--length", type=int, default=16000)
    parser.add_argument("--threads", type=int, default=None)
    args = parser.parse_args()

    from indexpool import jobs
    from indexpool.local import LocalBackend
    from indexpool.model.generate import Sampler, SamplingParams
    from indexpool.model.runtime import load_engine, set_threads
    from indexpool.model.sessions import SessionOptions

    set_threads(args.threads)
    print(machine_description())
    loaded = load_engine(None)
    document, names = chapters_document(loaded.tokenizer, args.length)
    backend = LocalBackend(lambda: loaded, SessionOptions(), Sampler(SamplingParams(temperature=0)))
    print(f"document: {backend.document_tokens(document):,} tokens, {len(names)} chapters", flush=True)
    for strategy in ("single", "hierarchical"):  # as `summarize --length long --summary generate --strategy ...`
        t0 = time.perf_counter()
        (result,) = jobs.summarize(backend, [document], "long", strategy=strategy, summary="generate")
        show(strategy, result, time.perf_counter() - t0, names)


def show(strategy: str, result, seconds: float, names: list[str]) -> None:
    summary = result.text.lower()
    named = [n for n in names if n.lower() in summary]
    print(f"{strategy:>12}: coverage {len(named)}/{len(names)} ({100 * len(named) / len(names):.0f}%), "
          f"{result.new_tokens} tokens, {seconds:.0f}s; named: {', '.join(named)}")
    print(f"{'':>14}{result.text.strip()[:300]!r}", flush=True)


if __name__ == "__main__":
    main()
