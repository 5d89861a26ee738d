"""Weight-only int8/int4 copies of the linear layers for decode on the CPU.

A single-token decode step is bound by reading weights from memory. PyTorch's bf16 matrix-vector product reaches
about 20 GB/s on this CPU; its weight-only int8 kernel (`_weight_int8pack_mm`) reads half the bytes and its int4
kernel (`_weight_int4pack_mm_for_cpu`, groups of 32 along the input dimension, w = (q - 8) * scale + zero) a
quarter. For a block of tokens (prefill) the bf16 matmul on AMX is 10x faster than either, so `DecodeQuantLinear`
keeps both: bf16 weights for more than `max_rows` rows, the quantized copy for a few single-token rows.
Int4 with groups of 32 reproduces GGUF's Q4_0/Q4_1 blocks up to the bf16 rounding of their scales.

On a CPU without native bf16 the model runs in fp32, where PyTorch's int8/int4 kernels (bf16 activations) are
slower than fp32; there the copies are in the layouts of the C kernels of `kernels.cpu_linear` (fp32 activations,
AVX2), and exist only where that library builds (`quantize_for_decode` raises otherwise).
"""

from __future__ import annotations

import torch
from torch import nn

from indexpool.kernels import cpu_linear

INT4_GROUP = 32


class DecodeQuantLinear(nn.Module):
    # Up to this many rows the quantized kernels beat bf16, or match it: all the model's linears, one thread, AMX
    # VM: 1 row 3x, 8 rows on par; AVX512-BF16 EPYC without AMX: 1 row 11.9 against 38.0 ms, 8 rows 38.3 against
    # 47.3, 16 rows 77.3 against 71.2. A batch of 8 branches then also decodes with the weights a question alone uses.
    max_rows = 8
    # The same for an fp32 model and the C kernels (which read the weights once per 8 rows): all the model's linears
    # (the output layer int8), one core of a busy 2-core Zen 3 VM without AVX-512, weights streaming from memory,
    # fp32 F.linear against the kernels: 1 row 52.2 against 17.8 ms, 4 rows 111.7 / 24.5, 8 rows 141.2 / 70.5,
    # 16 rows 159.8 / 86.8, 32 rows 214.7 / 172.3 (OMP_NUM_THREADS=1 python -m benchmarks.linear_kernels --rows
    # 1,4,8,16,32 --dtype fp32). 32 rows still win by 1.25x, shrinking (the kernels' time grows with the rows, fp32's
    # less; the 576x1536 layer already loses there): 16 keeps a clear margin.
    fp32_max_rows = 16

    def __init__(self, linear: nn.Linear, bits: int, compute: bool = True):
        """compute=False allocates the quantized buffers uninitialised, for a caller that fills them."""
        super().__init__()
        self.weight, self.bias, self.bits = linear.weight, linear.bias, bits
        if bits not in (4, 8):
            raise ValueError(f"decode weights of {bits} bits are not supported (8 or 4)")
        n, k = linear.weight.shape
        # fp32 activations: the C kernels' layouts (int4: one uint8 buffer, its scales beside their nibbles).
        self.native = linear.weight.dtype == torch.float32
        if self.native:
            if bits == 4 and k % INT4_GROUP:
                raise ValueError(f"int4 needs an input width that is a multiple of {INT4_GROUP}, not {k}")
            if bits == 4:
                qweight = (cpu_linear.pack_int4(linear.weight) if compute
                           else torch.empty(n, cpu_linear.int4_row_bytes(k), dtype=torch.uint8))
                self.register_buffer("qweight", qweight, persistent=False)
            else:
                qweight, scales = (cpu_linear.pack_int8(linear.weight) if compute
                                   else (torch.empty(n, k, dtype=torch.int8), torch.empty(n)))
                self.register_buffer("qweight", qweight, persistent=False)
                self.register_buffer("scales", scales, persistent=False)
            return
        if not compute:  # the shapes and dtypes the branches below produce (int4: two values per byte)
            self.register_buffer("qweight", torch.empty((n, k) if bits == 8 else (n, k // 2),
                                                        dtype=torch.int8 if bits == 8 else torch.uint8), persistent=False)
            self.register_buffer("scales", torch.empty((n,) if bits == 8 else (k // INT4_GROUP, n, 2),
                                                       dtype=linear.weight.dtype), persistent=False)
            return
        w = linear.weight.detach().float()
        if bits == 8:
            scale = w.abs().amax(dim=1).clamp_min(1e-12) / 127.0
            self.register_buffer("qweight", torch.round(w / scale[:, None]).to(torch.int8), persistent=False)
            self.register_buffer("scales", scale.to(linear.weight.dtype), persistent=False)
        else:
            levels, scale, low = cpu_linear.int4_levels(w)
            q = levels.to(torch.int32).view(n, k)
            self.register_buffer("qweight", torch.ops.aten._convert_weight_to_int4pack_for_cpu(q, 2), persistent=False)
            zero = low + 8 * scale  # the kernel computes (q - 8) * scale + zero
            self.register_buffer("scales", torch.stack([scale, zero], dim=-1).transpose(0, 1).contiguous().to(linear.weight.dtype), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.numel() // x.shape[-1]
        if self.native:
            if rows > self.fp32_max_rows or x.dtype != torch.float32 or not cpu_linear.kernel_runs():
                return nn.functional.linear(x, self.weight, self.bias)
            if self.bits == 8:
                return cpu_linear.linear_int8(x, self.qweight, self.scales, self.bias)
            return cpu_linear.linear_int4(x, self.qweight, self.bias)
        if rows > self.max_rows:
            return nn.functional.linear(x, self.weight, self.bias)
        flat = x.reshape(rows, -1).contiguous()  # PyTorch's packed kernels take contiguous rows only
        if self.bits == 8:
            y = torch.ops.aten._weight_int8pack_mm(flat, self.qweight, self.scales)
        else:
            y = torch.ops.aten._weight_int4pack_mm_for_cpu(flat, self.qweight, INT4_GROUP, self.scales)
        if self.bias is not None:
            y = y + self.bias
        return y.view(*x.shape[:-1], -1)


def quantize_for_decode(model: nn.Module, bits: int, keep_int8: tuple[str, ...] = (), compute: bool = True) -> nn.Module:
    """Give every nn.Linear a quantized decode copy: bf16 models (PyTorch's kernels, bf16 activations), or fp32
    models where the C kernels of `kernels.cpu_linear` build. Layers named in `keep_int8`, or whose input width is
    not a multiple of the int4 group, use int8. compute=False only shapes the copies (to be filled from prepared
    weights)."""
    dtype = next(model.parameters()).dtype
    if dtype == torch.float32:
        library, origin = cpu_linear.native_library()
        if library is None:
            raise ValueError(f"quantized decode weights for an fp32 model need the C kernels of kernels/cpu_linear.c, "
                             f"which are not available here: {origin}")
    elif dtype != torch.bfloat16:
        raise ValueError(f"quantized decode weights need a bf16 or fp32 model, not {str(dtype).removeprefix('torch.')}")
    for name, module in list(model.named_modules()):
        for child_name, child in list(module.named_children()):
            if isinstance(child, nn.Linear):
                full = f"{name}.{child_name}" if name else child_name
                use = 8 if bits == 8 or full in keep_int8 or child.in_features % INT4_GROUP else 4
                setattr(module, child_name, DecodeQuantLinear(child, use, compute))
    return model


def decode_weights_path(model: nn.Module) -> str:
    """Which code runs a decode step's linear layers, for `indexpool info`."""
    layers = [m for m in model.modules() if isinstance(m, DecodeQuantLinear)]
    if not layers:
        return "the model's own weights (no quantized decode copies)"
    bits = "/".join(f"int{b}" for b in sorted({m.bits for m in layers}, reverse=True))
    if layers[0].native:
        if not cpu_linear.kernel_runs():
            return cpu_linear.linear_path()
        return (f"{bits} copies up to {DecodeQuantLinear.fp32_max_rows} rows, fp32 activations: "
                f"{cpu_linear.linear_path()}")
    return f"{bits} copies up to {DecodeQuantLinear.max_rows} rows: PyTorch's weight-only kernels (bf16 activations)"
