"""Helpers the backends share: GQA's key/value sharing, the dense mask, half-precision dtypes."""
from __future__ import annotations

import torch
from torch import Tensor

from selfattn.masks import Mask


def repeat_kv(x: Tensor, n_head: int) -> Tensor:
    """GQA: share each of Hkv key/value heads with H / Hkv query heads. (B, Hkv, S, D) -> (B, H, S, D)."""
    B, Hkv, S, D = x.shape
    if Hkv == n_head:
        return x
    return x[:, :, None].expand(B, Hkv, n_head // Hkv, S, D).reshape(B, n_head, S, D)


def dense_mask(mask: Mask, T: int, S: int, device) -> tuple[Tensor, Tensor | None]:
    """The dense boolean mask ``(B or 1, 1, T, S)`` for backends that take one, and the rows
    that can see nothing ``(B, 1, T, 1)`` (None when there can be none).

    Empty rows are un-masked here so the softmax stays finite (no NaN, in forward or
    backward); the caller zeroes their output with ``out.masked_fill(empty, 0)``.
    """
    allowed = mask.dense(T, S, device)
    if not mask.may_have_empty_rows:
        return allowed, None
    empty = ~allowed.any(dim=-1, keepdim=True)  # (B, 1, T, 1)
    return allowed | empty, empty


def half(dtype: torch.dtype) -> bool:
    return dtype in (torch.float16, torch.bfloat16)
