"""A dense decode step of a model (the default one, or --model; as `indexpool bench` decodes: the model's dtype, its
decode weights or --decode-weights) with its K/V cache in each dtype asked, and its layers run each way asked, side
by side: milliseconds per step after a prefill of --context random tokens, the variants alternating --rounds times
so that a noisy host moves all alike. Prints the median per variant and their ratios to the first.

    OMP_NUM_THREADS=1 taskset -c 0 .venv/bin/python -m benchmarks.decode_step --context 4096 --threads 1

On an fp32 engine (a CPU without native bf16) bf16 is the cache the engine keeps where the C decode-attention kernel
reads one (`Transformer.cache_dtype`), fp32 the one `--decode-weights off` keeps. Layers: "c" is the whole step in
one C call (`kernels/cpu_decode.c`, where the model takes it), "python" the per-layer code of model/llama.py.
"""

import argparse
import statistics
import sys
import time

import torch

from benchmarks.common import machine_description
from indexpool.model.generate import Session
from indexpool.model.runtime import load_engine, set_threads

DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--context", type=int, default=4096, help="cached tokens before the timed steps")
    parser.add_argument("--steps", type=int, default=16, help="decode steps per timing")
    parser.add_argument("--rounds", type=int, default=8, help="timings per cache dtype, alternating")
    parser.add_argument("--caches", default="bf16,fp32", help="cache dtypes, comma-separated (bf16, fp32)")
    parser.add_argument("--layers", default="c,python", help="how the layers run, comma-separated (c, python)")
    parser.add_argument("--dtype", default="auto", help="the model's dtype (auto, bf16, fp32)")
    parser.add_argument("--model", default=None, help="a GGUF file or model directory (default: the default model)")
    parser.add_argument("--decode-weights", default="auto", help="auto, gguf, int4, int8 or off (as the CLI's)")
    parser.add_argument("--threads", type=int, default=None)
    args = parser.parse_args()
    caches = [name.strip() for name in args.caches.split(",")]
    if any(name not in DTYPES for name in caches):
        parser.error(f"--caches takes {', '.join(DTYPES)}, not {args.caches!r}")
    layer_paths = [name.strip() for name in args.layers.split(",")]
    if any(name not in ("c", "python") for name in layer_paths):
        parser.error(f"--layers takes c, python, not {args.layers!r}")
    set_threads(args.threads)
    print(machine_description())
    loaded = load_engine(args.model, args.dtype, decode_weights=args.decode_weights)
    model = loaded.model
    prompt = torch.randint(0, loaded.config.vocab_size, (args.context,), generator=torch.Generator().manual_seed(0))
    in_c = model._decode_table()
    if in_c is None and "c" in layer_paths:
        print(f"no C step for this model ({model._not_in_c()}): timing the per-layer code only", file=sys.stderr)
        layer_paths = ["python"]
    variants = [(cache, layers) for cache in caches for layers in layer_paths]
    sessions = {}
    for variant in variants:  # each session keeps its own cache, filled once
        model.cache_dtype = DTYPES[variant[0]]
        sessions[variant] = Session(model, args.context + args.steps * args.rounds + 8)
        sessions[variant].prefill(prompt.tolist())
    model.cache_dtype = None
    token, times = torch.tensor([[42]]), {variant: [] for variant in variants}
    with torch.inference_mode():
        for round_ in range(args.rounds):
            for variant in variants:
                model._decode_layers = in_c if variant[1] == "c" else None
                cache, start = sessions[variant].cache, args.context + round_ * args.steps
                began = time.perf_counter()
                for position in range(start, start + args.steps):
                    model(token, position, cache)
                times[variant].append((time.perf_counter() - began) / args.steps * 1000)
    print(f"model {loaded.name}, {str(model.dtype).removeprefix('torch.')}, {torch.get_num_threads()} threads, "
          f"decode after {args.context} tokens, median of {args.rounds} x {args.steps} steps")
    first = statistics.median(times[variants[0]])
    for variant in variants:
        median = statistics.median(times[variant])
        print(f"  {variant[0]} K/V cache, layers in {variant[1]}: {median:.1f} ms a step, {median / first:.2f}x the "
              f"first ({' '.join(f'{t:.1f}' for t in times[variant])})")


if __name__ == "__main__":
    main()
