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
- ``sink_tokens=n`` (with a window): the first n keys stay visible to every later query
  (StreamingLLM's attention sinks).
- ``prefix_len`` ``(B,)`` or ``(1,)`` (prefix-LM, causal only, no window): the first P keys are
  visible to every query, so the prefix attends bidirectionally and the rest causally:
  ``j <= max(p, P - 1)``.
- ``mask_mod(b, h, q_idx, kv_idx) -> bool`` (FlexAttention's signature, called on broadcasting
  index tensors, ``q_idx`` the query's position in key coordinates): a rule of the user's,
  combined with the others by AND. ``n_head`` (and ``batch_rows``, the batch indices it sees)
  tell the mask how to call it.

A query row that can see nothing (e.g. a left-padding query) is defined to output zeros.

A part of the pairs. A kernel may be handed only some of the queries and keys (ring attention
hands each rank its shard, a block at a time): ``q_start`` and ``k_start`` place a block of T
queries and S keys in the whole sequence, whose positions the mask's rules and per-position
tensors speak of. The default is the layout above: ``k_start = 0``, ``q_start = S - T``.

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

import weakref
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor

HIDDEN, PARTIAL, FULL = 0, 1, 2  # the kinds of tile in a BlockMap
MOD_CHUNK = 2 ** 24  # mask_mod evaluations per chunk when a block map is derived from it
_mod_maps: OrderedDict = OrderedDict()  # (mask_mod, shape...) -> its tile kinds; see _mask_mod_kinds


@dataclass(frozen=True, eq=False)
class Mask:
    causal: bool = True
    window: int | None = None
    key_padding_mask: Tensor | None = None  # (B, S) bool, True = real token
    doc_ids: Tensor | None = None  # (B, S) integer document id per position
    sink_tokens: int | None = None  # with a window: the first n keys stay visible
    prefix_len: Tensor | None = None  # (B,) or (1,) int64: keys j < P visible to every query
    mask_mod: Callable | None = None  # mask_mod(b, h, q_idx, kv_idx) -> bool, AND-ed with the rest
    n_head: int | None = None  # H, the heads mask_mod is called with
    batch_rows: Tensor | None = None  # (B,) the batch indices mask_mod sees

    def __post_init__(self):
        if self.mask_mod is not None and (self.n_head is None or self.batch_rows is None):
            raise ValueError("a Mask with a mask_mod needs n_head and batch_rows (the heads and batch indices it "
                             "is called with); attention() sets them")

    @property
    def per_batch(self) -> bool:
        """True when the mask may differ between batch rows (padding, documents, prefixes, a mask_mod)."""
        return (self.key_padding_mask is not None or self.doc_ids is not None or self.mask_mod is not None
                or (self.prefix_len is not None and self.prefix_len.numel() > 1))

    @property
    def plain_causal(self) -> bool:
        """Causal attention and nothing else: no window, padding, documents, prefix or mask_mod."""
        return self.causal and self.window is None and not self.per_batch and self.prefix_len is None

    @property
    def is_full(self) -> bool:
        """True when every query may see every key."""
        return not self.causal and self.window is None and not self.per_batch

    def sees_every_key(self, T: int, S: int) -> bool:
        """True when each of the T queries may see all S keys: a full mask, or one causal query
        (decoding a token) whose window, if any, reaches back over every key the cache returned
        (a rolling cache returns the sinks and the window). Such a request needs no mask."""
        if self.is_full:
            return True
        reach = None if self.window is None else self.window + (self.sink_tokens or 0)
        return (T == 1 and self.causal and not self.per_batch and self.prefix_len is None
                and (reach is None or S <= reach))

    @property
    def may_have_empty_rows(self) -> bool:
        """Whether some query row can see no key at all (then it must output zeros).

        Causal and window rows always see their own position; padding and a mask_mod can hide it.
        """
        return self.key_padding_mask is not None or self.mask_mod is not None

    def tile(self, q0: int, q1: int, k0: int, k1: int, device=None) -> Tensor:
        """The predicate on a tile: queries at key indices [q0, q1), keys [k0, k1).

        Returns bool ``(B or 1, H or 1, q1 - q0, k1 - k0)``: B when the mask is per-batch, H when
        a mask_mod depends on the head.
        """
        p = torch.arange(q0, q1, device=device)[:, None]  # (Tq, 1) query positions
        j = torch.arange(k0, k1, device=device)[None, :]  # (1, Sk) key positions
        ok = torch.ones(q1 - q0, k1 - k0, dtype=torch.bool, device=device)
        if self.causal or self.window is not None:
            ok = j <= p
        if self.window is not None:
            recent = j > p - self.window
            ok = ok & (recent | (j < self.sink_tokens) if self.sink_tokens else recent)
        ok = ok[None, None]  # (1, 1, Tq, Sk)
        if self.prefix_len is not None:
            ok = ok | (j < self.prefix_len.to(j.device)[:, None, None, None])  # (B or 1, 1, Tq, Sk)
        if self.key_padding_mask is not None:
            ok = ok & self.key_padding_mask[:, None, None, k0:k1]  # (B, 1, Tq, Sk)
        if self.doc_ids is not None:
            docs = self.doc_ids
            ok = ok & (docs[:, None, q0:q1, None] == docs[:, None, None, k0:k1])  # (B, 1, Tq, Sk)
        if self.mask_mod is not None:
            ok = ok & self._user(p[None, None], j[None, None])  # (B or 1, H or 1, Tq, Sk)
        return ok

    def _user(self, p: Tensor, j: Tensor) -> Tensor:
        """``mask_mod`` on query positions p ``(1, 1, Tq, 1)`` and keys j ``(1, 1, 1, Sk)``, validated."""
        b = self.batch_rows.to(p.device)[:, None, None, None]  # (B, 1, 1, 1)
        h = torch.arange(self.n_head, device=p.device)[None, :, None, None]  # (1, H, 1, 1)
        out = self.mask_mod(b, h, p, j)
        want = (len(self.batch_rows), self.n_head, p.shape[2], j.shape[3])
        if not isinstance(out, Tensor) or out.dtype != torch.bool:
            raise TypeError(f"mask_mod must return a bool tensor, got "
                            f"{out.dtype if isinstance(out, Tensor) else type(out).__name__}")
        try:
            torch.broadcast_shapes(out.shape, want)
        except RuntimeError:
            raise ValueError(f"mask_mod returned shape {tuple(out.shape)}, which does not broadcast to "
                             f"(B, H, T, S) = {want}") from None
        return out.reshape((1,) * (4 - out.dim()) + tuple(out.shape))  # (B or 1, H or 1, Tq, Sk)

    def dense(self, T: int, S: int, device=None) -> Tensor:
        """The whole mask, bool ``(B or 1, 1, T, S)``: the tile of all queries and keys."""
        return self.tile(S - T, S, 0, S, device)

    def rows(self, index: Tensor) -> Mask:
        """The mask of the batch rows ``index`` (1-D integer tensor) of a per-batch mask."""
        def pick(t):
            return t if t is None or len(t) == 1 else t.index_select(0, index.to(t.device))
        return Mask(self.causal, self.window, pick(self.key_padding_mask), pick(self.doc_ids), self.sink_tokens,
                    pick(self.prefix_len), self.mask_mod, self.n_head, pick(self.batch_rows))

    def blocks(self, T: int, S: int, block_q: int, block_k: int, q_start: int | None = None,
               k_start: int = 0) -> BlockMap:
        """The :class:`BlockMap` of T queries over S keys in tiles of ``block_q`` x ``block_k``;
        the queries at positions ``q_start`` (default ``k_start + S - T``) onwards, the keys at
        ``k_start`` onwards (see "A part of the pairs")."""
        device = next((t.device for t in (self.key_padding_mask, self.doc_ids, self.prefix_len, self.batch_rows)
                       if t is not None), None)
        q_start = k_start + S - T if q_start is None else q_start
        nq, nk = -(-T // block_q), -(-S // block_k)
        p_lo = q_start + torch.arange(nq, device=device) * block_q  # (nq,) each query tile's first position
        p_hi = torch.clamp(p_lo + block_q, max=q_start + T) - 1  # (nq,) and its last
        k_lo = k_start + torch.arange(nk, device=device) * block_k  # (nk,) each key tile's first key
        k_hi = torch.clamp(k_lo + block_k, max=k_start + S) - 1  # (nk,) and its last
        hidden = torch.zeros(1, nq, nk, dtype=torch.bool, device=device)
        full = torch.ones(1, nq, nk, dtype=torch.bool, device=device)
        if self.causal or self.window is not None:  # visible: j <= max(p, P - 1) (P = 0 without a prefix)
            reach_hi, reach_lo = p_hi[None, :], p_lo[None, :]  # (1, nq) the last key the last, first query sees
            if self.prefix_len is not None:
                last = self.prefix_len.to(p_hi.device)[:, None] - 1  # (B or 1, 1)
                reach_hi, reach_lo = torch.maximum(reach_hi, last), torch.maximum(reach_lo, last)  # (B or 1, nq)
            hidden = hidden | (k_lo[None, None, :] > reach_hi[:, :, None])  # every key after every query
            full = full & (k_hi[None, None, :] <= reach_lo[:, :, None])  # every key seen by the first query
        if self.window is not None:
            n = self.sink_tokens or 0
            old = k_hi[None, None, :] <= p_lo[None, :, None] - self.window  # every key too old for every query
            hidden = hidden | (old & ~((k_lo < n)[None, None, :] & (k_lo[None, None, :] <= p_hi[None, :, None])))
            recent = k_lo[None, None, :] > p_hi[None, :, None] - self.window  # every key recent for the last query
            full = full & (recent | (k_hi < n)[None, None, :] | (p_hi - self.window < n)[None, :, None])
        keys, queries = slice(k_start, k_start + S), slice(q_start, q_start + T)
        if self.key_padding_mask is not None:
            real = _per_tile(self.key_padding_mask[:, keys].int(), block_k, "sum")  # (B, nk) real keys per key tile
            hidden = hidden | (real == 0)[:, None, :]
            full = full & (real == k_hi - k_lo + 1)[:, None, :]
        if self.doc_ids is not None:
            q_docs, k_docs = self.doc_ids[:, queries], self.doc_ids[:, keys]  # (B, T), (B, S)
            q_min, q_max = _per_tile(q_docs, block_q, "amin"), _per_tile(q_docs, block_q, "amax")  # (B, nq)
            k_min, k_max = _per_tile(k_docs, block_k, "amin"), _per_tile(k_docs, block_k, "amax")  # (B, nk)
            hidden = hidden | (q_max[:, :, None] < k_min[:, None, :]) | (q_min[:, :, None] > k_max[:, None, :])
            one_doc = (q_min == q_max)[:, :, None] & (k_min == k_max)[:, None, :]  # (B, nq, nk)
            full = full & one_doc & (q_min[:, :, None] == k_min[:, None, :])
        if self.mask_mod is not None:
            mod_hidden, mod_full = _mask_mod_kinds(self, T, S, block_q, block_k, q_start, k_start,
                                                   device)  # (B or 1, nq, nk)
            hidden, full = hidden | mod_hidden, full & mod_full
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


def _mask_mod_kinds(mask: Mask, T: int, S: int, block_q: int, block_k: int, q_start: int, k_start: int,
                    device) -> tuple[Tensor, Tensor]:
    """(hidden, full) ``(B or 1, nq, nk)`` of the mask_mod alone, over every head, found by calling
    it on every pair (as FlexAttention's ``create_block_mask`` does), a few query tiles at a time;
    cached per function and shape while the function lives."""
    key = (id(mask.mask_mod), mask.n_head, tuple(mask.batch_rows.tolist()), T, S, block_q, block_k, q_start,
           k_start, str(device))
    hit = _mod_maps.get(key)
    if hit is not None and hit[0]() is mask.mask_mod:
        return hit[1]
    only_mod = Mask(causal=False, mask_mod=mask.mask_mod, n_head=mask.n_head, batch_rows=mask.batch_rows)
    rows = max(1, MOD_CHUNK // max(1, S * mask.n_head * len(mask.batch_rows)) // block_q) * block_q
    hidden, full = [], []
    for i0 in range(0, T, rows):
        ok = only_mod.tile(q_start + i0, q_start + min(i0 + rows, T), k_start, k_start + S,
                           device)  # (B or 1, H or 1, rows, S)
        any_h, all_h = ok.any(1).int(), ok.all(1).int()  # (B or 1, rows, S): visible to some head, to every head
        hidden.append(_per_block(any_h, block_q, block_k, "amax") == 0)  # (B or 1, rows / block_q, nk)
        full.append(_per_block(all_h, block_q, block_k, "amin") == 1)
    kinds = (torch.cat(hidden, 1), torch.cat(full, 1)) if hidden else \
        (torch.zeros(1, 0, -(-S // block_k), dtype=torch.bool, device=device),) * 2
    _mod_maps[key] = (weakref.ref(mask.mask_mod), kinds)
    while len(_mod_maps) > 32:
        _mod_maps.popitem(last=False)
    return kinds


def _per_block(values: Tensor, block_q: int, block_k: int, how: str) -> Tensor:
    """(B, R, S) -> (B, ceil(R / block_q), ceil(S / block_k)): the min or max of each tile."""
    B, R, S = values.shape
    per_key = _per_tile(values.reshape(B * R, S), block_k, how).view(B, R, -1)  # (B, R, nk)
    per_tile = _per_tile(per_key.transpose(1, 2).reshape(-1, R), block_q, how)  # (B·nk, nq)
    return per_tile.view(B, -1, per_tile.shape[1]).transpose(1, 2)  # (B, nq, nk)


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
