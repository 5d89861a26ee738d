"""A dense decode step of the default model (as `indexpool bench` decodes: the model's dtype, its decode weights)
with its K/V cache in each dtype asked, side by side: milliseconds per step after a prefill of --context random
tokens, the cache dtypes alternating --rounds times so that a noisy host moves both alike. Prints the median per
dtype and their ratio.

    OMP_NUM_THREADS=1 taskset -c 0 .venv/bin/python benchmarks/decode_step.py --context 4096 --threads 1

On an fp32 engine (a CPU without native bf16) bf16 is the cache the engine keeps where the C decode-attention kernel
reads one (`Transformer.cache_dtype`), fp32 the one `--decode-weights off` keeps.
"""

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from model.generate import Session  # noqa: E402
from model.runtime import load_engine, set_threads  # noqa: E402

DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--context", type=int, default=4096, help="cached tokens before the timed steps")
    parser.add_argument("--steps", type=int, default=16, help="decode steps per timing")
    parser.add_argument("--rounds", type=int, default=8, help="timings per cache dtype, alternating")
    parser.add_argument("--caches", default="bf16,fp32", help="cache dtypes, comma-separated (bf16, fp32)")
    parser.add_argument("--dtype", default="auto", help="the model's dtype (auto, bf16, fp32)")
    parser.add_argument("--threads", type=int, default=None)
    args = parser.parse_args()
    caches = [name.strip() for name in args.caches.split(",")]
    if any(name not in DTYPES for name in caches):
        parser.error(f"--caches takes {', '.join(DTYPES)}, not {args.caches!r}")
    set_threads(args.threads)
    loaded = load_engine(None, args.dtype)
    model = loaded.model
    prompt = torch.randint(0, loaded.config.vocab_size, (args.context,), generator=torch.Generator().manual_seed(0))
    sessions = {}
    for name in caches:  # each session keeps its own cache, filled once
        model.cache_dtype = DTYPES[name]
        sessions[name] = Session(model, args.context + args.steps * args.rounds + 8)
        sessions[name].prefill(prompt.tolist())
    model.cache_dtype = None
    token, times = torch.tensor([[42]]), {name: [] for name in caches}
    with torch.inference_mode():
        for round_ in range(args.rounds):
            for name in caches:
                cache, start = sessions[name].cache, args.context + round_ * args.steps
                began = time.perf_counter()
                for position in range(start, start + args.steps):
                    model(token, position, cache)
                times[name].append((time.perf_counter() - began) / args.steps * 1000)
    print(f"model {loaded.name}, {str(model.dtype).removeprefix('torch.')}, {torch.get_num_threads()} threads, "
          f"decode after {args.context} tokens, median of {args.rounds} x {args.steps} steps")
    for name in caches:
        print(f"  {name} K/V cache: {statistics.median(times[name]):.1f} ms a step "
              f"({' '.join(f'{t:.1f}' for t in times[name])})")
    if len(caches) == 2:
        first, second = (statistics.median(times[name]) for name in caches)
        print(f"{caches[1]} / {caches[0]} time per step: {second / first:.2f}x")


if __name__ == "__main__":
    main()
