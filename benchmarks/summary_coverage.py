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

    import dataclasses

    from indexpool.model.sessions import SessionOptions, open_session
    from indexpool.jobs import (SUMMARY_LENGTHS, DocumentTokens, document_prompt, read_document, request_messages,
                                    run_request, session_identity, summarize_hierarchical, summary_request)
    from indexpool.model.generate import Sampler, SamplingParams
    from indexpool.model.runtime import load_engine, set_threads

    set_threads(args.threads)
    print(machine_description())
    loaded = load_engine(None)
    tok = loaded.tokenizer
    document, names = chapters_document(tok, args.length)
    request, budget = summary_request("long", None), SUMMARY_LENGTHS["long"][1]
    choice = SessionOptions()
    results = {}

    t0 = time.perf_counter()
    prompt = document_prompt(tok, DocumentTokens.encode(tok, document), request_messages(request))
    session = open_session(loaded, choice, len(prompt.ids) + budget, auto="indexpool")
    read_document(session, prompt, session_identity(loaded, session, choice), None, "", print, None)
    print(f"document: {prompt.doc_end - prompt.doc_start:,} tokens, {len(names)} chapters", flush=True)
    results["single"] = (run_request(session, tok, prompt, document, Sampler(SamplingParams(temperature=0)), budget,
                                     None, False, 0.0), time.perf_counter() - t0)
    show("single", *results["single"], names)
    del session

    t0 = time.perf_counter()
    dense = dataclasses.replace(choice, attention="dense")
    results["hierarchical"] = (summarize_hierarchical(
        loaded, document, request, budget, Sampler(SamplingParams(temperature=0)), None,
        lambda needed: open_session(loaded, dense, needed), lambda needed: open_session(loaded, choice, needed,
                                                                                        auto="indexpool")),
        time.perf_counter() - t0)
    show("hierarchical", *results["hierarchical"], names)


def show(strategy: str, result, seconds: float, names: list[str]) -> None:
    summary = result.text.lower()
    named = [n for n in names if n.lower() in summary]
    print(f"{strategy:>12}: coverage {len(named)}/{len(names)} ({100 * len(named) / len(names):.0f}%), "
          f"{result.new_tokens} tokens, {seconds:.0f}s; named: {', '.join(named)}")
    print(f"{'':>14}{result.text.strip()[:300]!r}", flush=True)



if __name__ == "__main__":
    main()
