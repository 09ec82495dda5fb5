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

Block map. Tiled kernels cut the T x S pairs into tiles of ``block_q`` queries by ``block_k``
keys; :meth:`Mask.blocks` says for every (batch row, query tile, key tile) whether the mask
hides all of the tile's pairs (the kernel skips it), shows all of them (no mask is applied)
or some (the tile is masked). It is computed from per-tile summaries, never from the T x S
mask: the extreme positions of each tile (causal, window), the number of real keys per key
tile (padding), the smallest and largest document id per tile (documents). HIDDEN and FULL
are always true statements about the tile; the map is exact (every PARTIAL tile really has
both kinds of pairs) for causal, window and padding and for sorted document ids, and may
call a tile PARTIAL that a combination of rules happens to hide or show entirely.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

HIDDEN, PARTIAL, FULL = 0, 1, 2  # the kinds of tile in a BlockMap


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

    def rows(self, index: Tensor) -> Mask:
        """The mask of the batch rows ``index`` (1-D integer tensor) of a per-batch mask."""
        pick = (lambda t: None if t is None else t.index_select(0, index.to(t.device)))
        return Mask(self.causal, self.window, pick(self.key_padding_mask), pick(self.doc_ids))

    def blocks(self, T: int, S: int, block_q: int, block_k: int) -> BlockMap:
        """The :class:`BlockMap` of T queries over S keys in tiles of ``block_q`` x ``block_k``."""
        device = next((t.device for t in (self.key_padding_mask, self.doc_ids) if t is not None), None)
        nq, nk = -(-T // block_q), -(-S // block_k)
        p_lo = S - T + torch.arange(nq, device=device) * block_q  # (nq,) each query tile's first position
        p_hi = torch.clamp(p_lo + block_q, max=S) - 1  # (nq,) and its last
        k_lo = torch.arange(nk, device=device) * block_k  # (nk,) each key tile's first key
        k_hi = torch.clamp(k_lo + block_k, max=S) - 1  # (nk,) and its last
        hidden = torch.zeros(1, nq, nk, dtype=torch.bool, device=device)
        full = torch.ones(1, nq, nk, dtype=torch.bool, device=device)
        if self.causal or self.window is not None:
            hidden |= k_lo[None, None, :] > p_hi[None, :, None]  # every key after every query
            full &= k_hi[None, None, :] <= p_lo[None, :, None]  # every key at or before the first query
        if self.window is not None:
            hidden |= k_hi[None, None, :] <= p_lo[None, :, None] - self.window  # every key too old for every query
            full &= k_lo[None, None, :] > p_hi[None, :, None] - self.window  # every key recent for the last query
        if self.key_padding_mask is not None:
            real = _per_tile(self.key_padding_mask.int(), block_k, "sum")  # (B, nk) real keys per key tile
            hidden = hidden | (real == 0)[:, None, :]
            full = full & (real == k_hi - k_lo + 1)[:, None, :]
        if self.doc_ids is not None:
            docs = self.doc_ids
            q_min, q_max = _per_tile(docs[:, S - T:], block_q, "amin"), _per_tile(docs[:, S - T:], block_q, "amax")
            k_min, k_max = _per_tile(docs, block_k, "amin"), _per_tile(docs, block_k, "amax")  # (B, nq), (B, nk)
            hidden = hidden | (q_max[:, :, None] < k_min[:, None, :]) | (q_min[:, :, None] > k_max[:, None, :])
            one_doc = (q_min == q_max)[:, :, None] & (k_min == k_max)[:, None, :]  # (B, nq, nk)
            full = full & one_doc & (q_min[:, :, None] == k_min[:, None, :])
        kind = torch.where(hidden, HIDDEN, torch.where(full, FULL, PARTIAL)).to(torch.uint8)
        return BlockMap(kind, block_q, block_k)


@dataclass(frozen=True)
class BlockMap:
    """Per (batch row, query tile, key tile): HIDDEN, PARTIAL or FULL (see the module docstring)."""
    kind: Tensor  # (B or 1, n_q, n_k) uint8; one row when the mask is the same for every batch row
    block_q: int  # queries per tile: tile i holds queries [i·block_q, (i+1)·block_q) of the T
    block_k: int  # keys per tile: tile j holds keys [j·block_k, (j+1)·block_k) of the S

    def density(self) -> float:
        """The fraction of tiles a kernel computes (PARTIAL or FULL), over every batch row."""
        return (self.kind != HIDDEN).float().mean().item() if self.kind.numel() else 0.0

    def lists(self, which: int) -> tuple[Tensor, Tensor]:
        """Per query tile, its key tiles of kind ``which`` (PARTIAL or FULL), as a kernel walks them:
        counts ``(B or 1, n_q)`` int32 and indices ``(B or 1, n_q, n_k)`` int32, the first
        ``count`` of each row in increasing order (FlexAttention's ``kv_num_blocks``/``kv_indices``)."""
        selected = self.kind == which
        counts = selected.sum(-1, dtype=torch.int32)  # (B or 1, nq)
        order = torch.argsort((~selected).to(torch.uint8), dim=-1, stable=True)  # selected tiles first, in order
        return counts.contiguous(), order.to(torch.int32).contiguous()  # rows contiguous: kernels step by 1

    def transposed(self) -> BlockMap:
        """The same map seen from the keys: per key tile, its query tiles (for dK and dV)."""
        return BlockMap(self.kind.transpose(1, 2), self.block_k, self.block_q)


def _per_tile(values: Tensor, block: int, how: str) -> Tensor:
    """(B, L) -> (B, ceil(L / block)): the sum, min or max of each run of ``block`` positions.
    The last, ragged run is padded with its own last value (min and max) or zeros (sum)."""
    B, L = values.shape
    pad = -L % block
    if pad:
        fill = values.new_zeros(B, pad) if how == "sum" else values[:, -1:].expand(B, pad)
        values = torch.cat([values, fill], dim=1)
    tiles = values.view(B, -1, block)  # (B, n, block)
    return getattr(tiles, how)(dim=2)


def allowed(q_pos: int, k_pos: int, *, causal: bool = True, window: int | None = None) -> bool:
    """The structural predicate for one pair of positions, in plain Python.

    The readable statement of the rule that :class:`Mask` vectorises; tests check the two
    agree. Padding and documents are per-token lookups on top of this.
    """
    if (causal or window is not None) and k_pos > q_pos:
        return False
    return window is None or k_pos > q_pos - window
