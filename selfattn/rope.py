"""Rotary position embeddings (RoPE): rotate q and k by their absolute position.

Channel pairs (d, d + D/2) are rotated by the angle ``pos * base ** (-2d / D)`` (the
"rotate half" layout of GPT-NeoX and Llama). The score between a query at position m and a
key at position n then depends on m - n only, so a cache or an offset changes nothing.
"""
from __future__ import annotations

import torch
from torch import Tensor


def rope_angles(positions: Tensor, head_dim: int, base: float = 10000.0) -> tuple[Tensor, Tensor]:
    """cos and sin for integer ``positions`` (T,) or (B, T): each ``(1 or B, 1, T, D/2)``.

    Angles are computed in float64 (cheap: T x D/2 values), so large positions stay exact;
    :func:`apply_rope` casts them to its working precision.
    """
    if positions.dim() == 1:
        positions = positions[None]  # (1, T)
    inv_freq = base ** (-torch.arange(0, head_dim, 2, device=positions.device, dtype=torch.float64) / head_dim)
    angles = positions[:, None, :, None].double() * inv_freq  # (B, 1, T, D/2)
    return angles.cos(), angles.sin()


def apply_rope(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """Rotate ``x`` (B, H, T, D) by the angles of :func:`rope_angles`; same shape and dtype."""
    work = torch.promote_types(x.dtype, torch.float32)  # half inputs rotate in float32
    x1, x2 = x.to(work).chunk(2, dim=-1)  # (B, H, T, D/2) each
    cos, sin = cos.to(work), sin.to(work)
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1).to(x.dtype)
