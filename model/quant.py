"""Weight-only int8/int4 copies of the linear layers for decode on the CPU.

A single-token decode step is bound by reading weights from memory. PyTorch's bf16 matrix-vector product reaches
about 20 GB/s on this CPU; its weight-only int8 kernel (`_weight_int8pack_mm`) reads half the bytes and its int4
kernel (`_weight_int4pack_mm_for_cpu`, groups of 32 along the input dimension, w = (q - 8) * scale + zero) a
quarter. For a block of tokens (prefill) the bf16 matmul on AMX is 10x faster than either, so `DecodeQuantLinear`
keeps both: bf16 weights for more than `max_rows` rows, the quantized copy for a few single-token rows.
Int4 with groups of 32 reproduces GGUF's Q4_0/Q4_1 blocks up to the bf16 rounding of their scales.
"""

from __future__ import annotations

import torch
from torch import nn

INT4_GROUP = 32


class DecodeQuantLinear(nn.Module):
    # Up to this many rows the quantized kernels beat bf16, or match it: all the model's linears, one thread, AMX
    # VM: 1 row 3x, 8 rows on par; AVX512-BF16 EPYC without AMX: 1 row 11.9 against 38.0 ms, 8 rows 38.3 against
    # 47.3, 16 rows 77.3 against 71.2. A batch of 8 branches then also decodes with the weights a question alone uses.
    max_rows = 8

    def __init__(self, linear: nn.Linear, bits: int, compute: bool = True):
        """compute=False allocates the quantized buffers uninitialised, for a caller that fills them."""
        super().__init__()
        self.weight, self.bias, self.bits = linear.weight, linear.bias, bits
        if bits not in (4, 8):
            raise ValueError(f"decode weights of {bits} bits are not supported (8 or 4)")
        n, k = linear.weight.shape
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
            groups = w.view(n, k // INT4_GROUP, INT4_GROUP)
            low, high = groups.amin(dim=-1), groups.amax(dim=-1)
            scale = ((high - low) / 15).clamp_min(1e-12)
            q = torch.round((groups - low[..., None]) / scale[..., None]).clamp(0, 15).to(torch.int32).view(n, k)
            self.register_buffer("qweight", torch.ops.aten._convert_weight_to_int4pack_for_cpu(q, 2), persistent=False)
            zero = low + 8 * scale  # the kernel computes (q - 8) * scale + zero
            self.register_buffer("scales", torch.stack([scale, zero], dim=-1).transpose(0, 1).contiguous().to(linear.weight.dtype), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.numel() // x.shape[-1]
        if rows > self.max_rows:
            return nn.functional.linear(x, self.weight, self.bias)
        flat = x.reshape(rows, -1)
        if self.bits == 8:
            y = torch.ops.aten._weight_int8pack_mm(flat, self.qweight, self.scales)
        else:
            y = torch.ops.aten._weight_int4pack_mm_for_cpu(flat, self.qweight, INT4_GROUP, self.scales)
        if self.bias is not None:
            y = y + self.bias
        return y.view(*x.shape[:-1], -1)


def quantize_for_decode(model: nn.Module, bits: int, keep_int8: tuple[str, ...] = (), compute: bool = True) -> nn.Module:
    """Give every nn.Linear a quantized decode copy (bf16 models only: the kernels take bf16 activations).
    Layers named in `keep_int8`, or whose input width is not a multiple of the int4 group, use int8.
    compute=False only shapes the copies (to be filled from prepared weights)."""
    if next(model.parameters()).dtype != torch.bfloat16:
        raise ValueError("quantized decode weights need a bf16 model")
    for name, module in list(model.named_modules()):
        for child_name, child in list(module.named_children()):
            if isinstance(child, nn.Linear):
                full = f"{name}.{child_name}" if name else child_name
                use = 8 if bits == 8 or full in keep_int8 or child.in_features % INT4_GROUP else 4
                setattr(module, child_name, DecodeQuantLinear(child, use, compute))
    return model
