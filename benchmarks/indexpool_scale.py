"""IndexPool at scale: memory, prefill and decode speed against context length, dense attention alongside.

Each (length, mode) runs in its own process, so peak RSS is that run's own: natural text (Python's
`pydoc_data.topics`, repeated past its ~115K tokens) of `length` tokens is read in prefill segments, then
`--decode` tokens are generated one at a time. Prints bytes per token of each cache part, peak RSS, prefill and
decode tokens/s, and the ratios the IndexPool issue asks for.

    .venv/bin/python -m benchmarks.indexpool_scale --lengths 4096,32768,131072 --dense 4096,32768
    .venv/bin/python -m benchmarks.indexpool_scale --lengths 1048576 --dense none      # about an hour here
    .venv/bin/python -m benchmarks.indexpool_scale --model /tmp/shapes/llama-3.1-8b-Q4_0.gguf --lengths 32768 --dense none

Reads of 128K tokens or more print their progress (tokens, rate, peak RSS) on stderr. `--held N` fills the
history of the first N tokens with random values instead of reading them (a read of 128K tokens of an 8B model takes
hours on a CPU): the memory is all there and the rest is read as after a real read, so peak RSS and the rates of
what is read and decoded are measured; prefill tokens/s then counts the tokens read only.

    .venv/bin/python -m benchmarks.indexpool_scale --model /tmp/shapes/llama-3.1-8b-Q4_0.gguf --lengths 131072 --held 129024 --dense none --decode 4
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time

from benchmarks.common import add_schedule_option, long_read_progress, machine_description, natural_ids, peak_rss_bytes


def hold_random_history(session, tokens: list[int]) -> int:
    """Make an IndexPool session hold `tokens` (cut to a pool boundary) as if it had read them: history K/V, pooled
    index and recent window filled with random values, layer by layer. Returns how many it holds."""
    import torch

    cache = session.cache
    n = len(tokens) - len(tokens) % cache.settings.kpool
    generator = torch.Generator().manual_seed(0)
    views = cache._state_views(n, cache._window_start(n))  # the buffers themselves: no copy of the history
    for name, view in views.items():
        for part in view:  # a layer at a time: bounded temporaries
            if name.endswith("_scale"):
                part.fill_(0.02)  # int8 history x 0.02: keys and values of about the size a model's have
            elif view.dtype == torch.int8:
                part.copy_(torch.randint(-127, 128, part.shape, dtype=torch.int8, generator=generator))
            else:
                part.copy_(torch.randn(part.shape, generator=generator).to(view.dtype))
    cache._set_held(n)
    session.tokens = list(tokens[:n])
    return n


def worker(model: str | None, length: int, mode: str, decode: int, threads: int | None, options: dict) -> dict:
    import torch

    from indexpool.model.generate import Session
    from indexpool.model.indexpool_cache import IndexPoolConfig
    from indexpool.model.sessions import SessionOptions, default_indexer, describe_indexers, segment_indexer
    from indexpool.model.runtime import load_engine, set_threads

    set_threads(threads)
    loaded = load_engine(model)
    ids = natural_ids(loaded.tokenizer, length)
    settings = mode == "indexpool"
    choice = SessionOptions(indexer=options.pop("indexer"), prune_index=options.pop("prune_index"))
    held = options.pop("held")
    indexer, for_segments = default_indexer(choice, loaded), segment_indexer(choice, loaded)
    session = Session(loaded.model, length + decode, attention=IndexPoolConfig(**options) if settings else None,
                      indexer=indexer if settings else None, segment_indexer=for_segments if settings else None)
    rss_loaded = peak_rss_bytes()
    held = hold_random_history(session, ids[:held]) if held and settings else 0
    t0 = time.perf_counter()
    logits = session.prefill(ids, long_read_progress(f"{length}:{mode}", length))
    prefill_s = time.perf_counter() - t0
    token = logits.argmax(-1)
    times = []
    with torch.inference_mode():
        for _ in range(decode):
            t = time.perf_counter()
            logits = session.model(token.view(1, 1), len(session.tokens), session.cache)[:, -1]
            session.tokens.append(int(token))
            token = logits.argmax(-1)
            times.append(time.perf_counter() - t)
    times.sort()
    result = {"length": length, "mode": mode, "prefill_tok_s": (length - held) / prefill_s, "held": held,
              "decode_tok_s": 1 / times[len(times) // 2], "peak_rss": peak_rss_bytes(),
              "rss_after_load": rss_loaded}
    config = loaded.config
    if mode == "indexpool":
        cache = session.cache
        result.update(cache.bytes_per_token())
        result["per_token_index"] = cache.unpooled_index_bytes()
        result["fixed_bytes"] = cache.fixed_bytes()
        result["kv_storage"] = cache.kv_storage
        result["indexer"] = describe_indexers(indexer, for_segments)
    else:
        result["history_kv"] = config.kv_bytes_per_token(session.cache.k.dtype)
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None, help="a .gguf file or Hugging Face directory (default: the default model)")
    parser.add_argument("--lengths", default="4096,32768,131072", help="IndexPool context lengths")
    parser.add_argument("--dense", default="4096,32768", help="dense context lengths, or 'none'")
    parser.add_argument("--decode", type=int, default=16)
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--indexer", default="auto", help="auto, training-free, trained, hybrid or an indexer file")
    parser.add_argument("--topk", type=int, default=None, help="far tokens each query attends to (default: the engine's)")
    parser.add_argument("--kv-storage", default="auto")
    parser.add_argument("--index-dtype", default="bf16")
    parser.add_argument("--prune-index", action=argparse.BooleanOptionalAction, default=None,
                        help="pruned index keys (default: as the command line, on for the training-free indexer)")
    parser.add_argument("--offload-dir", default=None)
    parser.add_argument("--segment-block", type=int, default=None,
                        help="queries of a prefill segment sharing one far selection (default: the engine's)")
    parser.add_argument("--held", type=int, default=0, metavar="TOKENS",
                        help="IndexPool runs hold the first TOKENS as random history instead of reading them "
                             "(module docstring)")
    add_schedule_option(parser)
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    args = parser.parse_args()
    options = {"kv_storage": args.kv_storage, "index_dtype": args.index_dtype, "offload_dir": args.offload_dir,
               "indexer": args.indexer, "prune_index": args.prune_index, "schedule": args.schedule,
               "held": args.held}
    if args.segment_block:
        options["segment_block"] = args.segment_block
    if args.topk:
        options["topk"] = args.topk
    if args.worker:
        length, mode = args.worker.split(":")
        print(json.dumps(worker(args.model, int(length), mode, args.decode, args.threads, options)))
        return
    print(machine_description(args.threads))
    runs = [(int(n), "indexpool") for n in args.lengths.split(",")]
    if args.dense != "none":
        runs += [(int(n), "dense") for n in args.dense.split(",")]
    results = []
    print(f"{'length':>8} {'mode':>9} {'prefill tok/s':>13} {'decode tok/s':>12} {'peak RSS MiB':>12} "
          f"{'KV B/tok':>9} {'index B/tok':>11} {'per-token index':>15}", flush=True)
    for length, mode in runs:
        command = [sys.executable, "-m", "benchmarks.indexpool_scale", "--worker", f"{length}:{mode}",
                   "--decode", str(args.decode), "--kv-storage", args.kv_storage, "--index-dtype", args.index_dtype,
                   "--indexer", args.indexer]
        command += ["--threads", str(args.threads)] if args.threads else []
        command += ["--model", args.model] if args.model else []
        command += ["--offload-dir", args.offload_dir] if args.offload_dir else []
        command += ["--segment-block", str(args.segment_block)] if args.segment_block else []
        command += ["--topk", str(args.topk)] if args.topk else []
        command += ["--held", str(args.held)] if args.held else []
        command += ["--schedule", ",".join(args.schedule)]
        command += [] if args.prune_index is None else ["--prune-index" if args.prune_index else "--no-prune-index"]
        done = subprocess.run(command, stdout=subprocess.PIPE, text=True)  # the worker's progress and errors: stderr
        if done.returncode:
            print(f"{length:>8} {mode:>9} failed (exit {done.returncode}; its error is above)", flush=True)
            continue
        r = json.loads(done.stdout.strip().splitlines()[-1])
        results.append(r)
        index = f"{r['pooled_index']:.0f}" if "pooled_index" in r else "-"
        per_token = f"{r['per_token_index']:.0f}" if "per_token_index" in r else "-"
        print(f"{length:>8} {mode:>9} {r['prefill_tok_s']:>13.0f} {r['decode_tok_s']:>12.1f} "
              f"{r['peak_rss'] / 2**20:>12.0f} {r['history_kv']:>9.0f} {index:>11} {per_token:>15}"
              + (f"  ({r['indexer']}, {r['kv_storage']} K/V, fixed buffers {r['fixed_bytes'] / 2**20:.0f} MiB"
                 + (f"; the first {r['held']} tokens held as random history" if r["held"] else "") + ")"
                 if mode == "indexpool" else ""),
              flush=True)
    by = {(r["length"], r["mode"]): r for r in results}
    lengths = sorted({r["length"] for r in results if r["mode"] == "indexpool"})
    if lengths:
        r = by[(lengths[0], "indexpool")]
        print(f"pooled index / per-token index bytes: {r['pooled_index'] / r['per_token_index']:.3f}")
        for n in lengths[1:]:
            print(f"decode at {n} / decode at {lengths[0]} (indexpool): "
                  f"{by[(n, 'indexpool')]['decode_tok_s'] / r['decode_tok_s']:.2f}")
    for (n, mode), r in sorted(by.items()):
        if mode == "dense" and (n, "indexpool") in by:
            print(f"prefill at {n}, indexpool / dense: {by[(n, 'indexpool')]['prefill_tok_s'] / r['prefill_tok_s']:.2f}x")


if __name__ == "__main__":
    main()
