"""Several inputs summarized by one `indexpool summarize a b c ...` (each its own summary; those that fit the model's
context decoded as one dense batch) against one `indexpool summarize` per input, as a user would run them.

Writes `--inputs` text files of about `--tokens` tokens each (Python's own documentation, `pydoc_data.topics`, a
different stretch per file), runs the installed command on all of them at once and then on each alone (greedy,
`--length short`, `--summary generate`: the model writes each summary, no document cache), and prints each wall time (process start and model load included: what the
user waits for), the ratio, and how many summaries are the same both ways. Alone, an input is read with IndexPool
(its sources come from the indexer); in the batch, with dense attention. Then, in this process, the engine alone:
the same summary prompts on one dense session, one after another and as one batch (`local.generate_each`).

    .venv/bin/python -m benchmarks.input_batching --inputs 6 --tokens 1000 --threads 1
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

from benchmarks.common import CHARS_PER_TOKEN, machine_description, natural_text, run_indexpool


def run(paths: list[Path], threads: int | None) -> tuple[float, list[dict]]:
    out, seconds = run_indexpool("summarize", *map(str, paths), "--length", "short", "--summary", "generate",
                                 "--json", "--quiet", "--no-cache", threads=threads)
    return seconds, [json.loads(line) for line in out.splitlines()]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--inputs", type=int, default=6)
    parser.add_argument("--tokens", type=int, default=1000, help="about this many tokens per input")
    parser.add_argument("--threads", type=int, default=None)
    args = parser.parse_args()

    print(machine_description(args.threads))
    text = natural_text(args.inputs * args.tokens)
    size = args.tokens * CHARS_PER_TOKEN
    with tempfile.TemporaryDirectory() as tmp:
        paths, texts = [], [text[i * size : (i + 1) * size] for i in range(args.inputs)]
        for i, part in enumerate(texts):
            path = Path(tmp) / f"part{i + 1}.txt"
            path.write_text(part)
            paths.append(path)
        together_s, together = run(paths, args.threads)
        alone = [run([path], args.threads) for path in paths]
    alone_s = sum(seconds for seconds, _ in alone)
    print(f"{args.inputs} inputs of about {args.tokens} tokens; threads {args.threads}")
    print(f"{'way':>22} {'wall s':>8} {'new tokens':>11}")
    print(f"{'one command, batched':>22} {together_s:8.1f} {sum(r['tokens']['new'] for r in together):11}")
    print(f"{'one command per input':>22} {alone_s:8.1f} {sum(r[0]['tokens']['new'] for _, r in alone):11}")
    print(f"per input / batched: {alone_s / together_s:.2f}x")
    same = sum(a["text"] == r[0]["text"] for a, (_, r) in zip(together, alone))
    print(f"same summary: {same}/{args.inputs}")
    engine_only(texts, args.threads)


def engine_only(texts: list[str], threads: int | None) -> None:
    from indexpool.ingest import Document, Part
    from indexpool.jobs import SUMMARY_LENGTHS, request_messages, summary_request
    from indexpool.local import DocumentTokens, document_prompt, generate_each
    from indexpool.model.generate import Sampler, SamplingParams, Session
    from indexpool.model.runtime import load_engine, set_threads

    set_threads(threads)
    loaded = load_engine(None)
    tok = loaded.tokenizer
    docs = [Document([Part(text, f"part{i + 1}.txt", f"part{i + 1}.txt")], [], []) for i, text in enumerate(texts)]
    request = request_messages(summary_request("short", None))
    prompts = [document_prompt(tok, DocumentTokens.encode(tok, doc), request) for doc in docs]
    session = Session(loaded.model, loaded.config.context_length)
    seconds = {}
    for batch in (1, len(prompts)):
        t0 = time.perf_counter()
        results = generate_each(session, tok, prompts, docs, Sampler(SamplingParams(temperature=0)),
                                SUMMARY_LENGTHS["short"][1], batch)
        seconds[batch] = time.perf_counter() - t0, sum(r.new_tokens for r in results)
    (one_s, one_n), (all_s, all_n) = seconds[1], seconds[len(prompts)]
    print(f"engine only, dense: one by one {one_s:.1f} s ({one_n} new tokens), as one batch {all_s:.1f} s "
          f"({all_n} new tokens): {one_s / all_s:.2f}x")


if __name__ == "__main__":
    main()
