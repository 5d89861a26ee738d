"""Rotary position embedding in plain torch: the tables at any positions and their application, shared by the model
families and the sparse-attention kernel's reference (which rotates far keys at their own positions)."""

from __future__ import annotations

import torch


def rope_at(inv_freq: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """fp32 cos and sin (*S, 1, head_dim) at positions of any shape S, from angles computed in fp64: in fp32, an
    angle near position 1M would be off by up to 0.06 rad."""
    angles = positions.to(torch.float64)[..., None] * inv_freq.to(positions.device)
    cos, sin = angles.cos().float(), angles.sin().float()  # each angle once, then both halves
    return torch.cat([cos, cos], dim=-1)[..., None, :], torch.cat([sin, sin], dim=-1)[..., None, :]


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: (B, T, heads, D); cos/sin: (T, 1, D)."""
    half = x.shape[-1] // 2
    # x * cos + rotate_half(x) * sin, the rotated half added in place: the same roundings, and a prompt segment's
    # q/k take one output plus half of it as temporaries instead of four outputs
    out = x * cos
    out[..., :half] -= x[..., half:] * sin[..., :half]
    out[..., half:] += x[..., :half] * sin[..., half:]
    return out
