"""The seed's explicit formula: scores, mask, softmax, weights @ v. The oracle.

For the default causal case this is, operation for operation, the seed document's module,
so its outputs are bitwise the seed's. Half-precision inputs get their scores and softmax
in float32 (a float16 score overflows at 65504); the weights are cast back for ``@ v``.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from selfattn.backends._common import dense_mask, half, repeat_kv
from selfattn.masks import Mask

RETURNS_WEIGHTS = True


def available(device: torch.device) -> str | None:
    return None  # plain PyTorch: wherever PyTorch runs


def unsupported(q: Tensor, k: Tensor, v: Tensor, mask: Mask, dropout_p: float) -> str | None:
    return None  # the spec serves every request


def run(q: Tensor, k: Tensor, v: Tensor, mask: Mask, *, scale: float, dropout_p: float = 0.0) -> Tensor:
    return run_with_weights(q, k, v, mask, scale=scale, dropout_p=dropout_p)[0]


def run_with_weights(q: Tensor, k: Tensor, v: Tensor, mask: Mask, *, scale: float,
                     dropout_p: float = 0.0) -> tuple[Tensor, Tensor]:
    """Returns the output ``(B, H, T, D)`` and the attention weights ``(B, H, T, S)``
    (before dropout; rows that see nothing are all zero)."""
    H, T, S = q.shape[1], q.shape[2], k.shape[2]
    k, v = repeat_kv(k, H), repeat_kv(v, H)  # (B, H, S, D)
    if half(q.dtype):
        q, k = q.float(), k.float()
    att = (q @ k.transpose(-2, -1)) * scale  # (B, H, T, S)
    empty = None
    if not mask.is_full:
        allowed, empty = dense_mask(mask, T, S, q.device)
        att = att.masked_fill(~allowed, float("-inf"))
    att = F.softmax(att, dim=-1)
    if empty is not None:
        att = att.masked_fill(empty, 0.0)
    weights = att.to(v.dtype)
    dropped = F.dropout(weights, dropout_p) if dropout_p > 0.0 else weights
    return dropped @ v, weights  # (B, H, T, D), (B, H, T, S)
