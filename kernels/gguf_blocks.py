"""Linear layers on a GGUF file's own quantized blocks, in C (`gguf_blocks.c`), next to their torch reference.

A model brought from llama.cpp or Ollama keeps its weights in blocks along the input: Q4_0, Q4_1, Q5_0, Q5_1 and
Q8_0 (32 weights a block) and the K-quants Q4_K and Q6_K (256; a Q4_K_M file is mostly these two). The formats
are in gguf_blocks.c. Rather than a dequantized copy of the model (4-8x the file in fp32 or
bf16), the engine keeps the blocks where they lie in the memory-mapped file and computes on them:
  - few rows (a decode step): `linear` quantizes the activations to int8 blocks of 32 (`quantize_activations`)
    and sums integer products block by block, as llama.cpp's CPU engine does; the error against the exact product
    is the activations' rounding only (at most half a step d_x / 2 per input: `activation_error_bound`);
  - many rows (prefill): `dequantize` gives a slice of the matrix's rows in fp32 at a time, and torch multiplies.

`*_reference` are the same computations in plain torch (the kernels' tests compare them on awkward shapes, and
the engine runs them where the library does not build or INDEXPOOL_KERNELS=torch). The library is built on first
use (`kernels.native_build`) and needs AVX2, FMA and F16C.
"""

from __future__ import annotations

import ctypes
import functools
from pathlib import Path

import torch

from . import torch_forced
from .cpu_linear import run_in_threads
from .native_build import build_native

SOURCE = Path(__file__).with_name("gguf_blocks.c")
BLOCK = 32
# ggml type number -> (name, weights per block, bytes per block)
TYPES = {2: ("Q4_0", 32, 18), 3: ("Q4_1", 32, 20), 6: ("Q5_0", 32, 22), 7: ("Q5_1", 32, 24), 8: ("Q8_0", 32, 34),
         12: ("Q4_K", 256, 144), 14: ("Q6_K", 256, 210)}
QUANTIZE_SIGNATURE = "pqqq" + "ppp"
LINEAR_SIGNATURE = "ipppqq" + "ppqqq" + "pq"
DEQUANTIZE_SIGNATURE = "ipqqqq" + "pq"

# A known answer, checked in a child process on a freshly built library before it is used: a Q4_1 row and a Q8_0
# row of 64 weights against 2 rows of activations whose int8 blocks are exact (small integers, max 127), and one
# row dequantized; every sum is an integer times a power of two, exact in fp32.
SELF_TEST = """
import ctypes, struct, sys
lib = ctypes.CDLL(sys.argv[1])
types = {"p": ctypes.c_void_p, "i": ctypes.c_int, "q": ctypes.c_int64}
for name, codes in zip(("gguf_quantize_rows", "gguf_linear", "gguf_dequantize"), sys.argv[2:5]):
    getattr(lib, name).argtypes = [types[c] for c in codes]
K, rows = 64, 2
xs = [[float(((k * 7 + r) % 255) - 127) for k in range(K)] for r in range(rows)]
for row in xs:
    row[0] = row[32] = 127.0  # every block's largest magnitude is 127: its scale is 1, its levels are x
x = (ctypes.c_float * (rows * K))(*[v for row in xs for v in row])
q, d, s = (ctypes.c_int8 * (rows * K))(), (ctypes.c_float * (rows * 2))(), (ctypes.c_float * (rows * 2))()
if lib.gguf_quantize_rows(x, rows, K, K, q, d, s) or list(q) != [int(v) for row in xs for v in row] or list(d) != [1.0] * 4:
    sys.exit("wrong activation blocks")
half = lambda v: struct.pack("<e", v)
u = [(k * 5) % 16 for k in range(K)]
q41 = b"".join(half(0.5) + half(-2.0) + bytes(u[b + j] | (u[b + j + 16] << 4) for j in range(16)) for b in (0, 32))
w8 = [((k * 3) % 255) - 127 for k in range(K)]
q80 = b"".join(half(0.25) + struct.pack("<32b", *w8[b : b + 32]) for b in (0, 32))
for kind, blob, weights in ((3, q41, [0.5 * v - 2.0 for v in u]), (8, q80, [0.25 * v for v in w8])):
    y = (ctypes.c_float * rows)()
    parts, part_rows = (ctypes.c_char_p * 1)(blob), (ctypes.c_int64 * 1)(1)
    if lib.gguf_linear(kind, q, d, s, rows, K, parts, part_rows, 1, 0, 1, y, 1):
        sys.exit("gguf_linear refused its arguments")
    want = [sum(a * b for a, b in zip(row, weights)) for row in xs]
    if list(y) != want:
        sys.exit(f"wrong result for type {kind}: {list(y)} against {want}")
    out = (ctypes.c_float * K)()
    if lib.gguf_dequantize(kind, blob, len(blob), 0, 1, K, out, K) or list(out) != weights:
        sys.exit(f"wrong dequantized row for type {kind}")
"""


def row_bytes(qtype: int, in_features: int) -> int:
    _, weights, size = TYPES[qtype]
    return in_features // weights * size


@functools.cache
def native_library() -> tuple[ctypes.CDLL | None, str]:
    """The compiled kernels and a line saying where they came from, or (None, why not)."""
    library, origin = build_native(SOURCE, SELF_TEST, (QUANTIZE_SIGNATURE, LINEAR_SIGNATURE, DEQUANTIZE_SIGNATURE))
    if library is None:
        return None, origin
    types = {"p": ctypes.c_void_p, "i": ctypes.c_int, "q": ctypes.c_int64}
    for function, signature in ((library.gguf_quantize_rows, QUANTIZE_SIGNATURE),
                                (library.gguf_linear, LINEAR_SIGNATURE),
                                (library.gguf_dequantize, DEQUANTIZE_SIGNATURE)):
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


# ------------------------------------------------------------------------------------------------ references


def _halves(raw: torch.Tensor) -> torch.Tensor:
    """fp16 stored as two bytes (..., 2) -> fp32 (...)."""
    return raw.contiguous().view(torch.float16).float().squeeze(-1)


def levels_reference(blocks: torch.Tensor, qtype: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """blocks uint8 (N, row_bytes) -> (levels int32, scale fp32, offset fp32), each (N, K / 32, 32): w = scale *
    level + offset per weight (gguf_blocks.c has the formats; Q8_0's and Q6_K's levels are signed)."""
    n = blocks.shape[0]
    raw = blocks.reshape(n, -1, TYPES[qtype][2])
    if qtype == 12:  # Q4_K: 8 sub-blocks of 32, 6-bit scales and mins
        d, dmin, packed = _halves(raw[..., 0:2]), _halves(raw[..., 2:4]), raw[..., 4:16].int()
        low, high = packed[..., 0:4], packed[..., 4:8]
        sc = torch.cat([low & 63, (packed[..., 8:12] & 15) | ((low >> 6) << 4)], dim=-1)
        mins = torch.cat([high & 63, (packed[..., 8:12] >> 4) | ((high >> 6) << 4)], dim=-1)
        nibbles = raw[..., 16:].int().reshape(n, -1, 4, 1, 32)
        levels = torch.cat([nibbles & 15, nibbles >> 4], dim=3).reshape(n, -1, 32)
        scale = (d[..., None] * sc.float()).reshape(n, -1, 1).expand(-1, -1, 32)
        offset = (-(dmin[..., None] * mins.float())).reshape(n, -1, 1).expand(-1, -1, 32)
        return levels, scale, offset
    if qtype == 14:  # Q6_K: two halves of 128, 16 int8 scales of 16 weights
        low = raw[..., :128].int().reshape(n, -1, 2, 2, 32)  # (half, which 32 of its 64 bytes, l)
        high = raw[..., 128:192].int().reshape(n, -1, 2, 1, 32)
        fours = torch.stack([low[..., 0, :] & 15, low[..., 1, :] & 15, low[..., 0, :] >> 4, low[..., 1, :] >> 4], 3)
        twos = (high >> (2 * torch.arange(4, dtype=torch.int32)).view(1, 1, 1, 4, 1)) & 3
        levels = ((fours | (twos << 4)) - 32).reshape(n, -1, 32)
        scales = raw[..., 192:208].contiguous().view(torch.int8).float().reshape(n, -1, 2, 8)
        scale = (_halves(raw[..., 208:210])[..., None, None] * scales).reshape(n, -1, 2, 8)
        scale = scale.reshape(n, -1, 2, 4, 2, 1).expand(-1, -1, -1, -1, -1, 16).reshape(n, -1, 32)
        return levels, scale, torch.zeros_like(scale)
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
    """blocks uint8 (N, row_bytes) -> fp32 weights (N, K): scale * level + offset, rounded once."""
    levels, scale, offset = levels_reference(blocks, qtype)
    weights = torch.addcmul(offset.double(), levels.double(), scale.double()).float()
    return weights.reshape(blocks.shape[0], -1)


def quantize_activations_reference(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """x fp32 (R, K) -> (q int8 (R, K / 32, 32), d (R, K / 32), s (R, K / 32)): d = max |x| / 127 per block, q =
    x / d rounded to nearest (ties to even), s = d * sum(q)."""
    blocks = x.float().reshape(x.shape[0], -1, BLOCK)
    d = blocks.abs().amax(dim=-1) / 127.0
    inverse = torch.where(d > 0, 1.0 / d, torch.zeros_like(d))
    q = torch.round(blocks * inverse[..., None]).to(torch.int8)
    return q, d, d * q.sum(dim=-1, dtype=torch.int32).float()


def linear_reference(x: torch.Tensor, blocks: torch.Tensor, qtype: int) -> torch.Tensor:
    """x (..., K) against the blocks (N, row_bytes) as the kernel computes it: the activations in int8 blocks
    (`quantize_activations_reference`) against the weights, summed exactly (in double) -> (..., N) fp32."""
    flat = x.reshape(-1, x.shape[-1]).float()
    q, d, _ = quantize_activations_reference(flat)
    rounded = (q.double() * d[..., None].double()).reshape(flat.shape)
    levels, scale, offset = levels_reference(blocks, qtype)
    weights = torch.addcmul(offset.double(), levels.double(), scale.double()).reshape(blocks.shape[0], -1)
    return (rounded @ weights.T).float().reshape(*x.shape[:-1], blocks.shape[0])


def activation_error_bound(x: torch.Tensor, blocks: torch.Tensor, qtype: int) -> torch.Tensor:
    """How far `linear_reference` may be from the exact product x @ W.T: each activation is moved by at most half
    its block's step d / 2, so an output moves by at most sum over k of |w_k| * d_k / 2 (fp32 rounding aside)."""
    flat = x.reshape(-1, x.shape[-1]).float()
    _, d, _ = quantize_activations_reference(flat)
    step = d.repeat_interleave(BLOCK, dim=-1) / 2  # (R, K)
    return (step @ dequantize_reference(blocks, qtype).abs().T).reshape(*x.shape[:-1], blocks.shape[0])


# ------------------------------------------------------------------------------------------------ the kernels


def _check(blocks: torch.Tensor, qtype: int, in_features: int) -> None:
    if qtype not in TYPES or in_features % TYPES[qtype][1]:
        raise ValueError(f"no block kernel for ggml type {qtype} with {in_features} inputs")
    if blocks.dtype != torch.uint8 or blocks.dim() != 2 or blocks.shape[1] != row_bytes(qtype, in_features) \
            or blocks.stride(1) != 1 or blocks.stride(0) != blocks.shape[1]:
        raise ValueError(f"not {TYPES[qtype][0]} rows of {in_features} weights: {tuple(blocks.shape)} {blocks.dtype}")


def quantize_activations(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """`quantize_activations_reference` by the C kernel, x fp32 (R, K) with unit stride along K."""
    rows, k = x.shape
    q = torch.empty(rows, k, dtype=torch.int8)
    d, s = torch.empty(rows, k // BLOCK), torch.empty(rows, k // BLOCK)
    if native_library()[0].gguf_quantize_rows(x.data_ptr(), rows, x.stride(0), k, q.data_ptr(), d.data_ptr(),
                                              s.data_ptr()):
        raise ValueError(f"activations of width {k} are not whole blocks of {BLOCK}")
    return q, d, s


def linear(x: torch.Tensor, blocks: torch.Tensor | list[torch.Tensor], qtype: int,
           activations: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
    """`linear_reference` by the C kernel (which must have built: `kernel_runs`), split over torch's threads.
    blocks: one matrix, or several of the same type whose output rows follow one another (a fused layer: one call
    for all). `activations`: x already quantized (`quantize_activations`)."""
    flat = x.reshape(-1, x.shape[-1])
    rows, k = flat.shape
    parts = blocks if isinstance(blocks, list) else [blocks]
    for part in parts:
        _check(part, qtype, k)
    if activations is None:
        activations = quantize_activations(flat.float().contiguous())
    q, d, s = activations
    n = sum(part.shape[0] for part in parts)
    y = torch.empty(rows, n)
    pointers = (ctypes.c_void_p * len(parts))(*[part.data_ptr() for part in parts])
    part_rows = (ctypes.c_int64 * len(parts))(*[part.shape[0] for part in parts])
    library = native_library()[0]
    run_in_threads(lambda first, end: library.gguf_linear(qtype, q.data_ptr(), d.data_ptr(), s.data_ptr(), rows, k,
                                                          pointers, part_rows, len(parts), first, end, y.data_ptr(),
                                                          n), rows, n, k)
    return y.reshape(*x.shape[:-1], n)


def dequantize(blocks: torch.Tensor, qtype: int, in_features: int, out: torch.Tensor | None = None) -> torch.Tensor:
    """`dequantize_reference` by the C kernel (into `out`, fp32 (N, K), when given), split over torch's threads."""
    _check(blocks, qtype, in_features)
    n = blocks.shape[0]
    out = torch.empty(n, in_features) if out is None else out
    library = native_library()[0]
    run_in_threads(lambda first, end: library.gguf_dequantize(qtype, blocks.data_ptr(), blocks.shape[1], first, end,
                                                              in_features, out[first:].data_ptr(), in_features),
                   1, n, in_features)
    return out


def matmul_dequantized(x: torch.Tensor, blocks: torch.Tensor, qtype: int, in_features: int,
                       chunk_bytes: int = 64 << 20) -> torch.Tensor:
    """x (R, K) @ W.T for many rows: W dequantized a slice of rows at a time (at most `chunk_bytes` of fp32),
    multiplied in x's dtype -> (R, N) in x's dtype."""
    n = blocks.shape[0]
    y = torch.empty(x.shape[0], n, dtype=x.dtype)
    step = max(64, chunk_bytes // (4 * in_features))
    native = kernel_runs()
    for first in range(0, n, step):
        part = blocks[first : first + step]
        w = dequantize(part, qtype, in_features) if native else dequantize_reference(part, qtype)
        y[:, first : first + part.shape[0]] = x @ w.to(x.dtype).T
    return y
