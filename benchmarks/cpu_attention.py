"""The C attention kernels against PyTorch on the default model's shapes (9 query heads over 3 KV heads, head size 64).

Decode: one query per sequence against `--keys` cached keys, one layer at a time over 30 layers' caches, so that
the reads come from DRAM as in a decode step. Prefill: the causal attention of one layer over `--prefill` tokens.
Prints the median time of each side and the ratio. Run it on one core:

    OMP_NUM_THREADS=1 taskset -c 1 .venv/bin/python benchmarks/cpu_attention.py
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))


def median_seconds(run, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        run()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--keys", type=int, default=4096, help="cached keys per decode step")
    parser.add_argument("--prefill", type=int, default=4096, help="tokens of the causal prefill")
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--dtype", choices=("both", "bf16", "fp32"), default="both",
                        help="the cache dtype(s) of the decode measurement (fp32: what an AVX2-only CPU's engine runs)")
    args = parser.parse_args()

    import torch
    import torch.nn.functional as F

    from kernels.cpu_attention import (decode_attention_reference, native_attention, native_library, native_prefill,
                                       prefill_kernel_runs)

    torch.set_num_threads(args.threads)
    library, origin = native_library()
    if library is None:
        sys.exit(f"the C kernels are not available here: {origin}")
    layers, KV, group, D = 30, 3, 3, 64
    print(f"{origin}; threads {args.threads}")
    dtypes = {"both": (torch.bfloat16, torch.float32), "bf16": (torch.bfloat16,), "fp32": (torch.float32,)}
    for dtype in dtypes[args.dtype]:
        k, v = (torch.randn(layers, 1, KV, args.keys, D).to(dtype) for _ in range(2))
        q = torch.randn(1, KV, group, D).to(dtype)
        steps = {
            "torch": lambda: [decode_attention_reference(q, k[i], v[i], None) for i in range(layers)],
            "C": lambda: [native_attention(q, k[i], v[i]) for i in range(layers)],
        }
        ms = {name: median_seconds(run, args.repeats) / layers * 1e3 for name, run in steps.items()}
        read = {name: 2 * args.keys * KV * D * k.element_size() / (t / 1e3) / 1e9 for name, t in ms.items()}
        print(f"decode, {args.keys} keys, {str(dtype).removeprefix('torch.')}: torch {ms['torch']:.3f} ms a layer "
              f"({read['torch']:.1f} GB/s), C {ms['C']:.3f} ms ({read['C']:.1f} GB/s): {ms['torch'] / ms['C']:.2f}x")
    if not prefill_kernel_runs(torch.device("cpu"), torch.bfloat16, D):
        print("prefill: the C kernel does not run on this CPU (bf16 with AVX512-BF16 and no AMX only)")
        return
    T = args.prefill
    q = torch.randn(1, KV * group, T, D).bfloat16()
    k, v = (torch.randn(1, KV, T, D).bfloat16() for _ in range(2))
    flash = median_seconds(lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True), 3)
    kernel = median_seconds(lambda: native_prefill(q, k, v, 0), 3)
    print(f"prefill, one layer, {T} tokens causal, bf16: torch {flash * 1e3:.0f} ms, C {kernel * 1e3:.0f} ms: "
          f"{flash / kernel:.2f}x")


if __name__ == "__main__":
    main()
