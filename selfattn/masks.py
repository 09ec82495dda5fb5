"""Which keys a query may see: one mask description and one predicate for every backend.

Coordinates. Keys are numbered 0..S-1. Queries are the *last* T positions of the key
sequence: query i sits at key index ``S - T + i``. Without a cache T == S and the two
numberings agree; with a KV cache (T < S) the causal diagonal is aligned bottom-right, so
the newest query sees every cached key and itself, never top-left.

The rules, all combinable (True = may attend):

- ``causal``: key j is visible to the query at position p iff ``j <= p``.
- ``window=W``: additionally ``p - W < j``: the W most recent keys *including itself*.
  ``window=1`` sees only itself; ``window >= S`` is plain causal. A window implies causal.
- ``key_padding_mask`` ``(B, S)`` bool, True = real token: padding keys are never seen.
- ``doc_ids`` ``(B, S)`` integers (packed sequences): a query sees only keys whose
  document id equals its own (the id at its key index).

A query row that can see nothing (e.g. a left-padding query) is defined to output zeros.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor


@dataclass(frozen=True, eq=False)
class Mask:
    causal: bool = True
    window: int | None = None
    key_padding_mask: Tensor | None = None  # (B, S) bool, True = real token
    doc_ids: Tensor | None = None  # (B, S) integer document id per position

    @property
    def per_batch(self) -> bool:
        """True when the mask differs between batch rows (padding or documents)."""
        return self.key_padding_mask is not None or self.doc_ids is not None

    @property
    def is_full(self) -> bool:
        """True when every query may see every key."""
        return not self.causal and self.window is None and not self.per_batch

    @property
    def may_have_empty_rows(self) -> bool:
        """Whether some query row can see no key at all (then it must output zeros).

        Causal and window rows always see their own position; only padding can hide it.
        """
        return self.key_padding_mask is not None

    def tile(self, q0: int, q1: int, k0: int, k1: int, device=None) -> Tensor:
        """The predicate on a tile: queries at key indices [q0, q1), keys [k0, k1).

        Returns bool ``(B or 1, 1, q1 - q0, k1 - k0)``; B only when the mask is per-batch.
        """
        p = torch.arange(q0, q1, device=device)[:, None]  # (Tq, 1) query positions
        j = torch.arange(k0, k1, device=device)[None, :]  # (1, Sk) key positions
        ok = torch.ones(q1 - q0, k1 - k0, dtype=torch.bool, device=device)
        if self.causal or self.window is not None:
            ok = j <= p
        if self.window is not None:
            ok = ok & (j > p - self.window)
        ok = ok[None, None]  # (1, 1, Tq, Sk)
        if self.key_padding_mask is not None:
            ok = ok & self.key_padding_mask[:, None, None, k0:k1]  # (B, 1, Tq, Sk)
        if self.doc_ids is not None:
            docs = self.doc_ids
            ok = ok & (docs[:, None, q0:q1, None] == docs[:, None, None, k0:k1])  # (B, 1, Tq, Sk)
        return ok

    def dense(self, T: int, S: int, device=None) -> Tensor:
        """The whole mask, bool ``(B or 1, 1, T, S)``: the tile of all queries and keys."""
        return self.tile(S - T, S, 0, S, device)

    def hides(self, q0: int, q1: int, k0: int, k1: int) -> bool:
        """True when causal/window hide every pair of the tile, so a tiled kernel skips it."""
        if q1 <= q0 or k1 <= k0:
            return True
        if (self.causal or self.window is not None) and k0 > q1 - 1:
            return True  # every key is in the future of every query
        return self.window is not None and k1 - 1 <= q0 - self.window  # all keys too old

    def needs_tile(self, q0: int, q1: int, k0: int, k1: int) -> bool:
        """False when every pair of the tile is allowed, so no mask needs to be applied."""
        if self.per_batch:
            return True
        if (self.causal or self.window is not None) and k1 - 1 > q0:
            return True  # some key is in the future of the first query
        return self.window is not None and k0 <= q1 - 1 - self.window  # some key too old


def allowed(q_pos: int, k_pos: int, *, causal: bool = True, window: int | None = None) -> bool:
    """The structural predicate for one pair of positions, in plain Python.

    The readable statement of the rule that :class:`Mask` vectorises; tests check the two
    agree. Padding and documents are per-token lookups on top of this.
    """
    if (causal or window is not None) and k_pos > q_pos:
        return False
    return window is None or k_pos > q_pos - window
