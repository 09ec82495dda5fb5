"""PyTorch's fused ``scaled_dot_product_attention``.

``is_causal=True`` is used only where it is exactly our rule (T == S, causal, nothing
else): PyTorch aligns its causal mask top-left, which is wrong once a cache makes T < S.
A request whose queries see every key (one decoded token) passes no mask; every other
passes the explicit boolean mask from :mod:`selfattn.masks`; ALiBi, a dense additive bias,
passes as a float mask. Other score rules (soft-capping, a score_mod, sinks) are not
expressible to SDPA and are refused.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from selfattn.backends._common import dense_mask
from selfattn.masks import Mask
from selfattn.scores import Scores

RETURNS_WEIGHTS = False


def available(device: torch.device) -> str | None:
    return None  # PyTorch's own kernel: wherever PyTorch runs


def unsupported(q: Tensor, k: Tensor, v: Tensor, mask: Mask, dropout_p: float,
                scores: Scores | None = None) -> str | None:
    if scores is not None and (scores.softcap is not None or scores.score_mod is not None or scores.sinks is not None):
        return ("SDPA takes a mask or an additive bias only: soft-capping, a score_mod and sinks are not expressible; "
                "use 'tiled' or 'math'")
    return None  # every mask as an explicit boolean mask, ALiBi as a float one


def run(q: Tensor, k: Tensor, v: Tensor, mask: Mask, *, scale: float, dropout_p: float = 0.0,
        scores: Scores | None = None) -> Tensor:
    H, T, S = q.shape[1], q.shape[2], k.shape[2]
    alibi = scores is not None and scores.alibi_slopes is not None
    is_causal = mask.plain_causal and T == S and not alibi
    attn_mask, empty = None, None
    if not is_causal and not mask.sees_every_key(T, S):  # a decoded token sees every key: no mask
        attn_mask, empty = dense_mask(mask, T, S, q.device)  # (B or 1, H or 1, T, S) bool
    if alibi:
        j = torch.arange(S, device=q.device)
        bias = -scores.alibi_slopes.to(q.dtype)[:, None, None] * (j[S - T:, None] - j[None, :]).to(q.dtype)  # (H, T, S)
        attn_mask = bias[None] if attn_mask is None else bias[None].masked_fill(~attn_mask, float("-inf"))
    out = F.scaled_dot_product_attention(
        q, k, v, attn_mask=attn_mask, dropout_p=dropout_p, is_causal=is_causal,
        scale=scale, enable_gqa=H != k.shape[1])  # (B, H, T, D)
    return out if empty is None else out.masked_fill(empty, 0.0)
