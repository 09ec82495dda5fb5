"""A preallocated key/value cache for one attention layer.

Shape: ``k`` and ``v`` are ``(B, Hkv, max_len, D)``; the first ``length`` positions along
dim 2 are live. Each forward of T new tokens writes slots ``[length, length + T)`` and
attends over ``[0, length + T)`` only: unused slots are never read.
"""
from __future__ import annotations

import torch
from torch import Tensor

from selfattn._validate import positive_ints


class KVCache:
    def __init__(self, batch_size: int, n_kv_head: int, max_len: int, head_dim: int, *,
                 dtype: torch.dtype = torch.float32, device=None):
        positive_ints(batch_size=batch_size, n_kv_head=n_kv_head, max_len=max_len, head_dim=head_dim)
        shape = (batch_size, n_kv_head, max_len, head_dim)
        self.k = torch.zeros(shape, dtype=dtype, device=device)  # (B, Hkv, max_len, D)
        self.v = torch.zeros(shape, dtype=dtype, device=device)  # (B, Hkv, max_len, D)
        self.length = 0

    @property
    def max_len(self) -> int:
        return self.k.shape[2]

    def append(self, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
        """Write T new positions (``k``, ``v`` of shape (B, Hkv, T, D)); return the live
        keys and values ``(B, Hkv, length, D)`` including them."""
        if k.shape != v.shape or k.shape[:2] != self.k.shape[:2] or k.shape[3] != self.k.shape[3]:
            raise ValueError(f"KVCache: expected k, v of shape (B={self.k.shape[0]}, Hkv={self.k.shape[1]}, "
                             f"T, D={self.k.shape[3]}), got {tuple(k.shape)} and {tuple(v.shape)}")
        T = k.shape[2]
        end = self.length + T
        if end > self.max_len:
            raise ValueError(f"KVCache overflow: {self.length} cached + {T} new positions > max_len={self.max_len}; "
                             f"allocate a larger cache or call reset()")
        self.k[:, :, self.length:end] = k
        self.v[:, :, self.length:end] = v
        self.length = end
        return self.k[:, :, :end], self.v[:, :, :end]

    def reset(self) -> None:
        """Forget every cached position (the memory is kept for reuse)."""
        self.length = 0

    def __repr__(self) -> str:
        B, Hkv, max_len, D = self.k.shape
        return f"KVCache(B={B}, Hkv={Hkv}, length={self.length}/{max_len}, D={D}, dtype={self.k.dtype})"
