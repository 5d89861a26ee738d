"""The C attention kernels against PyTorch on the default model's shapes (9 query heads over 3 KV heads, head size 64).

Decode: one query per sequence against `--keys` cached keys, one layer at a time over 30 layers' caches, so that
the reads come from DRAM as in a decode step. Prefill: the causal attention of one layer over `--prefill` tokens, in
one call and in `--segment`-token segments as the engine reads a prompt (PyTorch's flash kernel then takes a mask).
Prints the median time of each side and the ratio. Run it on one core:

    OMP_NUM_THREADS=1 taskset -c 1 .venv/bin/python -m benchmarks.cpu_attention
"""

from __future__ import annotations

import argparse
import sys

from benchmarks.common import machine_description, median_seconds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--keys", type=int, default=4096, help="cached keys per decode step")
    parser.add_argument("--prefill", type=int, default=4096, help="tokens of the causal prefill")
    parser.add_argument("--segment", type=int, default=512, help="tokens a prefill segment (the engine's default)")
    parser.add_argument("--any-threads", action="store_true",
                        help="run the fp32 prefill kernel at any thread count (the engine: one thread only)")
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--dtype", choices=("both", "bf16", "fp32"), default="both",
                        help="the dtype(s) measured (fp32: what an AVX2-only CPU's engine runs)")
    args = parser.parse_args()

    import torch
    import torch.nn.functional as F

    from indexpool.kernels.cpu_attention import (decode_attention_reference, native_attention, native_library, native_prefill,
                                       prefill_kernel_runs)

    torch.set_num_threads(args.threads)
    print(machine_description())
    if args.any_threads:  # the rule measured here: see prefill_kernel_runs
        import indexpool.kernels.cpu_attention as cpu_attention

        cpu_attention.FP32_PREFILL_THREADS = args.threads
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
    T, segment = args.prefill, args.segment
    for dtype in dtypes[args.dtype]:
        name = str(dtype).removeprefix("torch.")
        if not prefill_kernel_runs(torch.device("cpu"), dtype, D):
            print(f"prefill, {name}: the C kernel does not run on this CPU (bf16: AVX512-BF16 without AMX; fp32: AVX2 "
                  "without AVX-512)")
            continue
        q = torch.randn(1, KV * group, T, D).to(dtype)
        k, v = (torch.randn(1, KV, T, D).to(dtype) for _ in range(2))

        masks = {}  # built once per forward in the engine (KVCache.begin), for every layer: not timed here
        for start in range(segment, T, segment):
            hidden = torch.arange(min(start + segment, T))[None, :] > torch.arange(start, min(start + segment, T))[:, None]
            masks[start] = torch.zeros(hidden.shape, dtype=dtype).masked_fill_(hidden, float("-inf"))

        def segments(kernel: bool) -> None:  # as the engine reads a prompt: each segment after the cached ones
            for start in range(0, T, segment):
                end = min(start + segment, T)
                qs, ks, vs = q[:, :, start:end], k[:, :, :end], v[:, :, :end]
                if kernel:
                    native_prefill(qs, ks, vs, start)
                    continue
                mask = masks.get(start)
                F.scaled_dot_product_attention(qs, ks, vs, attn_mask=mask, is_causal=mask is None, enable_gqa=True)

        runs = {"one call, torch": lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True),
                "one call, C": lambda: native_prefill(q, k, v, 0),
                f"{segment}-token segments, torch": lambda: segments(False),
                f"{segment}-token segments, C": lambda: segments(True)}
        ms = {label: median_seconds(run, 3) * 1e3 for label, run in runs.items()}
        flops = 4 * KV * group * D * T * (T + 1) / 2  # q . k and the weighted values, causal
        print(f"prefill, one layer, {T} tokens causal, {name}: " + ", ".join(
            f"{label} {t:.0f} ms ({flops / t / 1e6:.0f} GFLOP/s)" for label, t in ms.items()))
        print(f"  torch / C: one call {ms['one call, torch'] / ms['one call, C']:.2f}x, segments "
              f"{ms[f'{segment}-token segments, torch'] / ms[f'{segment}-token segments, C']:.2f}x")

if __name__ == "__main__":
    main()
