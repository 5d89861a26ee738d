"""Linear layers on a GGUF file's own weights, in C (`gguf_blocks.c`), next to their torch reference.

A model brought from llama.cpp or Ollama keeps its weights in blocks along the input: Q4_0, Q4_1, Q5_0, Q5_1 and
Q8_0 (32 weights a block), the K-quants Q2_K, Q3_K, Q4_K, Q5_K and Q6_K (256; a Q4_K_M file is mostly Q4_K and
Q6_K), or plain F32, F16 and BF16 rows. The formats are in gguf_blocks.c. Rather than a dequantized copy of the
model (4-8x the file in fp32 or bf16), the engine keeps the weights where they lie in the memory-mapped file and
computes on them:
  - few rows (a decode step): `linear` quantizes the activations to int8 blocks of 32 (`quantize_activations`)
    and sums integer products block by block, as llama.cpp's CPU engine does; the error against the exact product
    is the activations' rounding only (at most half a step d_x / 2 per input: `activation_error_bound`). F16 rows
    are widened to fp32 in the C kernel, BF16 rows in cpu_linear's, F32 rows go to torch as they are: the float
    types take the activations unrounded;
  - many rows (prefill): `matmul_dequantized` multiplies slices of the matrix's rows dequantized to the activations'
    fp32 or bf16 in a buffer kept per thread (the float types: the rows themselves where the activations have their
    dtype); except fp32 rows against a quantized format (`int8_prompts`): `prompt_linear` takes a decode step's
    int8 products there, 8 weight rows at a time, at 1.15-2.4x the fp32 GEMM's rate.
The C calls split their output rows over torch's thread count, in threads of their own (gguf_blocks.c says why).

`*_reference` are the same computations in plain torch (the kernels' tests compare them on awkward shapes, and
the engine runs them where the library does not build or INDEXPOOL_KERNELS=torch). The library is built on first
use (`kernels.native_build`) and needs AVX2, FMA and F16C.
"""

from __future__ import annotations

import ctypes
import functools
import threading
from collections.abc import Iterator
from pathlib import Path

import torch
import torch.nn.functional as F

from . import cpu_linear, torch_forced
from .native_build import FLAGS, build_native

SOURCE = Path(__file__).with_name("gguf_blocks.c")
BLOCK = 32
# ggml type number -> (name, weights per block, bytes per block)
TYPES = {0: ("F32", 1, 4), 1: ("F16", 1, 2), 30: ("BF16", 1, 2),
         2: ("Q4_0", 32, 18), 3: ("Q4_1", 32, 20), 6: ("Q5_0", 32, 22), 7: ("Q5_1", 32, 24), 8: ("Q8_0", 32, 34),
         10: ("Q2_K", 256, 84), 11: ("Q3_K", 256, 110), 12: ("Q4_K", 256, 144), 13: ("Q5_K", 256, 176),
         14: ("Q6_K", 256, 210)}
FLOAT_TYPES = {0: torch.float32, 1: torch.float16, 30: torch.bfloat16}  # rows of plain values, no blocks
TORCH_TYPES = (0, 30)  # F32 as torch has it; BF16 by cpu_linear's kernel: `linear` leaves these to torch
K_QUANTS = (10, 11, 12, 13, 14)
QUANTIZE_SIGNATURE = "pqqq" + "pppp"
LINEAR_SIGNATURE = "ippppqq" + "ppqqq" + "pqipi"
LINEAR_X_SIGNATURE = "ipiqqq" + "ppqqq" + "pqipi"
F16_SIGNATURE = "pqqq" + "ppqqq" + "pqipi"
DEQUANTIZE_SIGNATURE = "ipqqqq" + "pqii"
PROMPT_SIGNATURE = "ippppqq" + "pq" + "pqipi"
SIGNATURES = {"gguf_quantize_rows": QUANTIZE_SIGNATURE, "gguf_linear": LINEAR_SIGNATURE,
              "gguf_linear_x": LINEAR_X_SIGNATURE, "gguf_linear_f16": F16_SIGNATURE,
              "gguf_dequantize": DEQUANTIZE_SIGNATURE, "gguf_prompt_linear": PROMPT_SIGNATURE}
# the formats `prompt_linear` takes: every quantized one
PROMPT_TYPES = (2, 3, 6, 7, 8, 10, 11, 12, 13, 14)
TILE_ROWS = 8  # weight rows the prompt kernel takes at a time

# A known answer, checked in a child process on a freshly built library before it is used: a Q4_1, a Q8_0 and a
# Q4_K row (a super-block: 6-bit scales and mins with their top bits set) against 2 rows of activations whose int8
# blocks are exact (small integers, max 127), an F16 row against them, and the rows dequantized; every sum is an
# integer times a power of two, exact in fp32.
SELF_TEST = """
import ctypes, struct, sys
lib = ctypes.CDLL(sys.argv[1])
types = {"p": ctypes.c_void_p, "i": ctypes.c_int, "q": ctypes.c_int64}
names = ("gguf_quantize_rows", "gguf_linear", "gguf_linear_x", "gguf_linear_f16", "gguf_dequantize")
for name, codes in zip(names, sys.argv[2:7]):
    getattr(lib, name).argtypes = [types[c] for c in codes]
K, rows = 256, 2
xs = [[float(((k * 7 + r) % 15) - 7) for k in range(K)] for r in range(rows)]  # small: every sum below is exact
for row in xs:
    for b in range(0, K, 32):
        row[b] = 127.0  # every block's largest magnitude is 127: its scale is 1, its levels are x
x = (ctypes.c_float * (rows * K))(*[v for row in xs for v in row])
floats = lambda n: (ctypes.c_float * n)()
q, d, s, s16 = (ctypes.c_int8 * (rows * K))(), floats(rows * 8), floats(rows * 8), floats(rows * 16)
if lib.gguf_quantize_rows(x, rows, K, K, q, d, s, s16) or list(q) != [int(v) for row in xs for v in row] \\
        or list(d) != [1.0] * 16 or list(s16)[:2] != [sum(xs[0][:16]), sum(xs[0][16:32])]:
    sys.exit("wrong activation blocks")
half = lambda v: struct.pack("<e", v)
u = [(k * 5) % 16 for k in range(K)]
nibbles = lambda b: bytes(u[b + j] | (u[b + j + 16] << 4) for j in range(16))
q41 = b"".join(half(0.5) + half(-2.0) + nibbles(b) for b in range(0, K, 32))
w8 = [((k * 3) % 255) - 127 for k in range(K)]
q80 = b"".join(half(0.25) + struct.pack("<32b", *w8[b : b + 32]) for b in range(0, K, 32))
sc, mins = [3 + 8 * j for j in range(8)], [60 - 7 * j for j in range(8)]
low6 = lambda v: [v[j] & 63 | (v[j + 4] >> 4) << 6 for j in range(4)]  # and the top bits of v[4..7]
packed = low6(sc) + low6(mins) + [(sc[j + 4] & 15) | (mins[j + 4] & 15) << 4 for j in range(4)]
q4k = half(0.5) + half(0.25) + bytes(packed) + bytes(u[64 * i + l] | u[64 * i + 32 + l] << 4
                                                     for i in range(4) for l in range(32))
k4 = [0.5 * sc[k // 32] * u[k] - 0.25 * mins[k // 32] for k in range(K)]
for kind, blob, weights in ((3, q41, [0.5 * v - 2.0 for v in u]), (8, q80, [0.25 * v for v in w8]), (12, q4k, k4)):
    y = (ctypes.c_float * rows)()
    parts, part_rows = (ctypes.c_char_p * 1)(blob), (ctypes.c_int64 * 1)(1)
    if lib.gguf_linear(kind, q, d, s, s16, rows, K, parts, part_rows, 1, 0, 1, y, 1, 0, None, 1):
        sys.exit("gguf_linear refused its arguments")
    want = [sum(a * b for a, b in zip(row, weights)) for row in xs]
    if list(y) != want:
        sys.exit(f"wrong result for type {kind}: {list(y)} against {want}")
    y = (ctypes.c_float * rows)()  # the same from x, quantized by the call
    if lib.gguf_linear_x(kind, x, 0, K, rows, K, parts, part_rows, 1, 0, 1, y, 1, 0, None, 1) or list(y) != want:
        sys.exit(f"wrong result from x for type {kind}: {list(y)} against {want}")
    out = floats(K)
    if lib.gguf_dequantize(kind, blob, len(blob), 0, 1, K, out, K, 0, 1) or list(out) != weights:
        sys.exit(f"wrong dequantized row for type {kind}")
f16 = b"".join(half(v) for v in k4)
y = (ctypes.c_float * rows)()
if lib.gguf_linear_f16(x, rows, K, K, (ctypes.c_char_p * 1)(f16), (ctypes.c_int64 * 1)(1), 1, 0, 1, y, 1, 0, None, 1) \\
        or list(y) != [sum(a * b for a, b in zip(row, k4)) for row in xs]:
    sys.exit(f"wrong F16 result: {list(y)}")
"""


def row_bytes(qtype: int, in_features: int) -> int:
    _, weights, size = TYPES[qtype]
    return in_features // weights * size


@functools.cache
def native_library(flags: tuple[str, ...] = FLAGS) -> tuple[ctypes.CDLL | None, str]:
    """The compiled kernels and a line saying where they came from, or (None, why not). `flags`: the compiler's
    (the tests build the AVX2 code on an AVX-512 machine too)."""
    library, origin = build_native(SOURCE, SELF_TEST, tuple(SIGNATURES.values()), flags)
    if library is None:
        return None, origin
    types = {"p": ctypes.c_void_p, "i": ctypes.c_int, "q": ctypes.c_int64}
    for name, signature in SIGNATURES.items():
        function = getattr(library, name)
        function.restype = ctypes.c_int
        function.argtypes = [types[code] for code in signature]
    return library, origin


def kernel_runs() -> bool:
    """Whether the C kernels run here (built, and not switched off by INDEXPOOL_KERNELS=torch)."""
    return not torch_forced() and native_library()[0] is not None


def path() -> str:
    """Which code computes on the blocks, and why."""
    if torch_forced():
        return "torch (INDEXPOOL_KERNELS=torch)"
    return native_library()[1]


def float_view(blocks: torch.Tensor, qtype: int) -> torch.Tensor:
    """Rows of a float type's bytes (N, K * size) as the (N, K) values they are, sharing their memory."""
    return blocks.view(FLOAT_TYPES[qtype])


# ------------------------------------------------------------------------------------------------ references


def _halves(raw: torch.Tensor) -> torch.Tensor:
    """fp16 stored as two bytes (..., 2) -> fp32 (...)."""
    return raw.contiguous().view(torch.float16).float().squeeze(-1)


def _k4_scales(packed: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Q4_K's and Q5_K's 12 bytes (..., 12) int -> the 6-bit scales and mins of their 8 sub-blocks (..., 8)."""
    low, high, rest = packed[..., 0:4], packed[..., 4:8], packed[..., 8:12]
    sc = torch.cat([low & 63, (rest & 15) | ((low >> 6) << 4)], dim=-1)
    mins = torch.cat([high & 63, (rest >> 4) | ((high >> 6) << 4)], dim=-1)
    return sc, mins


def _per_weight(values: torch.Tensor, n: int) -> torch.Tensor:
    """(N, blocks, groups) per group of weights -> (N, K / 32, 32), each value repeated over its group."""
    groups = values.shape[-1]
    return values.reshape(n, -1, groups, 1).expand(-1, -1, -1, 256 // groups).reshape(n, -1, 32)


def _two_bit_levels(qs: torch.Tensor, n: int) -> torch.Tensor:
    """Q2_K's and Q3_K's 64 bytes of 2-bit levels (N, S, 64) -> (N, S, 2, 4, 32): weight 128c + 32s + l at
    [c, s, l], bits 2s and 2s + 1 of byte 32c + l."""
    shifts = (2 * torch.arange(4, dtype=torch.int32)).view(1, 1, 1, 4, 1)
    return (qs.reshape(n, -1, 2, 1, 32) >> shifts) & 3


def levels_reference(blocks: torch.Tensor, qtype: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """blocks uint8 (N, row_bytes) of a block type -> (levels int32, scale fp32, offset fp32), each (N, K / 32,
    32): w = scale * level + offset per weight (gguf_blocks.c has the formats; Q8_0's and Q6_K's levels are
    signed here)."""
    n = blocks.shape[0]
    raw = blocks.reshape(n, -1, TYPES[qtype][2])
    if qtype == 10:  # Q2_K: 16 groups of 16, 4-bit scales and mins
        scales = raw[..., :16].int()
        levels = _two_bit_levels(raw[..., 16:80].int(), n).reshape(n, -1, 32)
        d, dmin = _halves(raw[..., 80:82]), _halves(raw[..., 82:84])
        scale, offset = d[..., None] * (scales & 15).float(), -(dmin[..., None] * (scales >> 4).float())
        return levels, _per_weight(scale, n), _per_weight(offset, n)
    if qtype == 11:  # Q3_K: 16 groups of 16, 6-bit signed scales, a third bit adding 4
        high = raw[..., :32].int().reshape(n, -1, 1, 1, 32)
        bit = torch.arange(8, dtype=torch.int32).view(1, 1, 2, 4, 1)  # bit 4c + s for weight 128c + 32s + l
        levels = (_two_bit_levels(raw[..., 32:96].int(), n) | ((high >> bit) & 1) << 2).reshape(n, -1, 32)
        packed = raw[..., 96:108].int()
        low4 = torch.cat([packed[..., :8] & 15, packed[..., :8] >> 4], dim=-1)
        top2 = (packed[..., None, 8:12] >> (2 * torch.arange(4, dtype=torch.int32)).view(4, 1)) & 3  # [g / 4, g % 4]
        scale = _halves(raw[..., 108:110])[..., None] * ((low4 | top2.reshape(n, -1, 16) << 4) - 32).float()
        return levels, _per_weight(scale, n), _per_weight(-4.0 * scale, n)
    if qtype in (12, 13):  # Q4_K, Q5_K: 8 sub-blocks of 32, 6-bit scales and mins
        d, dmin = _halves(raw[..., 0:2]), _halves(raw[..., 2:4])
        sc, mins = _k4_scales(raw[..., 4:16].int())
        nibbles = raw[..., 16:144] if qtype == 12 else raw[..., 48:176]
        nibbles = nibbles.int().reshape(n, -1, 4, 1, 32)
        levels = torch.cat([nibbles & 15, nibbles >> 4], dim=3).reshape(n, -1, 8, 32)
        if qtype == 13:  # bit j of byte l of the high bits: bit 4 of weight 32j + l
            high = raw[..., 16:48].int().reshape(n, -1, 1, 32)
            levels = levels | ((high >> torch.arange(8, dtype=torch.int32).view(1, 1, 8, 1)) & 1) << 4
        scale, offset = d[..., None] * sc.float(), -(dmin[..., None] * mins.float())
        return levels.reshape(n, -1, 32), _per_weight(scale, n), _per_weight(offset, n)
    if qtype == 14:  # Q6_K: two halves of 128, 16 int8 scales of 16 weights
        low = raw[..., :128].int().reshape(n, -1, 2, 2, 32)  # (half, which 32 of its 64 bytes, l)
        high = raw[..., 128:192].int().reshape(n, -1, 2, 1, 32)
        fours = torch.stack([low[..., 0, :] & 15, low[..., 1, :] & 15, low[..., 0, :] >> 4, low[..., 1, :] >> 4], 3)
        twos = (high >> (2 * torch.arange(4, dtype=torch.int32)).view(1, 1, 1, 4, 1)) & 3
        levels = ((fours | (twos << 4)) - 32).reshape(n, -1, 32)
        scales = raw[..., 192:208].contiguous().view(torch.int8).float()
        scale = _halves(raw[..., 208:210])[..., None] * scales
        return levels, _per_weight(scale, n), torch.zeros(n, levels.shape[1], 32)
    scale = _halves(raw[..., 0:2])
    if qtype == 8:
        levels = raw[..., 2:].contiguous().view(torch.int8).int()
        return levels, scale[..., None].expand(-1, -1, 32), torch.zeros(n, levels.shape[1], 32)
    has_min = qtype in (3, 7)
    offset = _halves(raw[..., 2:4]) if has_min else scale * (-8.0 if qtype == 2 else -16.0)
    at = 4 if has_min else 2
    high = None
    if qtype in (6, 7):
        bits = raw[..., at : at + 4].int()
        word = bits[..., 0] | bits[..., 1] << 8 | bits[..., 2] << 16 | bits[..., 3] << 24
        high = ((word[..., None] >> torch.arange(BLOCK, dtype=torch.int32)) & 1) << 4
        at += 4
    nibbles = raw[..., at : at + 16].int()
    levels = torch.cat([nibbles & 15, nibbles >> 4], dim=-1)
    if high is not None:
        levels = levels | high
    return levels, scale[..., None].expand(-1, -1, 32), offset[..., None].expand(-1, -1, 32)


def dequantize_reference(blocks: torch.Tensor, qtype: int) -> torch.Tensor:
    """blocks uint8 (N, row_bytes) -> fp32 weights (N, K): scale * level + offset, rounded once (the float types:
    their values, widened)."""
    if qtype in FLOAT_TYPES:
        return float_view(blocks, qtype).float()
    levels, scale, offset = levels_reference(blocks, qtype)
    weights = torch.addcmul(offset.double(), levels.double(), scale.double()).float()
    return weights.reshape(blocks.shape[0], -1)


def quantize_activations_reference(x: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """x fp32 (R, K) -> (q int8 (R, K / 32, 32), d (R, K / 32), s (R, K / 32), s16 (R, K / 16)): d = max |x| / 127
    per block, q = x / d rounded to nearest (ties to even), s = d * sum(q), s16 the same per 16."""
    blocks = x.float().reshape(x.shape[0], -1, BLOCK)
    d = blocks.abs().amax(dim=-1) / 127.0
    inverse = torch.where(d > 0, 1.0 / d, torch.zeros_like(d))
    q = torch.round(blocks * inverse[..., None]).to(torch.int8)
    sums16 = q.reshape(x.shape[0], -1, 2, 16).sum(dim=-1, dtype=torch.int32).float()
    return q, d, d * sums16.sum(dim=-1), (d[..., None] * sums16).reshape(x.shape[0], -1)


def linear_reference(x: torch.Tensor, blocks: torch.Tensor, qtype: int) -> torch.Tensor:
    """x (..., K) against the blocks (N, row_bytes) as the kernel computes it: the activations in int8 blocks
    (`quantize_activations_reference`; the float types: as they are) against the weights, summed exactly (in
    double) -> (..., N) fp32."""
    flat = x.reshape(-1, x.shape[-1]).float()
    if qtype in FLOAT_TYPES:
        rounded = flat.double()
    else:
        q, d, _, _ = quantize_activations_reference(flat)
        rounded = (q.double() * d[..., None].double()).reshape(flat.shape)
    weights = dequantize_reference(blocks, qtype).double()
    return (rounded @ weights.T).float().reshape(*x.shape[:-1], blocks.shape[0])


def activation_error_bound(x: torch.Tensor, blocks: torch.Tensor, qtype: int) -> torch.Tensor:
    """How far `linear_reference` may be from the exact product x @ W.T: each activation is moved by at most half
    its block's step d / 2, so an output moves by at most sum over k of |w_k| * d_k / 2 (fp32 rounding aside)."""
    flat = x.reshape(-1, x.shape[-1]).float()
    _, d, _, _ = quantize_activations_reference(flat)
    step = d.repeat_interleave(BLOCK, dim=-1) / 2  # (R, K)
    return (step @ dequantize_reference(blocks, qtype).abs().T).reshape(*x.shape[:-1], blocks.shape[0])


# ------------------------------------------------------------------------------------------------ the kernels


def _check(blocks: torch.Tensor, qtype: int, in_features: int) -> None:
    if qtype not in TYPES or in_features % TYPES[qtype][1]:
        raise ValueError(f"no block kernel for ggml type {qtype} with {in_features} inputs")
    if blocks.dtype != torch.uint8 or blocks.dim() != 2 or blocks.shape[1] != row_bytes(qtype, in_features) \
            or blocks.stride(1) != 1 or blocks.stride(0) != blocks.shape[1]:
        raise ValueError(f"not {TYPES[qtype][0]} rows of {in_features} weights: {tuple(blocks.shape)} {blocks.dtype}")


def _threads(n: int, k: int) -> int:
    """Threads for N outputs of K inputs: torch's thread count, fewer for small layers (as cpu_linear's kernels:
    a hand-off costs more than a share of a small layer computes)."""
    return min(torch.get_num_threads(), max(1, n * k // cpu_linear.THREAD_MIN_WEIGHTS), n // 64 or 1)


class Matrices:
    """One or more matrices of one ggml type whose output rows follow one another (a fused layer), with what the
    kernel takes for them made once (a decode step calls it per layer and token). Their N outputs go to columns
    `columns` (int64 (N,)) of rows `width` wide (a layer's outputs reordered, or several runs of types side by
    side); by default to columns 0 .. N - 1."""

    def __init__(self, parts: list[torch.Tensor], qtype: int, in_features: int, columns: torch.Tensor | None = None,
                 width: int | None = None):
        for part in parts:
            _check(part, qtype, in_features)
        self.parts, self.qtype, self.in_features = parts, qtype, in_features
        self.out_features = sum(part.shape[0] for part in parts)
        self.width = self.out_features if width is None else width
        if columns is not None:
            columns = columns.to(torch.int64).contiguous()
            if columns.shape != (self.out_features,) or columns.min() < 0 or columns.max() >= self.width:
                raise ValueError(f"not {self.out_features} columns of rows {self.width} wide: {tuple(columns.shape)}")
        elif self.width < self.out_features:
            raise ValueError(f"{self.out_features} outputs do not fit rows {self.width} wide")
        self.columns = columns
        self.pointers = (ctypes.c_void_p * len(parts))(*[part.data_ptr() for part in parts])
        self.part_rows = (ctypes.c_int64 * len(parts))(*[part.shape[0] for part in parts])


def quantize_activations(x: torch.Tensor, library: ctypes.CDLL | None = None) -> tuple[torch.Tensor, ...]:
    """`quantize_activations_reference` by the C kernel, x fp32 (R, K) with unit stride along K."""
    rows, k = x.shape
    q = torch.empty(rows, k, dtype=torch.int8)
    d, s, s16 = torch.empty(rows, k // BLOCK), torch.empty(rows, k // BLOCK), torch.empty(rows, k // 16)
    if (library or native_library()[0]).gguf_quantize_rows(x.data_ptr(), rows, x.stride(0), k, q.data_ptr(),
                                                           d.data_ptr(), s.data_ptr(), s16.data_ptr()):
        raise ValueError(f"activations of width {k} are not whole blocks of {BLOCK}")
    return q, d, s, s16


def linear(x: torch.Tensor, blocks: torch.Tensor | list[torch.Tensor] | Matrices, qtype: int,
           activations: tuple[torch.Tensor, ...] | None = None, library: ctypes.CDLL | None = None,
           out: torch.Tensor | None = None) -> torch.Tensor:
    """`linear_reference` by the C kernel (which must have built: `kernel_runs`), split over torch's threads.
    blocks: one matrix, several of the same type whose output rows follow one another (a fused layer: one call
    for all), or those as `Matrices`. `activations`: x already quantized (`quantize_activations`); else the kernel
    quantizes x itself (fp32 or bf16 rows). -> (..., width) fp32, or `out` (R, width) fp32 or bf16 written into:
    the outputs in the matrices' columns (`Matrices`), the others untouched."""
    flat = x.reshape(-1, x.shape[-1])
    rows, k = flat.shape
    matrices = blocks if isinstance(blocks, Matrices) else \
        Matrices(blocks if isinstance(blocks, list) else [blocks], qtype, k)
    if matrices.qtype != qtype or matrices.in_features != k:
        raise ValueError(f"{TYPES[matrices.qtype][0]} matrices of {matrices.in_features} inputs, not {qtype}/{k}")
    n, columns = matrices.out_features, matrices.columns
    y = torch.empty(rows, matrices.width) if out is None else out
    if y.dtype not in (torch.float32, torch.bfloat16) or y.shape != (rows, matrices.width) or y.stride(1) != 1:
        raise ValueError(f"no fp32 or bf16 rows ({rows}, {matrices.width}) for the outputs: {tuple(y.shape)} {y.dtype}")
    if qtype in TORCH_TYPES:
        x32 = flat.float()
        product = torch.cat([F.linear(x32, float_view(part, qtype)) if qtype == 0 or not cpu_linear.kernel_runs()
                             else cpu_linear.linear_bf16(x32, float_view(part, qtype)) for part in matrices.parts], -1)
        if columns is None:
            y[:, :n] = product
        else:
            y.index_copy_(1, columns, product.to(y.dtype))
        return y if out is not None else y.reshape(*x.shape[:-1], matrices.width)
    library = library or native_library()[0]
    where = (y.data_ptr(), y.stride(0), y.dtype == torch.bfloat16, None if columns is None else columns.data_ptr(),
             _threads(n, k))
    if qtype == 1:
        x32 = flat.float().contiguous()
        status = library.gguf_linear_f16(x32.data_ptr(), rows, k, k, matrices.pointers, matrices.part_rows,
                                         len(matrices.parts), 0, n, *where)
    elif activations is not None:
        q, d, s, s16 = activations
        status = library.gguf_linear(qtype, q.data_ptr(), d.data_ptr(), s.data_ptr(), s16.data_ptr(), rows, k,
                                     matrices.pointers, matrices.part_rows, len(matrices.parts), 0, n, *where)
    else:
        if flat.dtype not in (torch.float32, torch.bfloat16) or flat.stride(1) != 1:
            flat = flat.float().contiguous()
        status = library.gguf_linear_x(qtype, flat.data_ptr(), flat.dtype == torch.bfloat16, flat.stride(0), rows,
                                       k, matrices.pointers, matrices.part_rows, len(matrices.parts), 0, n, *where)
    if status:
        raise ValueError("the GGUF block kernel refused its arguments")
    return y if out is not None else y.reshape(*x.shape[:-1], matrices.width)


def int8_prompts(qtype: int, dtype: torch.dtype) -> bool:
    """Whether a prompt's rows of `dtype` against a `qtype` matrix go to `prompt_linear` (int8 products) rather than
    to `matmul_dequantized`: fp32 rows (1.4-1.9x the fp32 GEMM's rate with AVX2 code, Q8_0 1.15x; 2.2-2.4x with
    VNNI; bf16 GEMMs keep pace with it, and AMX's pass it) and a quantized format."""
    return dtype == torch.float32 and qtype in PROMPT_TYPES and kernel_runs()


def prompt_linear(x: torch.Tensor, blocks: torch.Tensor, qtype: int, in_features: int,
                  activations: tuple[torch.Tensor, ...] | None = None, out: torch.Tensor | None = None,
                  columns: torch.Tensor | None = None, library: ctypes.CDLL | None = None) -> torch.Tensor:
    """`linear_reference` for many rows (a prompt's) by the tiled kernel: x (R, K) fp32, or its int8 blocks
    `activations` (`quantize_activations`, made once for a layer's parts), against a matrix of a `PROMPT_TYPES`
    format -> (R, N) fp32, or written into `out`: (R, N) fp32 or bf16, or with `columns` (N,) the wider output
    whose column columns[j] takes output j."""
    _check(blocks, qtype, in_features)
    if qtype not in PROMPT_TYPES:
        raise ValueError(f"no prompt kernel for {TYPES[qtype][0]}: it takes the quantized formats")
    activations = activations or quantize_activations(x.float().contiguous(), library)
    q, d, s, s16 = activations
    rows, n = q.shape[0], blocks.shape[0]
    out = torch.empty(rows, n) if out is None else out
    if columns is not None:
        columns = columns.to(torch.int64).contiguous()
    fits = out.shape[1] == n if columns is None else \
        columns.shape == (n,) and (n == 0 or 0 <= columns.min() <= columns.max() < out.shape[1])
    if out.dtype not in (torch.float32, torch.bfloat16) or out.shape[0] != rows or out.stride(1) != 1 or not fits:
        raise ValueError(f"no fp32 or bf16 rows ({rows}, {n}) for the outputs: {tuple(out.shape)} {out.dtype}")
    status = (library or native_library()[0]).gguf_prompt_linear(
        qtype, q.data_ptr(), d.data_ptr(), s.data_ptr(), s16.data_ptr(), rows, in_features, blocks.data_ptr(), n,
        out.data_ptr(), out.stride(0), out.dtype == torch.bfloat16, None if columns is None else columns.data_ptr(),
        _threads(n, in_features))
    if status:
        raise ValueError("the GGUF prompt kernel refused its arguments")
    return out


def prompt_products(activations: tuple[torch.Tensor, ...], blocks: torch.Tensor, qtype: int, in_features: int,
                    chunk_bytes: int = 8 << 20) -> Iterator[tuple[int, torch.Tensor]]:
    """`prompt_linear` a slice of the matrix's rows at a time (at most `chunk_bytes` of fp32 products, in a buffer
    kept between calls): (first output, the (R, slice) product), as `dequantized_products` yields them."""
    rows = activations[0].shape[0]
    step = max(TILE_ROWS, chunk_bytes // (4 * rows) // TILE_ROWS * TILE_ROWS)
    for first in range(0, blocks.shape[0], step):
        part = blocks[first : first + step]
        yield first, prompt_linear(None, part, qtype, in_features, activations,
                                   out=_scratch_rows(rows, part.shape[0], torch.float32))


def dequantize(blocks: torch.Tensor, qtype: int, in_features: int, out: torch.Tensor | None = None,
               library: ctypes.CDLL | None = None, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """`dequantize_reference` by the C kernel, in fp32 or bf16 (`dtype`, or out's: (N, K) rows, given or made),
    split over torch's threads; the float types converted by torch."""
    _check(blocks, qtype, in_features)
    n = blocks.shape[0]
    out = torch.empty(n, in_features, dtype=dtype) if out is None else out
    if out.dtype not in (torch.float32, torch.bfloat16) or out.shape != (n, in_features) or out.stride(1) != 1:
        raise ValueError(f"no fp32 or bf16 rows of {in_features} for the weights: {tuple(out.shape)} {out.dtype}")
    if qtype in FLOAT_TYPES:
        return out.copy_(float_view(blocks, qtype))
    library = library or native_library()[0]
    if library.gguf_dequantize(qtype, blocks.data_ptr(), blocks.shape[1], 0, n, in_features, out.data_ptr(),
                               out.stride(0), out.dtype == torch.bfloat16, _threads(n, in_features)):
        raise ValueError("the GGUF block kernel refused its arguments")
    return out


_scratch = threading.local()


def _scratch_rows(rows: int, columns: int, dtype: torch.dtype) -> torch.Tensor:
    """A thread's buffer for dequantized slices, kept between calls: fresh pages cost more than the
    dequantization (8192x2048 to fp32: ~60 ms faulting them in, ~7 ms into a buffer used before)."""
    buffers = _scratch.__dict__.setdefault("buffers", {})
    buffer = buffers.get(dtype)
    if buffer is None or buffer.numel() < rows * columns:
        with torch.inference_mode(False):  # a buffer made in inference mode could not be written outside it
            buffer = buffers[dtype] = torch.empty(rows * columns, dtype=dtype)
    return buffer[: rows * columns].view(rows, columns)


def dequantized_products(x: torch.Tensor, blocks: torch.Tensor, qtype: int, in_features: int,
                         chunk_bytes: int = 8 << 20) -> Iterator[tuple[int, torch.Tensor]]:
    """x (R, K) @ W.T for many rows, a slice of W's rows at a time: (first output, the (R, slice) product in x's
    dtype) for each slice, W's slice dequantized (at most `chunk_bytes` of fp32; in x's dtype where that is bf16)
    into a buffer kept between calls. A float type in x's dtype is multiplied as it lies, in one slice."""
    if FLOAT_TYPES.get(qtype) == x.dtype:
        yield 0, F.linear(x, float_view(blocks, qtype))
        return
    # 8 MiB slices: a 512-token prompt's GEMM is as fast as with whole matrices, and the buffer stays small. Rows
    # a multiple of 64: a bf16 GEMM of 682 or 1,365 output columns ran at half the speed of one of 640 or 1,344 (AMX)
    step = max(64, chunk_bytes // (4 * in_features) // 64 * 64)
    native = kernel_runs()
    into = x.dtype if x.dtype in (torch.float32, torch.bfloat16) else torch.float32
    for first in range(0, blocks.shape[0], step):
        part = blocks[first : first + step]
        if native:
            w = dequantize(part, qtype, in_features, _scratch_rows(part.shape[0], in_features, into))
        else:
            w = dequantize_reference(part, qtype)
        yield first, x @ w.to(x.dtype).T


def matmul_dequantized(x: torch.Tensor, blocks: torch.Tensor, qtype: int, in_features: int,
                       chunk_bytes: int = 8 << 20, out: torch.Tensor | None = None,
                       columns: torch.Tensor | None = None) -> torch.Tensor:
    """x (R, K) @ W.T for many rows (`dequantized_products`) -> (R, N) in x's dtype, written into `out` where given:
    (R, N) (a column slice of a wider output: no (R, N) temporary beside it), or with `columns` (N,) the wider
    output whose column columns[j] takes output j."""
    out = torch.empty(x.shape[0], blocks.shape[0], dtype=x.dtype) if out is None else out
    for first, product in dequantized_products(x, blocks, qtype, in_features, chunk_bytes):
        write_columns(out, first, product, columns)
    return out


def write_columns(out: torch.Tensor, first: int, product: torch.Tensor, columns: torch.Tensor | None) -> None:
    """Outputs first .. first + width of a product (R, width) into out: its columns first.., or with `columns` the
    columns columns[first..] lists."""
    if columns is None:
        out[:, first : first + product.shape[1]] = product
    else:
        out.index_copy_(1, columns[first : first + product.shape[1]], product.to(out.dtype))
