"""The seed's explicit formula: scores, mask, softmax, weights @ v. The oracle.

For the default causal case this is, operation for operation, the seed document's module,
so its outputs are bitwise the seed's. Half-precision inputs get their scores and softmax
in float32 (a float16 score overflows at 65504); the weights are cast back for ``@ v``.
"""
from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import Tensor

from selfattn.backends._common import dense_mask, half, repeat_kv
from selfattn.masks import Mask
from selfattn.scores import Scores

RETURNS_WEIGHTS = True


def available(device: torch.device) -> str | None:
    return None  # plain PyTorch: wherever PyTorch runs


def unsupported(q: Tensor, k: Tensor, v: Tensor, mask: Mask, dropout_p: float,
                scores: Scores | None = None) -> str | None:
    return None  # the spec serves every request


def run(q: Tensor, k: Tensor, v: Tensor, mask: Mask, *, scale: float, dropout_p: float = 0.0,
        scores: Scores | None = None) -> Tensor:
    return run_with_weights(q, k, v, mask, scale=scale, dropout_p=dropout_p, scores=scores)[0]


def run_with_weights(q: Tensor, k: Tensor, v: Tensor, mask: Mask, *, scale: float, dropout_p: float = 0.0,
                     scores: Scores | None = None, tap: Callable | None = None) -> tuple[Tensor, Tensor]:
    """Returns the output ``(B, H, T, D)`` and the attention weights ``(B, H, T, S)``
    (before dropout; rows that see nothing are all zero; with sinks a row sums to less than one).
    ``tap(name, tensor) -> tensor`` (:mod:`selfattn.taps`) sees and may replace the scores
    ``hook_attn_scores`` (masked pairs at -inf) and the weights ``hook_pattern``."""
    B, H, T, S = q.shape[0], q.shape[1], q.shape[2], k.shape[2]
    k, v = repeat_kv(k, H), repeat_kv(v, H)  # (B, H, S, D)
    if half(q.dtype):
        q, k = q.float(), k.float()
    att = (q @ k.transpose(-2, -1)) * scale  # (B, H, T, S)
    if scores is not None and scores.modifies:
        b, h, p, j = _indices(B, H, T, S, q.device)
        att = scores.apply(att, b, h, p, j)
    empty = None
    if not mask.is_full:
        allowed, empty = dense_mask(mask, T, S, q.device)
        att = att.masked_fill(~allowed, float("-inf"))
    if tap is not None:
        att = tap("hook_attn_scores", att)
    if scores is not None and scores.sinks is not None:  # one more logit per row, carrying no value
        sink = scores.sinks.to(att.dtype)[None, :, None, None].expand(B, H, T, 1)  # (B, H, T, 1)
        att = F.softmax(torch.cat([att, sink], dim=-1), dim=-1)[..., :S]  # (B, H, T, S)
    else:
        att = F.softmax(att, dim=-1)
    if empty is not None:
        att = att.masked_fill(empty, 0.0)
    weights = att.to(v.dtype) if tap is None else tap("hook_pattern", att.to(v.dtype))
    dropped = F.dropout(weights, dropout_p) if dropout_p > 0.0 else weights
    return dropped @ v, weights  # (B, H, T, D), (B, H, T, S)


def _indices(B: int, H: int, T: int, S: int, device) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """Broadcasting batch, head, query-position (key coordinates) and key-position index tensors."""
    b = torch.arange(B, device=device)[:, None, None, None]  # (B, 1, 1, 1)
    h = torch.arange(H, device=device)[None, :, None, None]  # (1, H, 1, 1)
    p = torch.arange(S - T, S, device=device)[None, None, :, None]  # (1, 1, T, 1)
    return b, h, p, torch.arange(S, device=device)[None, None, None]  # j: (1, 1, 1, S)
