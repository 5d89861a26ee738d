"""Weight-only quantized linear layers with fp32 activations in C (`cpu_linear.c`), next to their torch reference.

On a CPU without native bf16 the engine runs in fp32, and a one-token decode step of the default model reads
~540 MB of fp32 weights; PyTorch's weight-only int8/int4 kernels take bf16 activations and are slower than fp32 on
such a CPU (576x3072, one row: fp32 0.20 ms, int8pack 1.79 ms, int4pack 3.52 ms). These kernels read int4 (groups
of 32 along the input, w = q * scale + min: GGUF's Q4_0/Q4_1 blocks) or int8 (a scale per output row) copies and
take 1..8 fp32 rows per pass over the weights (more in passes of 8). A third reads bf16 weights (widened by a
shift) for 1..12 rows a pass: IndexPool's pool scores on such a CPU, where torch's bf16 matmul is emulated and
widening the pooled keys first cost more than the product (`model.indexers`).

Layouts (`pack_int4`, `pack_int8`), what `model.quant.DecodeQuantLinear` keeps as buffers:
  - int4: qweight uint8 (N, ceil(K / 64) * 48): output row n is its blocks in pairs, each pair the fp32 scale and
    min of its two blocks then 8 32-bit words, word i holding q[8j + i] in nibble j (cpu_linear.c), so the kernel
    streams each row once, with the scales just before their nibbles, and unpacks 8 weights with a shift and a
    mask. fp32 rather than fp16 scales: measured faster (see PAIR_BYTES).
  - int8: qweight int8 (N, K) and scales fp32 (N,).

The library is built on first use (`kernels.native_build`: cc -march=native, a self-test in a child process) and
needs AVX2, FMA and F16C; without them, without a compiler, or with INDEXPOOL_KERNELS=torch, callers use fp32
weights instead (`linear_path` says which).
"""

from __future__ import annotations

import concurrent.futures
import ctypes
import functools
from pathlib import Path

import torch
import torch.nn.functional as F

from . import BACKEND_VARIABLE, torch_forced
from .native_build import build_native

SOURCE = Path(__file__).with_name("cpu_linear.c")
GROUP = 32
# Scales as fp32, not fp16: with 20-byte blocks (fp16 scale and min, converted by F16C, broadcast by shuffles)
# against 24-byte ones (fp32, broadcast straight from memory), all the default model's int4 layers, one core,
# weights streaming from memory, took 28.8 against 24.8 ms for one row, 84.5 against 72.9 ms for 8: the kernel is
# bound by its instructions more than by the 20% more bytes (a busy 2-core Zen 3 VM, OMP_NUM_THREADS=1).
PAIR_BYTES = 48
# linear_int4 / linear_int8 / linear_bf16's arguments, one letter each: p pointer, i int, q int64
INT4_SIGNATURE = "pqqp" + "qqq" + "pq"
INT8_SIGNATURE = "pqqpp" + "qqq" + "pq"
BF16_SIGNATURE = "pqqpq" + "qqq" + "pq"
BF16_ROWS = 12  # rows linear_bf16 takes in one pass over the weights (MAX_BF16_ROWS in the C source)

# A known answer, checked in a child process on a freshly built library before it is used (a VM can advertise
# instructions it then faults on). 2 rows of x = 1, 0.5, 0.25, 1, 0.5, 0.25, ... against 3 output rows of K = 96
# (an int4 row: q = k % 16, scale 2^-n, min -n; an int8 row: q = (k % 7) - 3, scale 2^-n), small integers and powers
# of two, so that every sum is exact in fp32.
SELF_TEST = """
import ctypes, struct, sys
lib = ctypes.CDLL(sys.argv[1])
types = {"p": ctypes.c_void_p, "i": ctypes.c_int, "q": ctypes.c_int64}
lib.linear_int4.argtypes = [types[code] for code in sys.argv[2]]
lib.linear_int8.argtypes = [types[code] for code in sys.argv[3]]
K, N, rows = 96, 3, 2
xs = [[(1.0, 0.5, 0.25)[(k + r) % 3] for k in range(K)] for r in range(rows)]
x = (ctypes.c_float * (rows * K))(*[v for row in xs for v in row])
blob = b""
for n in range(N):
    for p in range(2):  # pairs of blocks: the second holds one block (k = 64..95) and padding
        q = [k % 16 if k < K else 0 for k in range(64 * p, 64 * p + 64)]
        head = [2.0 ** -n, -float(n)] + ([2.0 ** -n, -float(n)] if 64 * p + 64 <= K else [0.0, 0.0])
        blob += struct.pack("<4f", *head) + struct.pack("<8I", *(sum(q[8 * j + i] << 4 * j for j in range(8))
                                                                 for i in range(8)))
y = (ctypes.c_float * (rows * N))()
status = lib.linear_int4(x, rows, K, blob, 0, N, K, y, N)
want = [sum(xs[r][k] * ((k % 16) * 2.0 ** -n - n) for k in range(K)) for r in range(rows) for n in range(N)]
if status != 0 or list(y) != want:
    sys.exit(f"wrong int4 result: {list(y)} against {want}")
w8 = (ctypes.c_int8 * (N * K))(*[(k % 7) - 3 for n in range(N) for k in range(K)])
scales = (ctypes.c_float * N)(*[2.0 ** -n for n in range(N)])
y = (ctypes.c_float * (rows * N))()
status = lib.linear_int8(x, rows, K, w8, scales, 0, N, K, y, N)
want = [sum(xs[r][k] * ((k % 7) - 3) for k in range(K)) * 2.0 ** -n for r in range(rows) for n in range(N)]
if status != 0 or list(y) != want:
    sys.exit(f"wrong int8 result: {list(y)} against {want}")
lib.linear_bf16.argtypes = [types[code] for code in sys.argv[4]]
# bf16 rows K + 3 apart (the gap 99.0, which must not be read): w = ((k % 7) - 3) * 2^-n, exact in bf16
bits = [struct.unpack("<I", struct.pack("<f", ((k % 7) - 3) * 2.0 ** -n if k < K else 99.0))[0] >> 16
        for n in range(N) for k in range(K + 3)]
w16 = (ctypes.c_uint16 * len(bits))(*bits)
y = (ctypes.c_float * (rows * N))()
status = lib.linear_bf16(x, rows, K, w16, K + 3, 0, N, K, y, N)
if status != 0 or list(y) != want:
    sys.exit(f"wrong bf16 result: {list(y)} against {want}")
"""


@functools.cache
def native_library() -> tuple[ctypes.CDLL | None, str]:
    """The compiled kernels and a line saying where they came from, or (None, why not)."""
    library, origin = build_native(SOURCE, SELF_TEST, (INT4_SIGNATURE, INT8_SIGNATURE, BF16_SIGNATURE))
    if library is None:
        return None, origin.replace("torch (", "fp32 weights (", 1)
    types = {"p": ctypes.c_void_p, "i": ctypes.c_int, "q": ctypes.c_int64}
    for function, signature in ((library.linear_int4, INT4_SIGNATURE), (library.linear_int8, INT8_SIGNATURE),
                                (library.linear_bf16, BF16_SIGNATURE)):
        function.restype = ctypes.c_int
        function.argtypes = [types[code] for code in signature]
    return library, origin


def kernel_runs() -> bool:
    """Whether the C kernels run here (built, and not switched off by INDEXPOOL_KERNELS=torch)."""
    return not torch_forced() and native_library()[0] is not None


def linear_path() -> str:
    """Which code would run a quantized fp32 linear layer, and why."""
    if torch_forced():
        return f"fp32 weights ({BACKEND_VARIABLE}=torch)"
    return native_library()[1]


# ------------------------------------------------------------------------------------------------ layouts

def int4_row_bytes(in_features: int) -> int:
    """Bytes per output row of a packed int4 copy: a 48-byte pair of blocks per 64 inputs (the last pair padded)."""
    return -(-in_features // (2 * GROUP)) * PAIR_BYTES


def int4_levels(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """weight (N, K), K a multiple of 32 -> (levels int64 (N, K / 32, 32) in 0..15, scale, min (N, K / 32)): per
    group of 32 along K, 16 levels from the group's minimum to its maximum, w = level * scale + min (as GGUF's Q4_1,
    which it reproduces exactly up to the fp32 rounding of its fp16 scale and min: none)."""
    n, k = weight.shape
    if k % GROUP:
        raise ValueError(f"int4 needs an input width that is a multiple of {GROUP}, not {k}")
    groups = weight.detach().float().reshape(n, k // GROUP, GROUP)
    low, high = groups.amin(dim=-1), groups.amax(dim=-1)
    scale = ((high - low) / 15).clamp_min(1e-12)
    return torch.round((groups - low[..., None]) / scale[..., None]).clamp(0, 15).to(torch.int64), scale, low


def pack_int4(weight: torch.Tensor) -> torch.Tensor:
    """weight (N, K), K a multiple of 32 -> qweight uint8 (N, int4_row_bytes(K)): `int4_levels` in the kernel's
    layout."""
    q, scale, low = int4_levels(weight)
    n, k = weight.shape
    if k % (2 * GROUP):  # pad to whole pairs: a block of zeros with scale and min 0
        q = torch.cat([q, q.new_zeros(n, 1, GROUP)], dim=1)
        scale, low = (torch.cat([t, t.new_zeros(n, 1)], dim=1) for t in (scale, low))
    pairs = q.shape[1] // 2
    levels = q.reshape(n, pairs, 8, 8)  # (pair, j, i): k = 8j + i of the pair
    words = (levels << (4 * torch.arange(8)).view(1, 1, 8, 1)).sum(dim=2)  # (n, pairs, 8 words), < 2^32
    word_bytes = words.contiguous().view(torch.uint8).reshape(n, pairs, 8, 8)[..., :4].reshape(n, pairs, 32)
    head = torch.stack([scale, low], dim=-1).reshape(n, pairs, 4).contiguous().view(torch.uint8)
    return torch.cat([head, word_bytes], dim=-1).reshape(n, pairs * PAIR_BYTES).contiguous()


def unpack_int4(qweight: torch.Tensor, in_features: int) -> torch.Tensor:
    """The fp32 weight (N, K) a packed int4 copy stands for: q * scale + min, computed as the kernel does (fp32
    fma: one rounding, which torch's q * scale + min has too wherever q * scale is exact; it can differ by one
    rounding where it is not)."""
    n = qweight.shape[0]
    raw = qweight.reshape(n, -1, PAIR_BYTES)
    pairs = raw.shape[1]
    head = raw[..., :16].contiguous().view(torch.float32).reshape(n, pairs * 2, 2)
    words = torch.cat([raw[..., 16:].reshape(n, pairs, 8, 4), raw.new_zeros(n, pairs, 8, 4)], dim=-1)
    words = words.contiguous().view(torch.int64).reshape(n, pairs, 1, 8)  # (pair, 1, i)
    q = ((words >> (4 * torch.arange(8)).view(1, 1, 8, 1)) & 15).reshape(n, pairs * 2, GROUP).float()  # (pair, j, i)
    w = torch.addcmul(head[..., 1:], q, head[..., :1])
    return w.reshape(n, pairs * 2 * GROUP)[:, :in_features]


def pack_int8(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """weight (N, K) -> (qweight int8 (N, K), scales fp32 (N,)): symmetric, a scale per output row."""
    w = weight.detach().float()
    scale = w.abs().amax(dim=1).clamp_min(1e-12) / 127.0
    return torch.round(w / scale[:, None]).to(torch.int8), scale


# ------------------------------------------------------------------------------------------------ the ops

def linear_int4_reference(x: torch.Tensor, qweight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x (..., K) fp32 against a packed int4 copy (N, int4_row_bytes(K)) -> (..., N)."""
    return F.linear(x, unpack_int4(qweight, x.shape[-1]), bias)


def linear_bf16_reference(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """x (..., K) fp32 against bf16 weights (N, K) -> (..., N) fp32, the weights widened."""
    return F.linear(x, weight.float())


def linear_int8_reference(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor,
                          bias: torch.Tensor | None = None) -> torch.Tensor:
    """x (..., K) fp32 against an int8 copy (N, K) with a scale per output row -> (..., N)."""
    y = F.linear(x, qweight.float()) * scales
    return y if bias is None else y + bias


# One call below this many weights stays on the calling thread (a thread pool's hand-off costs tens of
# microseconds; a 576x576 layer at int4 takes about that long on one core).
THREAD_MIN_WEIGHTS = 1 << 20


@functools.cache
def _pool(threads: int) -> concurrent.futures.ThreadPoolExecutor:
    return concurrent.futures.ThreadPoolExecutor(threads, thread_name_prefix="cpu_linear")


def run_in_threads(call, rows: int, n: int, k: int) -> None:
    """call(n_begin, n_end) for the N outputs, split between torch's thread count of threads (the kernel runs
    without the GIL) when the layer is big enough."""
    threads = min(torch.get_num_threads(), max(1, n * k // THREAD_MIN_WEIGHTS), n // 64 or 1)
    if threads <= 1:
        statuses = [call(0, n)]
    else:
        bounds = [n * i // threads // 8 * 8 for i in range(threads)] + [n]
        statuses = list(_pool(threads).map(call, bounds[:-1], bounds[1:]))
    if any(statuses):
        raise ValueError("the C linear kernel refused its arguments")


def _prepared(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    if x.dtype != torch.float32 or x.device.type != "cpu":
        raise ValueError("the C linear kernels take fp32 CPU tensors")
    flat = x.reshape(-1, x.shape[-1])
    if flat.stride(-1) != 1:
        flat = flat.contiguous()
    return flat, torch.empty(flat.shape[0], 0)


def linear_int4(x: torch.Tensor, qweight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """`linear_int4_reference` by the C kernel (which must have built: `kernel_runs`)."""
    flat, _ = _prepared(x)
    rows, k = flat.shape
    n = qweight.shape[0]
    if qweight.dtype != torch.uint8 or qweight.shape[1] != int4_row_bytes(k) or not qweight.is_contiguous():
        raise ValueError(f"not a packed int4 copy for an input width of {k}: {tuple(qweight.shape)} {qweight.dtype}")
    y = torch.empty(rows, n)
    library = native_library()[0]
    run_in_threads(lambda first, end: library.linear_int4(flat.data_ptr(), rows, flat.stride(0), qweight.data_ptr(), first, end, k, y.data_ptr(), n), rows, n, k)
    if bias is not None:
        y += bias
    return y.view(*x.shape[:-1], n)


def linear_int8(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor,
                bias: torch.Tensor | None = None) -> torch.Tensor:
    """`linear_int8_reference` by the C kernel (which must have built: `kernel_runs`)."""
    flat, _ = _prepared(x)
    rows, k = flat.shape
    n = qweight.shape[0]
    if (qweight.dtype != torch.int8 or qweight.shape[1] != k or not qweight.is_contiguous()
            or scales.dtype != torch.float32 or scales.shape != (n,) or not scales.is_contiguous()):
        raise ValueError(f"not an int8 copy for an input width of {k}: {tuple(qweight.shape)} {qweight.dtype}, "
                         f"scales {tuple(scales.shape)} {scales.dtype}")
    y = torch.empty(rows, n)
    library = native_library()[0]
    run_in_threads(lambda first, end: library.linear_int8(flat.data_ptr(), rows, flat.stride(0), qweight.data_ptr(),
                                                scales.data_ptr(), first, end, k, y.data_ptr(), n), rows, n, k)
    if bias is not None:
        y += bias
    return y.view(*x.shape[:-1], n)


def linear_bf16(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """`linear_bf16_reference` by the C kernel (which must have built: `kernel_runs`); weight's rows may be a
    strided view (elements contiguous within a row)."""
    flat, _ = _prepared(x)
    rows, k = flat.shape
    n = weight.shape[0]
    if weight.dtype != torch.bfloat16 or weight.dim() != 2 or weight.shape[1] != k or weight.stride(1) != 1:
        raise ValueError(f"not bf16 weights with rows of {k}: {tuple(weight.shape)} {weight.dtype}")
    y = torch.empty(rows, n)
    library = native_library()[0]
    run_in_threads(lambda first, end: library.linear_bf16(flat.data_ptr(), rows, flat.stride(0), weight.data_ptr(),
                                                max(weight.stride(0), k), first, end, k, y.data_ptr(), n), rows, n, k)
    return y.view(*x.shape[:-1], n)
