"""The document cache: the same `indexpool ask` twice on a long document, the second restoring the read document.

Writes a document of about `--length` tokens (Python's own documentation, `pydoc_data.topics`), runs the installed
`indexpool ask ... --json` on it twice with a fresh cache directory, and prints each run's wall time (model load
included), the time reading (or restoring) the document, the time answering, and the ratio first / second.

    .venv/bin/python -m benchmarks.doc_cache --length 32768 --threads 1
"""

from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path

from benchmarks.common import machine_description, natural_text, run_indexpool


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--length", type=int, default=32768, help="document tokens (about)")
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--question", default="What does the pass statement do?")
    parser.add_argument("--prune-index", action=argparse.BooleanOptionalAction, default=None,
                        help="pruned index keys (default: as the command line, on for the training-free indexer)")
    args = parser.parse_args()

    print(machine_description(args.threads))
    with tempfile.TemporaryDirectory() as tmp:
        doc = Path(tmp) / "manual.txt"
        doc.write_text(natural_text(args.length))
        options = [] if args.prune_index is None else ["--prune-index" if args.prune_index else "--no-prune-index"]
        runs = []
        for _ in range(2):
            out, seconds = run_indexpool("ask", str(doc), args.question, "--json", "--quiet", "--cache-dir",
                                         str(Path(tmp) / "cache"), "-n", "32", *options, threads=args.threads)
            runs.append((seconds, json.loads(out)))
        size = sum(p.stat().st_size for p in (Path(tmp) / "cache").glob("*.safetensors"))
    print(f"document: {runs[0][1]['tokens']['document']:,} tokens; cache entry {size / 2**20:.0f} MiB")
    print(f"{'run':>6} {'cached':>6} {'wall s':>8} {'read s':>8} {'answer s':>9} {'new tokens':>10} {'quoted':>6}")
    for i, (wall, result) in enumerate(runs, 1):
        t = result["timings"]
        print(f"{i:>6} {str(result['cached']):>6} {wall:8.1f} {t['read_seconds']:8.1f} {t['answer_seconds']:9.1f} "
              f"{result['tokens']['new']:>10} {str(result.get('quote') is not None):>6}")
    print(f"first / second, wall: {runs[0][0] / runs[1][0]:.1f}x; reading the document: "
          f"{runs[0][1]['timings']['read_seconds'] / max(runs[1][1]['timings']['read_seconds'], 1e-9):.0f}x")
    same = runs[0][1]["text"] == runs[1][1]["text"]
    print(f"same answer both times: {same}")


if __name__ == "__main__":
    main()
