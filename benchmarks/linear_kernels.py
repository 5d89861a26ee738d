"""One-token (decode) matmul kernels on this CPU: bf16/fp32 `F.linear` against PyTorch's weight-only int8 and int4
kernels, for the default model's layer shapes. Prints microseconds per call (median of 200) and bf16's GB/s.

    .venv/bin/python benchmarks/linear_kernels.py
"""

import statistics
import time

import torch
import torch.nn.functional as F

SHAPES = [(576, 960), (576, 3072), (1536, 576), (576, 49152)]  # (in, out): qkv, gate/up, down, output


def micros(fn, n=200) -> float:
    for _ in range(10):
        fn()
    times = []
    for _ in range(n):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return statistics.median(times) * 1e6


for k, n in SHAPES:
    w = torch.randn(n, k)
    x = torch.randn(1, k).bfloat16()
    wb, xf = w.bfloat16(), x.float()
    scale = w.abs().amax(1) / 127
    w8 = torch.round(w / scale[:, None]).to(torch.int8)
    q4 = torch.randint(0, 16, (n, k), dtype=torch.int32)
    w4 = torch.ops.aten._convert_weight_to_int4pack_for_cpu(q4, 2)
    sz = torch.randn(k // 32, n, 2).bfloat16()
    bf16 = micros(lambda: F.linear(x, wb))
    print(f"{k}x{n}: fp32 {micros(lambda: F.linear(xf, w)):.0f} us, bf16 {bf16:.0f} us ({wb.numel() * 2 / bf16 / 1e3:.1f} GB/s), "
          f"int8 {micros(lambda: torch.ops.aten._weight_int8pack_mm(x, w8, scale.bfloat16())):.0f} us, "
          f"int4 {micros(lambda: torch.ops.aten._weight_int4pack_mm_for_cpu(x, w4, 32, sz)):.0f} us")
