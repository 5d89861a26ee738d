"""One-token (decode) matmul kernels on this CPU: bf16/fp32 `F.linear` against PyTorch's weight-only int8 and int4
kernels and the C kernels of kernels/cpu_linear.c (fp32 activations; where they build), for the default model's
layer shapes. Prints microseconds per call (median of 200) and bf16's GB/s.

    .venv/bin/python -m benchmarks.linear_kernels

With --rows 1,4,8,16: the default model loaded, every linear layer it decodes with (`DecodeQuantLinear`) called
once on that many rows, its quantized copy against its bf16 weights (weights streaming from memory, as in a decode
step); milliseconds per pass over all layers, median of 7. This sets `DecodeQuantLinear.max_rows`. With
--dtype fp32 (the default on a CPU without native bf16) the model is loaded in fp32 and the copies are the C
kernels' (`DecodeQuantLinear.fp32_max_rows`), timed against fp32 F.linear, per layer shape and for the pass.

    OMP_NUM_THREADS=1 taskset -c 1 .venv/bin/python -m benchmarks.linear_kernels --rows 1,4,8,16
    OMP_NUM_THREADS=1 .venv/bin/python -m benchmarks.linear_kernels --rows 1,4,8,16,32 --dtype fp32
"""

import argparse
import sys

import torch
import torch.nn.functional as F

from benchmarks.common import machine_description, median_seconds
from indexpool.kernels import cpu_linear

SHAPES = [(576, 960), (576, 3072), (1536, 576), (576, 49152)]  # (in, out): qkv, gate/up, down, output


def micros(fn, n=200) -> float:
    """Microseconds a call of fn takes, the median of n after 10 calls of warm-up."""
    return median_seconds(fn, n, warmup=10) * 1e6


def model_layers(rows_list: list[int], dtype: str) -> None:
    from indexpool.model.quant import DecodeQuantLinear
    from indexpool.model.runtime import load_engine

    model = load_engine(None, dtype).model
    full = str(model.dtype).removeprefix("torch.")
    layers = [m for m in model.modules() if isinstance(m, DecodeQuantLinear)]
    if not layers:
        sys.exit(f"no quantized decode copies on this {full} model (fp32 needs the C kernels of kernels/cpu_linear.c)")

    def limit(rows: int) -> None:  # the copies for up to `rows` rows (0: the full weights always)
        DecodeQuantLinear.max_rows = DecodeQuantLinear.fp32_max_rows = rows

    for rows in rows_list:
        inputs = [torch.randn(rows, layer.weight.shape[1]).to(model.dtype) for layer in layers]
        passes = {}
        for name, max_rows in (("quantized", rows), (full, 0)):
            limit(max_rows)
            with torch.inference_mode():
                passes[name] = micros(lambda: [layer(x) for layer, x in zip(layers, inputs)], n=7) / 1e3
        if layers[0].native:  # per layer shape, each shape's layers in turn (still streaming from memory)
            shapes = {}
            for layer, x in zip(layers, inputs):
                shapes.setdefault((tuple(layer.weight.shape), layer.bits), []).append((layer, x))
            parts = []
            for ((n, k), bits), group in shapes.items():
                times = {}
                for name, max_rows in (("q", rows), ("f", 0)):
                    limit(max_rows)
                    with torch.inference_mode():
                        times[name] = micros(lambda: [layer(x) for layer, x in group], n=7) / len(group)
                parts.append(f"{n}x{k} int{bits} {times['q']:.0f} / {times['f']:.0f} us")
            print(f"{rows} rows, per layer (quantized / {full}): " + ", ".join(parts))
        print(f"{rows} rows, {len(layers)} layers: quantized {passes['quantized']:.1f} ms, {full} {passes[full]:.1f} ms, "
              f"{full} / quantized {passes[full] / passes['quantized']:.2f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", help="comma-separated row counts: time the default model's decode layers instead")
    parser.add_argument("--dtype", default="auto", help="with --rows: the model's dtype (auto: bf16 where the CPU has "
                                                       "it, else fp32)")
    args = parser.parse_args()
    print(machine_description())
    if args.rows:
        model_layers([int(r) for r in args.rows.split(",")], args.dtype)
        return
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
        native = ""
        if cpu_linear.kernel_runs():
            c4, (c8, c8_scales) = cpu_linear.pack_int4(w), cpu_linear.pack_int8(w)
            native = (f", C int8 {micros(lambda: cpu_linear.linear_int8(xf, c8, c8_scales)):.0f} us, "
                      f"C int4 {micros(lambda: cpu_linear.linear_int4(xf, c4)):.0f} us (fp32 activations)")
        print(f"{k}x{n}: fp32 {micros(lambda: F.linear(xf, w)):.0f} us, bf16 {bf16:.0f} us "
              f"({wb.numel() * 2 / bf16 / 1e3:.1f} GB/s), "
              f"int8 {micros(lambda: torch.ops.aten._weight_int8pack_mm(x, w8, scale.bfloat16())):.0f} us, "
              f"int4 {micros(lambda: torch.ops.aten._weight_int4pack_mm_for_cpu(x, w4, 32, sz)):.0f} us" + native)


if __name__ == "__main__":
    main()
