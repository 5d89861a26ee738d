"""Attention on the CPU in C (`cpu_attention.c`), next to its torch reference: a decode kernel and a prefill kernel.

A decode step's attention reads the whole K/V cache for one query per sequence. torch's SDPA read a bf16 cache at
about a quarter of the memory bandwidth one core has on the AVX512-BF16 CPU measured, and at 4K context that was
half of a decode step (docs/benchmarks.md). The decode kernel reads each cached key and value once for all the
query heads of its KV head (and for IndexPool gathers the selected tokens and rotates their keys itself, and gives
each query row's attention probabilities, which `ask` points at its sources with). The
prefill kernel computes a prompt segment's attention flash style, its products laid out as outer products: with
bf16 dot products about twice as fast as PyTorch's flash kernel on an AVX512-BF16 CPU without AMX; with fp32 FMAs
on an AVX2 CPU, one thread, 1.21x as fast as the flash kernel over a 4K prompt read in 512-token segments (it
skips the key blocks a segment's mask hides, which the flash kernel computes). It runs only where it measured
faster.

The decode kernel needs AVX-512 (fp32 caches; bf16 ones with AVX512-BF16), or AVX2 with FMA (fp32 and bf16
caches, bf16 widened to fp32); the prefill kernel bf16 with AVX512-BF16 or fp32 with AVX2 and no AVX-512
(`prefill_kernel_runs`). The library is compiled on
first use with the system's C compiler (`$CC`, else `cc`) for this CPU (`-march=native`), checked in a child
process, and kept in the indexpool cache directory; no build step at install. Without a compiler or those
instructions, on GPUs, or with INDEXPOOL_KERNELS=torch, the torch path runs instead; `indexpool info` says which.
"""

from __future__ import annotations

import ctypes
import functools
from pathlib import Path

import torch
import torch.nn.functional as F

from . import BACKEND_VARIABLE, torch_forced
from .native_build import build_native

SOURCE = Path(__file__).with_name("cpu_attention.c")
MAX_ROWS = 16  # query heads per KV head, as in the C source
# decode_attention's arguments, one letter each: p pointer, i int, q int64, f float
SIGNATURE = "pppppp" + "iiiii" + "qqqq" + "f" + "ppp" + "q" + "p"
# The most torch threads the fp32 prefill kernel runs under (see prefill_kernel_runs; a benchmark or test may raise it)
FP32_PREFILL_THREADS = 1
PREFILL_SIGNATURE = "pppppppp" + "iiiiii" + "q" * 4 + "q" * 12 + "qqq" + "f"  # prefill_attention's


def decode_attention_reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                               mask: torch.Tensor | None) -> torch.Tensor:
    """Attention of R query rows per KV head, q (B, KV, R, D), against k/v (B, KV, S, D); returns (B, KV, R, D).
    A decode step passes each KV head's query heads as its rows rather than going through the grouped-query path
    (`enable_gqa`): on an AMD EPYC with AVX512-BF16 but no AMX, one layer of a bf16 decode step against 4,096 cached
    keys took 3.96 ms that way, 0.60 ms this way (docs/benchmarks.md). mask: additive, broadcastable to
    (B, 1, 1, S)."""
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask)


# Run in a child process on a freshly built library before it is used: a VM can advertise instructions it then
# faults on (llama.cpp's native build died of an illegal instruction on one), and that must cost a fallback to torch,
# not the process. Uniform keys make the expected output the mean of the values; lse = log(keys) + the one logit.
SELF_TEST = """
import ctypes, math, struct, sys
lib = ctypes.CDLL(sys.argv[1])
types = {"p": ctypes.c_void_p, "i": ctypes.c_int, "q": ctypes.c_int64, "f": ctypes.c_float}
lib.decode_attention.argtypes = [types[code] for code in sys.argv[2]]
dim, keys = 64, 37
values = [float(j % 4) for j in range(keys) for _ in range(dim)]
index = (ctypes.c_int64 * keys)(*range(keys))  # gathered in order, rotated by angle 0: the same attention
cos, sin = (ctypes.c_float * (keys * dim))(*[1.0] * (keys * dim)), (ctypes.c_float * (keys * dim))()
packs = {  # element size: (pack a list of floats, unpack bytes to floats); bf16 is the upper half of an fp32
    4: (lambda xs: struct.pack(f"{len(xs)}f", *xs), lambda raw: struct.unpack(f"{len(raw) // 4}f", raw)),
    2: (lambda xs: struct.pack(f"{len(xs)}H", *(struct.unpack("I", struct.pack("f", x))[0] >> 16 for x in xs)),
        lambda raw: [struct.unpack("f", struct.pack("I", h << 16))[0] for h in struct.unpack(f"{len(raw) // 2}H", raw)]),
}
for size in (4, 2):
    if not lib.decode_attention_supports(size, dim):
        continue
    pack, unpack = packs[size]
    q, k, v = (ctypes.create_string_buffer(pack(xs)) for xs in ([0.5] * 2 * dim, [0.25] * keys * dim, values))
    for extra in ((None, None, None, 0), (index, cos, sin, 0)):
        out, lse = ctypes.create_string_buffer(2 * dim * size), (ctypes.c_float * 2)()
        probs = (ctypes.c_float * (2 * keys))()
        status = lib.decode_attention(q, k, v, None, out, lse, size, 1, 1, 2, dim, keys, keys * dim, keys * dim, dim,
                                      dim ** -0.5, *extra, probs)
        got = unpack(out.raw)
        mean, logit = sum(j % 4 for j in range(keys)) / keys, 0.5 * 0.25 * dim * dim ** -0.5
        if (status != 0 or any(abs(x - mean) > 1e-2 for x in got)
                or any(abs(x - logit - math.log(keys)) > 1e-4 for x in lse)
                or any(abs(p - 1 / keys) > 1e-6 for p in probs)):
            sys.exit(f"wrong result (element size {size}, gathered: {extra[0] is not None})")
lib.prefill_attention.argtypes = [types[code] for code in sys.argv[3]]
for size in (4, 2):  # prefill (fp32 on AVX2, bf16 on AVX512-BF16): 3 queries at positions 34..36, 2 heads
    if not lib.prefill_attention_supports(size, dim):
        continue
    pack, unpack = packs[size]
    start, tokens = keys - 3, 3
    q, k, v = (ctypes.create_string_buffer(pack(xs)) for xs in ([0.5] * 2 * tokens * dim, [0.25] * keys * dim, values))
    out = ctypes.create_string_buffer(2 * tokens * dim * size)
    status = lib.prefill_attention(q, out, None, k, v, None, None, None, size, 2, 1, 1, 2, dim, tokens, keys,
                                   start, 0, 2 * tokens * dim, 2 * tokens * dim, tokens * dim, dim,
                                   2 * tokens * dim, 2 * tokens * dim, tokens * dim, dim, 0, 0, 0, 0,
                                   keys * dim, keys * dim, dim, dim ** -0.5)
    got = unpack(out.raw)
    means = [sum(j % 4 for j in range(start + t + 1)) / (start + t + 1) for t in range(tokens)]
    if status != 0 or any(abs(got[(head * tokens + t) * dim + d] - means[t]) > 1e-2
                          for head in range(2) for t in range(tokens) for d in range(dim)):
        sys.exit(f"wrong result (prefill, element size {size})")
"""


@functools.cache
def native_library() -> tuple[ctypes.CDLL | None, str]:
    """The compiled kernel and a line saying where it came from, or (None, why not). A build that fails (no
    compiler, no AVX-512, a self-test that faults) is remembered next to where the library would be, and not
    retried for this source, compiler and CPU (`kernels.native_build`)."""
    library, origin = build_native(SOURCE, SELF_TEST, (SIGNATURE, PREFILL_SIGNATURE))
    if library is None:
        return None, origin
    library.decode_attention.restype = ctypes.c_int
    types = {"p": ctypes.c_void_p, "i": ctypes.c_int, "q": ctypes.c_int64, "f": ctypes.c_float}
    library.decode_attention.argtypes = [types[code] for code in SIGNATURE]
    library.prefill_attention.restype = ctypes.c_int
    library.prefill_attention.argtypes = [types[code] for code in PREFILL_SIGNATURE]
    library.decode_attention_supports.restype = ctypes.c_int
    library.decode_attention_supports.argtypes = [ctypes.c_int, ctypes.c_int]
    return library, origin


def _pointer(tensor: torch.Tensor | None) -> int | None:
    return None if tensor is None else tensor.data_ptr()


def decode_attention_path(device: torch.device | str, dtype: torch.dtype, head_dim: int) -> str:
    """Which code runs a decode step's attention over a cache of this dtype and head size, and why."""
    if torch.device(device).type != "cpu":
        return "torch (the C kernel is for CPUs)"
    if torch_forced():
        return f"torch ({BACKEND_VARIABLE}=torch)"
    library, origin = native_library()
    if library is None:
        return origin
    if not _supports(dtype, head_dim):
        return f"torch (the C kernel does not take {str(dtype).removeprefix('torch.')} at head size {head_dim} on this CPU)"
    return origin


def native_attention_takes(dtype: torch.dtype, head_dim: int) -> bool:
    """Whether the decode kernel runs here (built, not switched off) for a CPU cache of this dtype and head size."""
    return not torch_forced() and _supports(dtype, head_dim)


@functools.cache
def _supports(dtype: torch.dtype, head_dim: int, kernel: str = "decode") -> bool:
    """Whether the built library's decode (or "prefill") kernel takes this dtype and head size on this CPU (the
    prefill kernel's instruction sets differ from the decode kernel's: C's prefill_attention_supports)."""
    library = native_library()[0]
    sizes = {torch.bfloat16: 2, torch.float32: 4}
    if library is None or dtype not in sizes:
        return False
    supports = library.prefill_attention_supports if kernel == "prefill" else library.decode_attention_supports
    return bool(supports(sizes[dtype], head_dim))


def native_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None = None,
                     return_lse: bool = False, index: torch.Tensor | None = None,
                     rope: tuple[torch.Tensor, torch.Tensor] | None = None, return_probs: bool = False):
    """`decode_attention_reference` by the C kernel, with return_lse also the fp32 log-sum-exp (B, KV, R) of the
    scaled, masked logits, with return_probs (implies return_lse) also each row's fp32 attention probabilities
    (B, KV, R, S); None where the kernel does not run (not a CPU, INDEXPOOL_KERNELS=torch, not built, a
    dtype or head size it does not take, a mask that varies by head or row). More than 16 rows per KV head go to
    the prefill kernel (`native_prefill`; no mask, no probabilities).

    index (B, N) int64: each batch entry attends to the N tokens it lists of k/v, which are then one store
    (1, KV, tokens, D) shared by the batch. rope (cos, sin), each (N, D) fp32: key n is rotated before use as
    k * cos + roll(k, D / 2) * sin, sin's first half negated (the rotate-half layout; D a multiple of 32); or each
    (B, N, D), a table per batch entry."""
    B, KV, R, D = q.shape
    S = k.shape[2] if index is None else index.shape[1]
    if q.device.type != "cpu" or torch_forced():
        return None
    if R > MAX_ROWS:  # a prompt segment's rows: the prefill kernel, where it runs
        if return_probs:  # which it cannot give: the decode kernel, on chunks of rows
            return None if index is None else _in_row_chunks(q, k, v, mask, index, rope)
        return None if mask is not None else native_prefill(q, k, v, index=index, rope=rope, return_lse=return_lse)
    if (not _supports(q.dtype, D) or k.dtype != q.dtype or v.dtype != q.dtype
            or k.stride() != v.stride() or k.stride(-1) != 1 or k.shape != v.shape
            or k.shape[:2] != ((B if index is None else 1), KV)
            or (index is not None and (index.shape[0] != B or index.dtype != torch.int64))
            or (rope is not None and (D % 32 or any(t.shape[-2:] != (S, D) or t.dim() not in (2, 3)
                                                    or t.shape[:-2] not in ((), (B,)) for t in rope)))
            or (mask is not None and (mask.dim() != 4 or mask.shape[1] != 1 or mask.shape[2] != 1))):
        return None
    q = q.contiguous()
    out = torch.empty(B, KV, R, D, dtype=q.dtype)
    lse = torch.empty(B, KV, R) if return_lse or return_probs else None
    probs = torch.empty(B, KV, R, S) if return_probs else None
    rows_mask = None if mask is None else mask.expand(B, 1, 1, S).reshape(B, S).float().contiguous()
    index = None if index is None else index.contiguous()
    cos, sin = (None, None) if rope is None else (t.float().contiguous() for t in rope)
    status = native_library()[0].decode_attention(
        q.data_ptr(), k.data_ptr(), v.data_ptr(), _pointer(rows_mask), out.data_ptr(), _pointer(lse), q.element_size(),
        B, KV, R, D, S, 0 if index is not None else k.stride(0), k.stride(1), k.stride(2), D**-0.5, _pointer(index),
        _pointer(cos), _pointer(sin), 0 if rope is None or cos.dim() == 2 else S * D, _pointer(probs))
    if status != 0:  # a scratch allocation failed
        return None
    return (out, lse, probs) if return_probs else (out, lse) if return_lse else out


def _in_row_chunks(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None, index: torch.Tensor,
                   rope: tuple[torch.Tensor, torch.Tensor] | None):
    """`native_attention` with return_probs for more than MAX_ROWS rows per KV head over gathered rows (a short
    forward sharing one selection): the rows split into chunks the decode kernel takes, each chunk a batch entry
    with its batch entry's index, RoPE tables and mask (each chunk reads the keys again, from the CPU's caches)."""
    B, KV, R, D = q.shape
    n = -(-R // MAX_ROWS)
    size = -(-R // n)
    chunks = F.pad(q, (0, 0, 0, n * size - R)).view(B, KV, n, size, D).transpose(1, 2).reshape(B * n, KV, size, D)

    def each(t: torch.Tensor) -> torch.Tensor:  # a batch entry's tensor for each of its chunks
        return t.repeat_interleave(n, dim=0)

    if rope is not None and rope[0].dim() == 3:  # tables per batch entry (else shared)
        rope = (each(rope[0]), each(rope[1]))
    mask = None if mask is None else each(mask.expand(B, *mask.shape[1:]))
    found = native_attention(chunks, k, v, mask, index=each(index), rope=rope, return_probs=True)
    if found is None:
        return None
    return tuple(t.view(B, n, KV, size, *t.shape[3:]).transpose(1, 2).reshape(B, KV, n * size, *t.shape[3:])[:, :, :R]
                 for t in found)


def prefill_kernel_runs(device: torch.device, dtype: torch.dtype, head_dim: int) -> bool:
    """Whether `native_prefill` runs for these tensors, as the library says: bf16 on a CPU with AVX512-BF16 but
    without AMX (with AMX, PyTorch's flash kernel runs its matmuls on AMX tiles; this kernel's AVX512-BF16 dot
    products were measured only against the flash kernel on a CPU without them), head sizes 32, 64, 128, 256; fp32
    on a CPU with AVX2 and no AVX-512 (where it was measured), head sizes a multiple of 16 up to 256, and only while
    torch runs one thread: in a 4K prefill of the default model its attention took 8.4 s against the flash
    kernel's 10.5 s on one thread, but 5.2 s against 5.3 s on two, the whole prefill 11.3 s against 11.2 s
    (docs/benchmarks.md)."""
    return (device.type == "cpu" and not torch_forced() and not (dtype == torch.bfloat16 and _has_amx())
            and not (dtype == torch.float32 and torch.get_num_threads() > FP32_PREFILL_THREADS)
            and _supports(dtype, head_dim, "prefill"))


@functools.cache
def _has_amx() -> bool:
    check = getattr(torch.cpu, "_is_amx_tile_supported", None)
    return bool(check and check())


def native_prefill(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, start: int | None = None, *,
                   index: torch.Tensor | None = None, rope: tuple[torch.Tensor, torch.Tensor] | None = None,
                   return_lse: bool = False):
    """Attention of many queries (a prompt segment) by the C prefill kernel: q (B, H, T, D) against k/v
    (B, KV, S, D) (dim contiguous, any other strides), or with index (B, N) against the N rows it lists of k/v
    (1, KV, tokens, D), rotated by rope (cos, sin) as in `native_attention`. start None: every query sees every
    key; start s: query t sees keys 0 .. s+t (causal, the queries at positions s..s+T-1). Returns (B, H, T, D), with
    return_lse also the fp32 log-sum-exp (B, H, T) of the scaled logits; None where `prefill_kernel_runs` says no.
    With several torch threads the kernel starts as many (one per 64 queries at most), which share the heads'
    preparation and then take query tiles, the costly ones first."""
    B, H, T, D = q.shape
    KV = k.shape[1]
    S = k.shape[2] if index is None else index.shape[1]
    if (not prefill_kernel_runs(q.device, q.dtype, D) or k.dtype != q.dtype or v.dtype != q.dtype or H % KV
            or k.shape != v.shape or k.stride() != v.stride() or q.stride(-1) != 1 or k.stride(-1) != 1
            or k.shape[0] != (B if index is None else 1) or (start is not None and S != start + T)
            or (index is not None and (index.shape[0] != B or index.dtype != torch.int64))
            or (rope is not None and any(t.shape[-2:] != (S, D) or t.dim() not in (2, 3) or t.shape[:-2] not in ((), (B,))
                                         for t in rope))):
        return None
    out = torch.empty(B, H, T, D, dtype=q.dtype)
    lse = torch.empty(B, H, T) if return_lse else None
    index = None if index is None else index.contiguous()
    cos, sin = (None, None) if rope is None else (t.float().contiguous() for t in rope)
    library, group = native_library()[0], H // KV
    per_head = lambda t: (t.stride(0), t.stride(1) * group, t.stride(1), t.stride(2))  # noqa: E731
    status = library.prefill_attention(
        q.data_ptr(), out.data_ptr(), _pointer(lse), k.data_ptr(), v.data_ptr(), _pointer(index), _pointer(cos),
        _pointer(sin), q.element_size(), max(1, min(torch.get_num_threads(), T // 64)), B, KV, group, D, T, S,
        -1 if start is None else start, 0 if rope is None or cos.dim() == 2 else S * D, *per_head(q), *per_head(out),
        *(per_head(lse) if lse is not None else (0, 0, 0, 0)), 0 if index is not None else k.stride(0), k.stride(1),
        k.stride(2), D**-0.5)
    if status != 0:  # memory ran out
        return None
    return (out, lse) if return_lse else out


def prefill_attention_path(device: torch.device | str, dtype: torch.dtype, head_dim: int) -> str:
    """Which code runs a prompt segment's attention for this dtype and head size, and why."""
    if prefill_kernel_runs(torch.device(device), dtype, head_dim):
        return native_library()[1]
    if torch.device(device).type == "cpu" and dtype == torch.bfloat16 and _has_amx():
        return "torch (this CPU has AMX, which PyTorch's flash kernel uses)"
    if (torch.device(device).type == "cpu" and not torch_forced() and native_library()[0] is not None
            and not _supports(dtype, head_dim, "prefill")):
        needs = {torch.bfloat16: "bf16 needs AVX512-BF16", torch.float32: "fp32 runs on AVX2 CPUs without AVX-512"}
        return f"torch (the C prefill kernel: {needs.get(dtype, 'bf16 or fp32 only')}; head size {head_dim})"
    if torch.device(device).type == "cpu" and dtype == torch.float32 and torch.get_num_threads() > FP32_PREFILL_THREADS:
        return "torch (the fp32 C prefill kernel runs on one thread; with more, PyTorch's flash kernel measured as fast)"
    return "torch"


def decode_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
    """R query rows per KV head, q (B, KV, R, D), against k/v (B, KV, S, D) -> (B, KV, R, D); mask additive,
    broadcastable to (B, 1, 1, S). The C kernel where it runs, else the torch reference. A cache of another dtype
    than q (an fp32 model's bf16 cache) is read as a model of its dtype reads it: q rounded to it, the result
    widened back."""
    if k.dtype != q.dtype:
        return decode_attention(q.to(k.dtype), k, v, mask).to(q.dtype)
    out = native_attention(q, k, v, mask)
    return decode_attention_reference(q, k, v, mask) if out is None else out


def attention_with_lse(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool = False,
                       mask: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Softmax attention (B, heads, L, D) and the fp32 log-sum-exp of its scaled logits (B, heads, L), so that
    attention over a union of key sets can be merged from its parts. causal: query i sees keys 0..i (L == S).
    mask: an additive fp32 mask broadcastable to (B, heads, L, S); a row must see at least one key.
    On the CPU the C kernels above take it where they run (a few query rows per head, or bf16 without AMX), else
    PyTorch's flash kernel, all returning both; elsewhere this is the plain fp32 reference."""
    if q.device.type == "cpu":
        if causal:
            native = None if mask is not None else native_prefill(q, k, v, 0, return_lse=True)
        else:
            native = native_attention(q, k, v, mask, return_lse=True)
        if native is not None:
            return native
        out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, is_causal=causal,
                                                                              attn_mask=mask)
        return out, lse
    logits = (q.float() @ k.float().transpose(-1, -2)) * q.shape[-1] ** -0.5
    if causal:
        hidden = torch.ones(logits.shape[-2:], dtype=torch.bool, device=q.device).triu(1)
        logits = logits.masked_fill(hidden, float("-inf"))
    if mask is not None:
        logits = logits + mask
    lse = logits.logsumexp(dim=-1)
    return ((logits - lse[..., None]).exp() @ v.float()).to(q.dtype), lse


def merge_attention(parts: list[tuple[torch.Tensor, torch.Tensor]]) -> torch.Tensor:
    """Attention over the union of disjoint key sets, from each set's (output, log-sum-exp)."""
    if len(parts) == 1:
        return parts[0][0]
    lse = torch.stack([part_lse for _, part_lse in parts]).logsumexp(dim=0)
    out = sum(part_out.float() * (part_lse - lse).exp()[..., None] for part_out, part_lse in parts)
    return out.to(parts[0][0].dtype)


# Keys one call of a prompt segment's attention reads: bounds the copy of K/V that PyTorch's flash kernel packs
# (64 MiB for the whole history of a 1B model at 32K) and a narrower cache's widened copy.
PROMPT_KEY_CHUNK = 8192


def prompt_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, start: int) -> torch.Tensor:
    """Causal attention on the CPU of a prompt segment's queries q (B, H, T, D), at positions start..start+T-1,
    over a cache's k/v (B, KV, start+T, D) of any dtype -> (B, H, T, D). The keys before the segment are read in
    chunks of PROMPT_KEY_CHUNK with no mask, the segment's own causally, and the parts merged by their log-sum-exps:
    no (T, start+T) mask is built, and the scratch does not grow with the context. A mask and whole-history calls
    took ~120 MiB of transient memory a forward at 32K, which, freed, stayed in the heap: a 1B model's peak RSS
    grew 12 MiB past its K/V every 4K tokens read."""
    widen = lambda t: t.to(q.dtype)  # noqa: E731
    if prefill_kernel_runs(q.device, q.dtype, q.shape[-1]):
        out = native_prefill(q, widen(k), widen(v), start)
        if out is not None:
            return out
    bounds = list(range(0, start, PROMPT_KEY_CHUNK)) + [start]
    parts = [attention_with_lse(q, widen(k[:, :, s:e]), widen(v[:, :, s:e])) for s, e in zip(bounds, bounds[1:])]
    parts.append(attention_with_lse(q, widen(k[:, :, start:]), widen(v[:, :, start:]), causal=True))
    return merge_attention(parts)
