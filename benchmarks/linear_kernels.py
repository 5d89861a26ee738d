"""One-token (decode) matmul kernels on this CPU: bf16/fp32 `F.linear` against PyTorch's weight-only int8 and int4
kernels, for the default model's layer shapes. Prints microseconds per call (median of 200) and bf16's GB/s.

    .venv/bin/python benchmarks/linear_kernels.py

With --rows 1,4,8,16: the default model loaded, every linear layer it decodes with (`DecodeQuantLinear`) called
once on that many rows, its quantized copy against its bf16 weights (weights streaming from memory, as in a decode
step); milliseconds per pass over all layers, median of 7. This sets `DecodeQuantLinear.max_rows`.

    OMP_NUM_THREADS=1 taskset -c 1 .venv/bin/python benchmarks/linear_kernels.py --rows 1,4,8,16
"""

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

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


def model_layers(rows_list: list[int]) -> None:
    from model.quant import DecodeQuantLinear
    from model.runtime import load_engine

    layers = [m for m in load_engine(None).model.modules() if isinstance(m, DecodeQuantLinear)]
    for rows in rows_list:
        inputs = [torch.randn(rows, layer.weight.shape[1]).bfloat16() for layer in layers]
        passes = {}
        for name, max_rows in (("quantized", rows), ("bf16", 0)):
            DecodeQuantLinear.max_rows = max_rows
            with torch.inference_mode():
                passes[name] = micros(lambda: [layer(x) for layer, x in zip(layers, inputs)], n=7) / 1e3
        print(f"{rows} rows, {len(layers)} layers: quantized {passes['quantized']:.1f} ms, bf16 {passes['bf16']:.1f} ms, "
              f"bf16 / quantized {passes['bf16'] / passes['quantized']:.2f}")


parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
parser.add_argument("--rows", help="comma-separated row counts: time the default model's decode layers instead")
args = parser.parse_args()
if args.rows:
    model_layers([int(r) for r in args.rows.split(",")])
    sys.exit()
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
