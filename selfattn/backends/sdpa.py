"""PyTorch's fused ``scaled_dot_product_attention``.

``is_causal=True`` is used only where it is exactly our rule (T == S, causal, nothing
else): PyTorch aligns its causal mask top-left, which is wrong once a cache makes T < S.
Every other request passes the explicit boolean mask from :mod:`selfattn.masks`.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from selfattn.backends._common import dense_mask
from selfattn.masks import Mask

RETURNS_WEIGHTS = False


def available(device: torch.device) -> str | None:
    return None  # PyTorch's own kernel: wherever PyTorch runs


def unsupported(q: Tensor, k: Tensor, v: Tensor, mask: Mask, dropout_p: float) -> str | None:
    return None  # every mask as an explicit boolean mask


def run(q: Tensor, k: Tensor, v: Tensor, mask: Mask, *, scale: float, dropout_p: float = 0.0) -> Tensor:
    T, S = q.shape[2], k.shape[2]
    plain_causal = mask.causal and mask.window is None and not mask.per_batch
    attn_mask, empty = None, None
    if not mask.is_full and not (plain_causal and T == S):
        attn_mask, empty = dense_mask(mask, T, S, q.device)
    out = F.scaled_dot_product_attention(
        q, k, v, attn_mask=attn_mask, dropout_p=dropout_p, is_causal=plain_causal and T == S,
        scale=scale, enable_gqa=q.shape[1] != k.shape[1])  # (B, H, T, D)
    return out if empty is None else out.masked_fill(empty, 0.0)
