"""Preallocated key/value caches for one attention layer.

:class:`KVCache`: ``k`` and ``v`` are ``(B, Hkv, max_len, D)``; the first ``length`` positions
along dim 2 are live. Each forward of T new tokens writes slots ``[length, length + T)`` and
attends over ``[0, length + T)`` only: unused slots are never read.

:class:`RollingKVCache`, for sliding-window models: ``sink_tokens + window`` slots that wrap
around (Mistral's rolling buffer), so decoding keeps O(window) memory and work however long
it runs. A forward of T new tokens attends over the sink tokens, the cached positions still
inside the window, and the T new ones, in that order: the recent ones are contiguous with
the new ones, so the window rule holds in key coordinates, and the sinks (key indices below
``sink_tokens``) stay visible by the ``sink_tokens`` rule. Both caches tell which absolute
positions their keys hold (:meth:`positions`), so per-position masks can follow them.

Both roll back: :meth:`truncate` forgets the latest positions, as speculative decoding does
with the drafted tokens the target rejected. A :class:`KVCache` just shortens its live length;
a rolling cache has overwritten its oldest slots, so it keeps ``rollback`` more of them than
the window needs (see :meth:`RollingKVCache.truncate`).
"""
from __future__ import annotations

import torch
from torch import Tensor

from selfattn._util.validate import count, positive_ints


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

    def positions(self) -> Tensor:
        """The absolute positions of the keys the last :meth:`append` returned: ``0 .. length - 1``."""
        return torch.arange(self.length, device=self.k.device)

    def advance(self, T: int) -> None:
        """Count T positions as cached that another writer (the C++ decode kernel) put in their slots."""
        self.length += T

    def reset(self) -> None:
        """Forget every cached position (the memory is kept for reuse)."""
        self.length = 0

    def truncate(self, length: int) -> None:
        """Forget every position from ``length`` on: the cache then holds ``0 .. length - 1``."""
        _check_truncate(self, length)
        self.length = length

    def __repr__(self) -> str:
        B, Hkv, max_len, D = self.k.shape
        return f"KVCache(B={B}, Hkv={Hkv}, length={self.length}/{max_len}, D={D}, dtype={self.k.dtype})"


class RollingKVCache:
    """The last ``window`` positions (and the first ``sink_tokens``) of one layer, in ring slots;
    ``rollback`` more ring slots keep that many older positions for :meth:`truncate`."""

    def __init__(self, batch_size: int, n_kv_head: int, window: int, head_dim: int, *, sink_tokens: int = 0,
                 rollback: int = 0, dtype: torch.dtype = torch.float32, device=None):
        positive_ints(batch_size=batch_size, n_kv_head=n_kv_head, window=window, head_dim=head_dim)
        self.window, self.sink_tokens = window, count("sink_tokens", sink_tokens)
        self.rollback = count("rollback", rollback)
        self.ring = window + self.rollback  # R ring slots
        shape = (batch_size, n_kv_head, self.sink_tokens + self.ring, head_dim)
        self.k = torch.zeros(shape, dtype=dtype, device=device)  # (B, Hkv, n + R, D): sinks, then the ring
        self.v = torch.zeros(shape, dtype=dtype, device=device)
        self.length = 0  # positions seen so far
        self._last = (0, 0)  # the length before the last append and the positions it took

    @property
    def max_len(self) -> int | None:
        """None: a rolling cache takes any number of positions."""
        return None

    def append(self, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
        """Take T new positions (``k``, ``v`` (B, Hkv, T, D)); return what their queries attend
        over: ``(B, Hkv, S, D)``, the sinks, the cached positions in the window, the new ones."""
        if k.shape != v.shape or k.shape[:2] != self.k.shape[:2] or k.shape[3] != self.k.shape[3]:
            raise ValueError(f"RollingKVCache: expected k, v of shape (B={self.k.shape[0]}, Hkv={self.k.shape[1]}, "
                             f"T, D={self.k.shape[3]}), got {tuple(k.shape)} and {tuple(v.shape)}")
        n, L, T = self.sink_tokens, self.length, k.shape[2]
        device = self.k.device
        old = self._held(L)
        slots = self._slots(old)
        keys = torch.cat([self.k[:, :, slots], k], dim=2)  # (B, Hkv, S, D)
        values = torch.cat([self.v[:, :, slots], v], dim=2)
        new = torch.arange(L, L + T, device=device)
        keep = new[(new < n) | (new >= L + T - self.ring)]  # only the last R (and sinks) survive the wrap
        self.k[:, :, self._slots(keep)] = k[:, :, keep - L]
        self.v[:, :, self._slots(keep)] = v[:, :, keep - L]
        self.length, self._last = L + T, (L, T)
        return keys, values

    def _held(self, length: int) -> Tensor:
        """The cached positions a query at ``length`` sees: the sinks, then those in its window."""
        n, device = self.sink_tokens, self.k.device
        recent_from = min(max(n, length - self.window + 1), length)  # the oldest position in the window
        sinks = torch.arange(min(length, n), device=device)
        return torch.cat([sinks, torch.arange(recent_from, length, device=device)])

    def _slots(self, positions: Tensor) -> Tensor:
        """The slot of each absolute position: a sink's own slot, else its place in the ring."""
        n = self.sink_tokens
        return torch.where(positions < n, positions, n + (positions - n) % self.ring)

    def positions(self) -> Tensor:
        """The absolute positions of the keys the last :meth:`append` returned, in their order (those
        still cached after a :meth:`truncate`)."""
        L, T = self._last
        live = torch.cat([self._held(L), torch.arange(L, L + T, device=self.k.device)])
        return live[live < self.length]

    def advance(self, T: int) -> None:
        """Count T positions as cached that another writer (the C++ decode kernel) put in their slots
        (:meth:`_slots`), as an :meth:`append` of them would have."""
        self.length, self._last = self.length + T, (self.length, T)

    def reset(self) -> None:
        self.length, self._last = 0, (0, 0)

    def truncate(self, length: int) -> None:
        """Forget every position from ``length`` on. The next query, at ``length``, needs the
        ``window - 1`` positions before it, and the ring holds only the last ``window +
        rollback`` positions seen: going back up to ``rollback + 1`` positions always works (a
        ring of exactly ``window`` slots holds one more than the next query needs), further
        only while nothing it needs has been overwritten; otherwise a ValueError."""
        _check_truncate(self, length)
        n, L = self.sink_tokens, self.length
        needed_from = max(n, length - self.window + 1)  # the oldest ring position the next query reads
        held_from = max(n, L - self.ring)  # the oldest position still in the ring
        if needed_from < min(length, held_from):
            raise ValueError(f"RollingKVCache: cannot truncate {L} positions to {length}: the next query needs "
                             f"position {needed_from} on, but the ring of window={self.window} + "
                             f"rollback={self.rollback} slots holds only {held_from} on; allocate rollback >= "
                             f"{L - length - 1}")
        self.length = length

    def __repr__(self) -> str:
        B, Hkv, _, D = self.k.shape
        return (f"RollingKVCache(B={B}, Hkv={Hkv}, window={self.window}, sink_tokens={self.sink_tokens}, "
                f"rollback={self.rollback}, length={self.length}, D={D}, dtype={self.k.dtype})")


def _check_truncate(cache: KVCache | RollingKVCache, length) -> None:
    """A cache of ``cache.length`` positions can be truncated to ``0 <= length <= cache.length``."""
    count("length", length)
    if length > cache.length:
        raise ValueError(f"{type(cache).__name__}: cannot truncate to length={length}, it holds only "
                         f"{cache.length} positions")
