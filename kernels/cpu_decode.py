"""A decode step's layers in one C call (`cpu_decode.c`), for one sequence on a CPU with fp32 activations.

The C kernels of `cpu_linear` (int4/int8 weights) and `cpu_attention` (decode attention) did the heavy work of a
step, yet a step of the default model at 4K context still spent about a third of its time in the small torch
operations and Python calls between them, ~40 per layer (docs/benchmarks.md). `decode_layers` runs
every layer of the step in C instead: RMSNorm, RoPE, the cache writes, SiLU and the residual adds in plain C, the
linear and attention kernels called through their function pointers. Its reference is the model's own layer code
(`model/llama.py`), which the tests compare it with.

Takes: an fp32 model whose linear layers all have C-kernel decode copies (`model.quant`), or an fp32 or bf16 model
whose linear layers all compute on the GGUF file's blocks (`model.gguf_weights`, every run of matrices in a type the
block kernels take; a bf16 model's hidden state, norms, biases and RoPE row widened to fp32 for the step), no q/k
norm, a dense cache of one sequence in fp32 or bf16 that the attention kernel reads. Built on first use like the other
kernels (`kernels.native_build`); INDEXPOOL_KERNELS=torch turns it off with them.
"""

from __future__ import annotations

import ctypes
import functools
from pathlib import Path

import torch

from . import cpu_attention, cpu_linear, gguf_blocks, torch_forced
from .native_build import build_native

SOURCE = Path(__file__).with_name("cpu_decode.c")
# decode_layers' arguments, one letter each: p pointer, i int, q int64, f float
SIGNATURE = "pip" + "iiiiqf" + "ppp" + "pp" + "iqqq" + "i"


class BlockRun(ctypes.Structure):
    _fields_ = [("parts", ctypes.c_void_p), ("part_rows", ctypes.c_void_p), ("columns", ctypes.c_void_p),
                ("type", ctypes.c_int64), ("n_parts", ctypes.c_int64), ("rows", ctypes.c_int64)]


class LinearWeights(ctypes.Structure):
    _fields_ = [("weight", ctypes.c_void_p), ("scales", ctypes.c_void_p), ("bias", ctypes.c_void_p),
                ("out_features", ctypes.c_int64), ("in_features", ctypes.c_int64), ("bits", ctypes.c_int64),
                ("runs", ctypes.c_int64)]


class LayerWeights(ctypes.Structure):
    _fields_ = [("attention_norm", ctypes.c_void_p), ("ffn_norm", ctypes.c_void_p), ("wqkv", LinearWeights),
                ("wo", LinearWeights), ("w13", LinearWeights), ("w2", LinearWeights)]


class Kernels(ctypes.Structure):
    _fields_ = [("linear_int4", ctypes.c_void_p), ("linear_int8", ctypes.c_void_p),
                ("decode_attention", ctypes.c_void_p), ("gguf_linear", ctypes.c_void_p),
                ("gguf_linear_f16", ctypes.c_void_p), ("gguf_quantize", ctypes.c_void_p)]


# Run in a child process on a freshly built library: its plain C is compiled for this CPU (-march=native), and an
# instruction the VM advertises but faults on must cost the Python path, not the process. Stand-in kernels with a
# known answer: every linear gives ones, attention zeros; so each layer adds 1 (wo) and 1 (w2) to x, and writes
# its key, ones rotated by angle 0, into the cache as bf16 ones.
SELF_TEST = """
import ctypes, sys
lib = ctypes.CDLL(sys.argv[1])
types = {"p": ctypes.c_void_p, "i": ctypes.c_int, "q": ctypes.c_int64, "f": ctypes.c_float}
lib.decode_layers.argtypes = [types[code] for code in sys.argv[2]]
ones = lambda y, first, end: [y.__setitem__(i, 1.0) for i in range(first, end)]
Linear4 = ctypes.CFUNCTYPE(ctypes.c_int, *[ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64, ctypes.c_void_p]
                           + [ctypes.c_int64] * 3 + [ctypes.POINTER(ctypes.c_float), ctypes.c_int64])
Linear8 = ctypes.CFUNCTYPE(ctypes.c_int, *[ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64, ctypes.c_void_p,
                           ctypes.c_void_p] + [ctypes.c_int64] * 3 + [ctypes.POINTER(ctypes.c_float), ctypes.c_int64])
Attention = ctypes.CFUNCTYPE(ctypes.c_int, *[ctypes.c_void_p] * 4 + [ctypes.POINTER(ctypes.c_uint16), ctypes.c_void_p]
                             + [ctypes.c_int] * 5 + [ctypes.c_int64] * 4 + [ctypes.c_float] + [ctypes.c_void_p] * 3
                             + [ctypes.c_int64, ctypes.c_void_p])
linear4 = Linear4(lambda x, rows, xs, w, first, end, k, y, ys: (ones(y, first, end), 0)[1])
linear8 = Linear8(lambda x, rows, xs, w, s, first, end, k, y, ys: (ones(y, first, end), 0)[1])
attention = Attention(lambda q, k, v, m, out, *rest: [out.__setitem__(i, 0) for i in range(32)] and 0)
dim, layers, length = 32, 2, 4
norm = (ctypes.c_float * dim)(*[1.0] * dim)
linear = lambda n, k, bits: (None, None, None, n, k, bits)
table = (ctypes.c_int64 * (2 + 4 * 7) * layers)()
for layer in table:
    layer[0] = layer[1] = ctypes.addressof(norm)
    for i, (n, k, bits) in enumerate(((3 * dim, dim, 4), (dim, dim, 8), (2 * dim, dim, 4), (dim, 2 * dim, 8))):
        layer[2 + 7 * i + 3 : 2 + 7 * i + 6] = [n, k, bits]
functions = (ctypes.c_void_p * 6)(ctypes.cast(linear4, ctypes.c_void_p), ctypes.cast(linear8, ctypes.c_void_p),
                                  ctypes.cast(attention, ctypes.c_void_p))
cos, sin = (ctypes.c_float * dim)(*[1.0] * dim), (ctypes.c_float * dim)()
for threads in (1, 2):  # two threads: the KV head on one, and the linears' rows split
    x = (ctypes.c_float * dim)(*[0.5] * dim)
    k, v = (ctypes.c_uint16 * (layers * length * dim))(), (ctypes.c_uint16 * (layers * length * dim))()
    status = lib.decode_layers(table, layers, functions, dim, 1, 1, dim, dim, 1e-5, x, cos, sin, k, v, 2,
                               length * dim, length * dim, 2, threads)
    if status != 0 or list(x) != [0.5 + 2 * layers] * dim:
        sys.exit(f"wrong hidden state: {list(x)[:4]}, status {status}, {threads} threads")
    if [k[l * length * dim + 2 * dim + i] for l in range(layers) for i in range(dim)] != [0x3F80] * (layers * dim):
        sys.exit(f"wrong cached keys, {threads} threads")
"""


@functools.cache
def native_library() -> tuple[ctypes.CDLL | None, str]:
    """The compiled step and a line saying where it came from, or (None, why not)."""
    library, origin = build_native(SOURCE, SELF_TEST, (SIGNATURE,))
    if library is None:
        return None, origin
    types = {"p": ctypes.c_void_p, "i": ctypes.c_int, "q": ctypes.c_int64, "f": ctypes.c_float}
    library.decode_layers.restype = ctypes.c_int
    library.decode_layers.argtypes = [types[code] for code in SIGNATURE]
    return library, origin


@functools.cache
def _kernels() -> Kernels | None:
    """The kernels' addresses (a linear library that did not build: 0), or None where attention's did not build."""
    linear, blocks = cpu_linear.native_library()[0], gguf_blocks.native_library()[0]
    attention = cpu_attention.native_library()[0]
    if attention is None:
        return None

    def address(library: ctypes.CDLL | None, name: str) -> int:
        return ctypes.cast(getattr(library, name), ctypes.c_void_p).value if library else 0

    return Kernels(address(linear, "linear_int4"), address(linear, "linear_int8"),
                   address(attention, "decode_attention"), address(blocks, "gguf_linear"),
                   address(blocks, "gguf_linear_f16"), address(blocks, "gguf_quantize_rows"))


def unavailable(blocks: bool = False) -> str | None:
    """Why the whole-step kernel cannot run here (it or the kernels it calls did not build), or None; `blocks`:
    for linears on a GGUF file's blocks (else decode copies). See `kernel_runs` for INDEXPOOL_KERNELS."""
    library, origin = native_library()
    if library is None:
        return origin
    kernels = _kernels()
    if kernels is None or not (kernels.gguf_linear if blocks else kernels.linear_int4):
        return f"torch (the C {'GGUF block' if blocks else 'linear'} or attention kernel did not build)"
    return None


def kernel_runs(blocks: bool = False) -> bool:
    """Whether the whole-step kernel runs here (for linears on blocks, or decode copies): built, its kernels built,
    and not switched off (INDEXPOOL_KERNELS=torch, read per call)."""
    return not torch_forced() and unavailable(blocks) is None


def takes_blocks(linear) -> bool:
    """Whether a `model.gguf_weights.BlockLinear` can run in the step: every run of its rows on the file's blocks
    in a type the block kernels compute on (F32 and BF16 rows go through torch)."""
    return all(matrices is not None and matrices.qtype not in gguf_blocks.TORCH_TYPES
               for _, matrices, _ in linear.groups)


class DecodeLayers:
    """A model's layers as `decode_layers` reads them: a table of pointers into the weights, built once. It keeps
    the tensors it points into alive; the weights must not move afterwards (the engine never moves them)."""

    def __init__(self, layers: list[dict], dim: int, heads: int, kv_heads: int, head_dim: int, ffn_dim: int,
                 eps: float):
        """layers: per layer, "attention_norm" and "ffn_norm" (fp32 (dim,)) and for "wqkv", "wo", "w13" (gate
        rows, then up rows) and "w2" either a tuple (qweight, scales or None, bias or None, bits, in_features) in
        `kernels.cpu_linear`'s layouts, or a `model.gguf_weights.BlockLinear` whose runs are all on blocks."""
        self.tensors = []
        self.table = (LayerWeights * len(layers))()
        for entry, layer in zip(self.table, layers):
            for name in ("attention_norm", "ffn_norm"):
                tensor = layer[name].detach().float().contiguous()
                self.tensors.append(tensor)
                setattr(entry, name, tensor.data_ptr())
            for name in ("wqkv", "wo", "w13", "w2"):
                setattr(entry, name, self._linear(layer[name]))
        self.n_layers = len(layers)
        self.dims = (dim, heads, kv_heads, head_dim, ffn_dim, eps)

    def _linear(self, linear) -> LinearWeights:
        """One linear as the table holds it; what it points into is kept alive in self.tensors."""
        if isinstance(linear, tuple):
            qweight, scales, bias, bits, in_features = linear
            self.tensors.append(qweight)
            weight, out_features, runs = qweight.data_ptr(), qweight.shape[0], 0
        else:
            if not takes_blocks(linear):
                raise ValueError("decode_layers takes linears on the file's blocks in the block kernels' types")
            # a bf16 model's bias as the step adds it, in fp32
            bias = None if linear.bias is None else linear.bias.detach().float().contiguous()
            scales, bits, in_features = None, 0, linear.in_features
            table = (BlockRun * len(linear.groups))()
            for run, (_, matrices, _) in zip(table, linear.groups):
                run.parts, run.part_rows = ctypes.addressof(matrices.pointers), ctypes.addressof(matrices.part_rows)
                run.columns = 0 if matrices.columns is None else matrices.columns.data_ptr()
                run.type, run.n_parts, run.rows = matrices.qtype, len(matrices.parts), matrices.out_features
            self.tensors += [linear, table]  # the layer holds its matrices' pointer arrays and columns
            weight, out_features, runs = ctypes.addressof(table), linear.out_features, len(table)
        if any(t is not None and t.dtype != torch.float32 for t in (scales, bias)):
            raise ValueError("decode_layers takes fp32 scales and biases")
        self.tensors += [t for t in (scales, bias) if t is not None]
        return LinearWeights(weight, 0 if scales is None else scales.data_ptr(), 0 if bias is None else bias.data_ptr(),
                             out_features, in_features, bits, runs)

    def __call__(self, x: torch.Tensor, position: int, cos: torch.Tensor, sin: torch.Tensor, k: torch.Tensor,
                 v: torch.Tensor) -> torch.Tensor:
        """x: (dim,) fp32 contiguous, the token's embedding, updated in place to its last layer's output and
        returned; cos, sin: (head_dim,) fp32 contiguous, RoPE at `position`; k, v: the cache (layers, 1, kv_heads,
        max_length, head_dim), fp32 or bf16, written at `position` and attended over rows 0..position."""
        library = native_library()[0]
        status = library.decode_layers(ctypes.byref(self.table), self.n_layers, ctypes.byref(_kernels()),
                                       *self.dims, x.data_ptr(), cos.data_ptr(), sin.data_ptr(), k.data_ptr(),
                                       v.data_ptr(), k.element_size(), k.stride(0), k.stride(2), position,
                                       torch.get_num_threads())
        if status != 0:
            raise RuntimeError("the C decode step failed (a kernel refused its arguments, or out of memory)")
        return x
