"""Reading a question on a held long document (its tokens choose their far tokens one by one), with and without
`model.runtime.keep_freed_memory`, each in its own process (malloc's settings hold for a whole process).

Writes a document of about `--length` tokens (Python's documentation, `pydoc_data.topics`), reads it once into a
document cache, then in two fresh processes (INDEXPOOL_KEEP_FREED_MEMORY=1, then 0; `--rounds` rounds, alternating)
restores it and times reading one question with its sources `--repeats` times; prints each setting's median, and the
ratio.

    .venv/bin/python benchmarks/question_read.py --length 32768 --threads 1
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
QUESTION = "What does the pass statement do?"


def measure(document: str, cache_dir: str, threads: int | None, repeats: int) -> list[float]:
    """In this process: restore (or read) the document, then time reading the question `repeats` times."""
    sys.path.insert(0, str(ROOT))
    from indexpool_cli.attention import AttentionChoice, open_session
    from indexpool_cli.ingest import IngestOptions, load_document
    from indexpool_cli.jobs import (DocumentTokens, ask_request, document_prompt, read_document, request_evidence,
                                    request_messages, session_identity)
    from model.runtime import load_engine, set_threads
    from model.tensor_cache import TensorCache

    set_threads(threads)
    loaded = load_engine(None)
    doc = load_document([document], IngestOptions(), None)
    prompt = document_prompt(loaded.tokenizer, DocumentTokens.encode(loaded.tokenizer, doc),
                             request_messages(ask_request(QUESTION)))
    choice = AttentionChoice()
    session = open_session(loaded, choice, len(prompt.ids) + 1, auto="indexpool")
    read_document(session, prompt, session_identity(loaded, session, choice), TensorCache(Path(cache_dir)), "bench",
                  print, None)
    times = []
    for _ in range(repeats):
        session.cache.evidence = request_evidence(session.cache, prompt)
        t0 = time.perf_counter()
        session.prefill(prompt.ids)
        times.append(time.perf_counter() - t0)
        session.cache.evidence = None
        session.cache.truncate(prompt.reusable)
        session.tokens = session.tokens[: prompt.reusable]
    return times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--length", type=int, default=32768, help="document tokens (about)")
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--repeats", type=int, default=3, help="question readings per process")
    parser.add_argument("--rounds", type=int, default=2, help="processes per setting")
    parser.add_argument("--child", nargs=2, metavar=("DOCUMENT", "CACHE_DIR"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(measure(*args.child, args.threads, args.repeats)))
        return

    import pydoc_data.topics

    text = "\n\n".join(pydoc_data.topics.topics.values())
    text = (text * (args.length * 4 // len(text) + 1))[: args.length * 4]
    with tempfile.TemporaryDirectory() as tmp:
        document = Path(tmp) / "manual.txt"
        document.write_text(text)
        command = [sys.executable, __file__, "--child", str(document), str(Path(tmp) / "cache"),
                   "--repeats", str(args.repeats)] + (["--threads", str(args.threads)] if args.threads else [])
        subprocess.run(command, check=True, capture_output=True)  # reads the document into the cache first
        times: dict[str, list[float]] = {"1": [], "0": []}
        for _ in range(args.rounds):
            for setting in times:
                env = {**os.environ, "INDEXPOOL_KEEP_FREED_MEMORY": setting}
                out = subprocess.run(command, check=True, capture_output=True, text=True, env=env).stdout
                times[setting] += json.loads(out.strip().splitlines()[-1])
    kept, fresh = statistics.median(times["1"]), statistics.median(times["0"])
    print(f"question reading at {args.length:,} tokens, {args.rounds} processes x {args.repeats} readings per setting")
    print(f"  freed memory kept (default): median {kept:.2f} s  {[round(t, 2) for t in times['1']]}")
    print(f"  returned to the system:      median {fresh:.2f} s  {[round(t, 2) for t in times['0']]}")
    print(f"returned / kept: {fresh / kept:.2f}x")


if __name__ == "__main__":
    main()
