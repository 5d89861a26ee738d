"""Weight-only int8 for decode on the CPU.

A single-token decode step is bound by reading weights: PyTorch's bf16 matrix-vector product reaches about
20 GB/s on this CPU, its int8 weight-only kernel (`_weight_int8pack_mm`) about 2-3x that. For a block of
tokens (prefill) the bf16 matmul on AMX is 10x faster than the int8 kernel, so `DecodeInt8Linear` keeps both:
bf16 weights for rows > `max_rows`, per-output-channel int8 weights for small batches of single tokens.
"""

from __future__ import annotations

import torch
from torch import nn


class DecodeInt8Linear(nn.Module):
    max_rows = 4  # up to this many rows the int8 kernel beats bf16 (measured: 1 row 3x, 8 rows on par)

    def __init__(self, linear: nn.Linear):
        super().__init__()
        self.weight = linear.weight
        self.bias = linear.bias
        w = linear.weight.detach().float()
        scale = w.abs().amax(dim=1).clamp_min(1e-12) / 127.0
        self.register_buffer("weight_int8", torch.round(w / scale[:, None]).to(torch.int8), persistent=False)
        self.register_buffer("scale", scale.to(linear.weight.dtype), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.numel() // x.shape[-1]
        if rows > self.max_rows:
            return nn.functional.linear(x, self.weight, self.bias)
        y = torch.ops.aten._weight_int8pack_mm(x.reshape(rows, -1), self.weight_int8, self.scale)
        if self.bias is not None:
            y = y + self.bias
        return y.view(*x.shape[:-1], -1)


def use_int8_decode(model: nn.Module) -> nn.Module:
    """Swap every nn.Linear for a DecodeInt8Linear; only for bf16 models (the kernel wants bf16 activations)."""
    if next(model.parameters()).dtype != torch.bfloat16:
        raise ValueError("int8 decode weights need a bf16 model")
    for name, child in list(model.named_children()):
        if isinstance(child, nn.Linear):
            setattr(model, name, DecodeInt8Linear(child))
        else:
            use_int8_decode(child)
    return model
