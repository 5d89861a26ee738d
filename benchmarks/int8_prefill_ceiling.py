"""How far int8 activations could take the prefill on an AVX2 CPU: the measure behind issue 2's prefill target.

The engine's fp32 prefill runs its linear layers as fp32 matmuls (MKL, close to the FMA peak) and its attention in
fp32 (kernels/cpu_attention.c). Exact fp32 leaves no room for 1.5x over transformers, which runs the same matmuls.
The one faster road on a CPU without native bf16 or VNNI is llama.cpp's: quantize a prompt's activations to int8
in blocks of 32 and multiply them by the Q4_1 weights' levels with vpmaddubsw (32 multiply-adds an instruction, an
fma does 8), at the price of an inexact prefill. This script measures that road with a measuring kernel
(int8_prefill_ceiling.c, not the engine's) before anyone builds it in:

1. the instruction ceilings on this core: 10 independent fmas against 8 independent (vpmaddubsw, vpaddw) pairs;
2. the default model's four linear shapes over a 4,096-token prompt in the engine's 512-row segments: fp32
   F.linear against the int8 kernel (activation quantization included), median of --repeats, with the kernel's
   error against an fp64 product of the same quantized operands, and what the quantization itself costs
   (against the exact product with the same Q4_1 weights), relative to the output's largest magnitude;
3. with --prefill: a 4,096-token prefill of our engine and of transformers (fp32, last logits only, as
   `indexpool bench`), and the prefill ours would have with every linear layer at the kernel's speed and
   everything else unchanged (attention, norms, rotary): that projection against transformers; and the most
   either kind of linears could give with exact attention at the fma ceiling and nothing else costing time.

    OMP_NUM_THREADS=1 taskset -c 0 .venv/bin/python benchmarks/int8_prefill_ceiling.py --prefill
"""

import argparse
import ctypes
import statistics
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.cpu_attention import median_seconds  # noqa: E402
from kernels.cpu_linear import int4_levels  # noqa: E402
from kernels.native_build import build_native  # noqa: E402

SOURCE = Path(__file__).with_suffix(".c")
GROUP, TILE = 32, 16
SEGMENT = 512  # the engine's prefill segment: each linear call sees this many rows
# One row of ones against 16 outputs whose weights are all level 1 of scale 0.5 and min 0.25 (0.75 each): 24.
SELF_TEST = """
import ctypes, struct, sys
lib = ctypes.CDLL(sys.argv[1])
P, Q = ctypes.c_void_p, ctypes.c_int64
lib.quantize_rows_q8.argtypes = [P, Q, Q, P, P, P]
lib.gemm_q4_q8.argtypes = [P, P, P, Q, P, Q, Q, P]
x = (ctypes.c_float * 32)(*[1.0] * 32)
q, d, s = (ctypes.c_int8 * 32)(), (ctypes.c_float * 1)(), (ctypes.c_float * 1)()
lib.quantize_rows_q8(x, 1, 32, q, d, s)
w = bytes([1] * 512) + struct.pack("<16f", *[0.5] * 16) + struct.pack("<16f", *[0.25] * 16)
y = (ctypes.c_float * 16)()
lib.gemm_q4_q8(q, d, s, 1, w, 1, 32, y)
if list(q) != [127] * 32 or any(abs(v - 24.0) > 1e-4 for v in y):
    sys.exit(f"wrong result: q {list(q)[:4]}, y {list(y)[:4]}")
"""


def library() -> tuple[ctypes.CDLL | None, str]:
    """The measuring kernel built for this CPU, or (None, why not)."""
    lib, origin = build_native(SOURCE, SELF_TEST)
    if lib is None:
        return None, origin
    P, Q = ctypes.c_void_p, ctypes.c_int64
    lib.fma_peak.argtypes = lib.maddubs_peak.argtypes = [Q]
    lib.fma_peak.restype = lib.maddubs_peak.restype = ctypes.c_double
    lib.quantize_rows_q8.argtypes = [P, Q, Q, P, P, P]
    lib.gemm_q4_q8.argtypes = [P, P, P, Q, P, Q, Q, P]
    return lib, origin


def q4_1(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(levels uint8 (N, K / 32, 32), scales, mins (N, K / 32)): GGUF's Q4_1 blocks (`cpu_linear.int4_levels`)."""
    levels, scale, low = int4_levels(weight)
    return levels.to(torch.uint8), scale, low


def pack_tiles(levels: torch.Tensor, scale: torch.Tensor, low: torch.Tensor) -> torch.Tensor:
    """The kernel's layout (int8_prefill_ceiling.c): per tile of 16 outputs and block, 16 vectors then scales, mins."""
    n, blocks, _ = levels.shape
    if n % TILE:
        raise ValueError(f"the measuring kernel takes outputs in tiles of {TILE}, not {n}")
    tiles = n // TILE
    vectors = levels.reshape(tiles, 2, 8, blocks, 8, 4).permute(0, 3, 4, 1, 2, 5).reshape(tiles, blocks, 512)
    scales = scale.reshape(tiles, TILE, blocks).transpose(1, 2).contiguous().view(torch.uint8)
    mins = low.reshape(tiles, TILE, blocks).transpose(1, 2).contiguous().view(torch.uint8)
    return torch.cat([vectors, scales, mins], dim=-1).contiguous()


def int8_linear(lib, x: torch.Tensor, packed: torch.Tensor, n: int) -> torch.Tensor:
    x = x.float().contiguous()  # the kernel reads rows of K in a row
    rows, k = x.shape
    q = torch.empty(rows, k, dtype=torch.int8)
    d, s = torch.empty(rows, k // GROUP), torch.empty(rows, k // GROUP)
    y = torch.empty(rows, n)
    if (lib.quantize_rows_q8(x.data_ptr(), rows, k, q.data_ptr(), d.data_ptr(), s.data_ptr())
            or lib.gemm_q4_q8(q.data_ptr(), d.data_ptr(), s.data_ptr(), rows, packed.data_ptr(), n // TILE, k, y.data_ptr())):
        raise ValueError("the measuring kernel refused its arguments")
    return y


def quantized_reference(x: torch.Tensor, levels, scale, low) -> tuple[torch.Tensor, torch.Tensor]:
    """fp64 products with the same Q4_1 weights: of the int8-quantized activations, and of the exact ones."""
    w = (levels.double() * scale[..., None].double() + low[..., None].double()).flatten(1)
    blocks = x.float().reshape(x.shape[0], -1, GROUP)
    d = blocks.abs().amax(-1) / 127  # in fp32, as the kernel: the same levels, ties included
    qx = torch.where(d[..., None] > 0, torch.round(blocks / torch.where(d > 0, d, 1)[..., None]), 0)
    return (qx.double() * d[..., None].double()).flatten(1) @ w.T, x.double() @ w.T


def warm_median_seconds(fn, repeats: int) -> float:
    fn()  # first calls allocate
    return median_seconds(fn, repeats)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tokens", type=int, default=4096, help="prompt length (default 4096)")
    parser.add_argument("--repeats", type=int, default=5, help="timings per layer shape, median (default 5)")
    parser.add_argument("--prefill", action="store_true", help="also time our and transformers' prefill")
    args = parser.parse_args()
    if args.tokens % SEGMENT:
        sys.exit(f"int8_prefill_ceiling: --tokens must be a multiple of {SEGMENT}")
    lib, origin = library()
    if lib is None:
        sys.exit(f"int8_prefill_ceiling: the measuring kernel is not available here: {origin}")
    torch.manual_seed(0)
    print(f"threads: {torch.get_num_threads()}")

    n = 20_000_000
    fma = warm_median_seconds(lambda: lib.fma_peak(n), 3)
    maddubs = warm_median_seconds(lambda: lib.maddubs_peak(n), 3)
    fma_macs, int8_macs = n * 10 * 8 / fma / 1e9, n * 8 * 32 / maddubs / 1e9
    print(f"ceilings: fma {fma_macs:.1f} G multiply-adds/s, vpmaddubsw+vpaddw {int8_macs:.1f} "
          f"({int8_macs / fma_macs:.2f}x)")

    from model.default_model import default_model_path
    from model.runtime import load_engine

    loaded = load_engine(default_model_path(), "fp32")
    model = loaded.model
    layers = len(model.layers)
    print(f"\n{args.tokens} tokens in {SEGMENT}-row calls, the layer shapes of one block, x {layers} blocks:")
    print("| layer | in x out | fp32 F.linear ms | int8 kernel ms | speed-up | kernel error | quantization error |")
    print("|---|---|---|---|---|---|---|")
    total_fp32 = total_int8 = linear_macs = 0.0
    for name, linear in zip(("wqkv", "wo", "w13", "w2"), model.layers[0].linears()):
        weight = linear.weight.detach().float()
        out_features, in_features = weight.shape
        levels, scale, low = q4_1(weight)
        packed = pack_tiles(levels, scale, low)
        w_exact = (levels.float() * scale[..., None] + low[..., None]).flatten(1)
        x = torch.randn(SEGMENT, in_features)
        calls = args.tokens // SEGMENT
        fp32 = calls * warm_median_seconds(lambda: F.linear(x, w_exact), args.repeats)
        int8 = calls * warm_median_seconds(lambda: int8_linear(lib, x, packed, out_features), args.repeats)
        quantized, exact = quantized_reference(x, levels, scale, low)
        y = int8_linear(lib, x, packed, out_features).double()
        top = exact.abs().max().item()
        kernel_error = (y - quantized).abs().max().item() / top
        quantization_error = (quantized - exact).abs().max().item() / top
        total_fp32, total_int8 = total_fp32 + fp32, total_int8 + int8
        linear_macs += layers * args.tokens * in_features * out_features
        print(f"| {name} | {in_features} x {out_features} | {1e3 * fp32:.0f} | {1e3 * int8:.0f} | {fp32 / int8:.2f}x "
              f"| {kernel_error:.1e} | {quantization_error:.1e} |")
    total_fp32, total_int8 = layers * total_fp32, layers * total_int8
    print(f"all {layers} blocks: fp32 {total_fp32:.2f} s, int8 {total_int8:.2f} s ({total_fp32 / total_int8:.2f}x)")
    # Exact causal attention: query t meets t + 1 keys; two products (q.k, p.v) of head_dim multiply-adds each.
    config = loaded.config
    attention_macs = 2 * config.head_dim * config.n_heads * layers * args.tokens * (args.tokens + 1) / 2
    attention_floor = attention_macs / (fma_macs * 1e9)
    print(f"exact attention: {attention_macs / 1e9:.0f} G multiply-adds, {attention_floor:.2f} s at the fma ceiling; "
          f"the linears: {linear_macs / 1e9:.0f} G, fp32 at {linear_macs / total_fp32 / 1e9 / fma_macs:.0%} of it")
    if not args.prefill:
        return

    from indexpool_cli.bench import _worker_indexpool, _worker_transformers

    job = {"model": str(default_model_path()), "dtype": "fp32", "decode_tokens": 0}
    ours = _worker_indexpool(job)[1]
    ours(64)
    ours_s = statistics.median(ours(args.tokens)[0] for _ in range(3))
    del loaded, model
    reference = _worker_transformers(job)[1]
    reference(64)
    reference_s = statistics.median(reference(args.tokens)[0] for _ in range(3))
    projected = ours_s - total_fp32 + total_int8
    print(f"\nprefill of {args.tokens} tokens, median of 3: ours {ours_s:.2f} s ({args.tokens / ours_s:.0f} tok/s), "
          f"transformers {reference_s:.2f} s ({args.tokens / reference_s:.0f} tok/s): {reference_s / ours_s:.2f}x")
    print(f"ours with the linears at the int8 kernel's speed: {projected:.2f} s ({args.tokens / projected:.0f} tok/s): "
          f"{reference_s / projected:.2f}x transformers (issue 2's target: 1.5x)")
    # Lower bounds on the prefill: the linears as measured, attention at the fma ceiling, nothing else (norms,
    # rotary, the rest take time too): so upper bounds on the ratio.
    for label, linears in (("fp32 linears", total_fp32), ("int8 linears", total_int8),
                           ("fp32 linears at the fma ceiling", linear_macs / (fma_macs * 1e9))):
        floor = linears + attention_floor
        print(f"at most, {label} + exact attention at the fma ceiling: {floor:.2f} s: "
              f"{reference_s / floor:.2f}x transformers")


if __name__ == "__main__":
    main()
