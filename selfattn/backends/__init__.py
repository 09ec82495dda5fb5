"""Attention backends: interchangeable implementations of one contract.

Each backend module has ``run(q, k, v, mask, *, scale, dropout_p) -> out`` with
q ``(B, H, T, D)``, k and v ``(B, Hkv, S, D)``, out ``(B, H, T, D)``, and may have
``unsupported(q, k, v, mask, dropout_p) -> str | None`` saying why it can't serve a request.

- ``math``: the seed's explicit formula, the executable spec (and the only one that can
  return the attention weights);
- ``sdpa``: ``torch.nn.functional.scaled_dot_product_attention``;
- ``tiled``: the FlashAttention algorithm in plain PyTorch, memory linear in T;
- ``triton``: a fused GPU kernel (optional extra ``triton``), imported on first use.
"""
from __future__ import annotations

import importlib
import sys
from types import ModuleType

import torch
from torch import Tensor

from selfattn.masks import Mask

NAMES = ("math", "sdpa", "tiled", "triton")


def load(name: str) -> ModuleType:
    """The backend module called ``name`` (imported lazily: triton is optional)."""
    if name not in NAMES:
        raise ValueError(f"unknown attention backend {name!r}; choose one of {('auto',) + NAMES}")
    loaded = sys.modules.get(f"selfattn.backends.{name}")  # no import machinery once loaded: torch.compile traces this
    return loaded if loaded is not None else importlib.import_module(f"selfattn.backends.{name}")


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


# The pure-PyTorch backends are imported up front so that torch.compile never has to trace an
# import (``load`` finds them in sys.modules); only the optional triton backend stays lazy.
from selfattn.backends import math, sdpa, tiled  # noqa: E402,F401  (they import the helpers above)
