"""The FlashAttention algorithm in plain PyTorch: memory linear in T, a custom backward.

Forward (FlashAttention-2): the queries are cut into blocks of ``block_q`` rows and the keys
into blocks of ``block_k`` columns. Each query block walks over the key blocks keeping, per
row, the running maximum ``m`` of its scores, the running sum ``l`` of ``exp(score - m)`` and
the running output ``acc``; when the maximum grows, ``l`` and ``acc`` are rescaled by
``exp(m_old - m_new)``. Only one ``(block_q, block_k)`` score tile per head exists at a time,
so memory grows with T, not T². The mask's block map (:meth:`Mask.blocks`) decides per tile:
a tile it hides is never computed, a tile it shows in full takes no mask, only a partial tile
is masked. The map differs between batch rows under padding or documents, so the rows are
grouped by their map (:func:`plan`) and each group runs on its own tiles. The forward saves
the per-row log-sum-exp ``lse = m + log l``.
(q is pre-multiplied by ``scale·log2(e)``, so the scores, ``m`` and ``lse`` are in log2
units and every exponential is an ``exp2``, faster than ``exp`` on CPU.)

Backward (FlashAttention-2), key block by key block: the probabilities are recomputed from
the saved ``lse`` (``P = exp(S - lse)``), with ``D = rowsum(dO * O)`` and
``dS = P * (dP - D)``; nothing of size T x S is ever stored.

A query row that sees no key (padding) has ``l = 0``: it outputs zeros, and its ``lse`` is
set to +inf so its recomputed P, hence its gradients, are exactly zero.

GQA never repeats K/V: q ``(B, H, T, D)`` is laid out as ``(B·Hkv, T·G, D)`` (G = H / Hkv,
the G query heads of one key/value head side by side for each position), so one batched
matmul over B·Hkv serves all G query heads of a key/value head, and ``dK``, ``dV`` sum over
the group inside the matmul.

Dropout is supported: each tile draws its keep-mask from its own generator (one per batch
row for a group of some rows), seeded from one number drawn from torch's global generator
per call and the tile's place, so the backward regenerates exactly the forward's mask without
storing it.

Half precision (FlashAttention's arithmetic): where the device multiplies float16 or bfloat16
natively (:func:`multiplies_natively`), the tiles are multiplied as they are, and P and dS are rounded to
the input's dtype to be multiplied; every product is accumulated in float32, and the sums, the
running output and the softmax statistics are float32. Elsewhere the tiles are multiplied in
float32, which is faster there than an emulated half-precision matmul.
"""
from __future__ import annotations

from itertools import groupby
from typing import NamedTuple

import torch
from torch import Tensor
from torch.autograd.function import once_differentiable

from selfattn._util.seeds import seed_for
from selfattn._util.validate import positive_ints
from selfattn.backends._common import half
from selfattn.kernels.features import multiplies_natively
from selfattn.masks import HIDDEN, PARTIAL, Mask
from selfattn.scores import Scores

# Tile sizes: large enough to hide each tile's ~10 PyTorch calls, small enough to skip what a mask
# hides; 256 x 256, and 128 x 128 where a window, padding or documents hide tiles (why: docs/design.md,
# "The block map").
BLOCK_Q = 256  # query rows per tile, plain causal or unmasked
BLOCK_K = 256  # key columns per tile, plain causal or unmasked
MASKED_BLOCK = 128  # rows and columns per tile when a window, padding or documents hide tiles
LOG2E = 1.4426950408889634  # log2(e): scores are kept in log2 units, so exp is exp2 (faster on CPU)
LN2 = 0.6931471805599453  # ln(2) = 1 / log2(e): back to natural units for the score rules
RETURNS_WEIGHTS = False


def available(device: torch.device) -> str | None:
    return None  # plain PyTorch: wherever PyTorch runs


def unsupported(q: Tensor, k: Tensor, v: Tensor, mask: Mask, dropout_p: float,
                scores: Scores | None = None) -> str | None:
    grad = torch.is_grad_enabled() and any(t.requires_grad for t in (q, k, v))
    if scores is not None and grad and (scores.closes_over_grad() or (scores.alibi_slopes is not None
                                                                      and scores.alibi_slopes.requires_grad)):
        return ("the tiled backward computes no gradient for tensors a score_mod closes over, nor for ALiBi "
                "slopes (learned sinks do get theirs); use 'math' for that")
    return None  # every mask, score rule, dtype, head size and dropout


class Tile(NamedTuple):
    """One visited tile: query indices [i0, i1) and key indices [k0, k1); ``masked`` when
    part of it is hidden, so the tile mask must be applied."""
    i0: int
    i1: int
    k0: int
    k1: int
    masked: bool


class Group(NamedTuple):
    """Batch rows that share one block map, and the tiles they compute, query block by query block."""
    rows: Tensor | None  # the batch rows (1-D int64), None for all of them
    tiles: list[Tile]


def plan(mask: Mask, T: int, S: int, block_q: int = BLOCK_Q, block_k: int = BLOCK_K, q_start: int | None = None,
         k_start: int = 0) -> list[Group]:
    """The tiles the kernel computes: the block map's PARTIAL and FULL tiles, for each group of
    batch rows with the same map (one group of all rows when the mask is the same for each).
    ``q_start``, ``k_start``: where the queries and keys sit in the sequence (:meth:`Mask.blocks`)."""
    kind = mask.blocks(T, S, block_q, block_k, q_start, k_start).kind  # (B or 1, nq, nk)
    if kind.shape[0] == 1:
        return [Group(None, _tiles(kind[0], T, S, block_q, block_k))]
    maps, which = torch.unique(kind.flatten(1), dim=0, return_inverse=True)  # rows with one map share it
    if len(maps) == 1:
        return [Group(None, _tiles(kind[0], T, S, block_q, block_k))]
    return [Group((which == g).nonzero().flatten().cpu(), _tiles(maps[g].view(kind.shape[1:]), T, S, block_q,
                                                                  block_k)) for g in range(len(maps))]


def _tiles(kind: Tensor, T: int, S: int, block_q: int, block_k: int) -> list[Tile]:
    """The non-hidden tiles of one (nq, nk) map, row-major."""
    return [Tile(qi * block_q, min(qi * block_q + block_q, T), kj * block_k, min(kj * block_k + block_k, S),
                 value == PARTIAL)
            for qi, row in enumerate(kind.tolist()) for kj, value in enumerate(row) if value != HIDDEN]


def tile_sizes(mask: Mask) -> tuple[int, int]:
    """(block_q, block_k) for a mask: smaller tiles where a window, padding or documents hide some."""
    return (BLOCK_Q, BLOCK_K) if mask.plain_causal or mask.is_full else (MASKED_BLOCK, MASKED_BLOCK)


def run(q: Tensor, k: Tensor, v: Tensor, mask: Mask, *, scale: float, dropout_p: float = 0.0,
        scores: Scores | None = None, block_q: int | None = None, block_k: int | None = None,
        seed: int | None = None) -> Tensor:
    """Attention of q ``(B, H, T, D)`` over k, v ``(B, Hkv, S, D)`` -> ``(B, H, T, D)``.

    ``block_q``, ``block_k``: tile sizes (default :func:`tile_sizes`). ``seed``: the dropout
    seed (default: drawn from torch's global generator, and only when ``dropout_p > 0``).
    """
    default_q, default_k = tile_sizes(mask)
    block_q, block_k = default_q if block_q is None else block_q, default_k if block_k is None else block_k
    positive_ints(block_q=block_q, block_k=block_k)
    if dropout_p > 0.0 and seed is None:
        seed = int(torch.randint(2 ** 62, ()).item())
    scores = scores if scores is not None else Scores()
    sinks = scores.sinks if scores.sinks is not None else q.new_zeros(0)  # a tensor input: it may need a gradient
    return _TiledAttention.apply(q, k, v, sinks, mask, scores, float(scale), float(dropout_p), seed or 0, block_q,
                                 block_k)


def forward_with_lse(q: Tensor, k: Tensor, v: Tensor, mask: Mask, *, scale: float, q_start: int | None = None,
                     k_start: int = 0) -> tuple[Tensor, Tensor]:
    """Attention of q ``(B, H, T, D)`` over k, v ``(B, Hkv, S, D)`` and its log-sum-exp, for
    merging with the attention of the same queries over other keys (ring attention).

    ``q_start``, ``k_start``: where the queries and keys sit in the sequence the mask speaks of
    (:meth:`Mask.blocks`). Returns out ``(B, H, T, D)`` (float32 for half inputs) and lse
    ``(B, H, T, 1)``, the natural log of each row's softmax denominator, -inf for a row that sees
    no key here (its out is 0). Outside autograd; :func:`backward_from_lse` is its backward.
    """
    B, H, T, _ = q.shape
    Hkv, S = k.shape[1], k.shape[2]
    qs, kw, vw = _prepare(q, k, v)
    block_q, block_k = tile_sizes(mask)
    groups = plan(mask, T, S, block_q, block_k, q_start, k_start)
    out, lse = _attend(qs, kw, vw, mask, Scores(), groups, B, H, scale, _starts(T, S, q_start, k_start), 0.0, 0)
    lse = _ungroup(lse, B, H, Hkv)  # (B, H, T, 1)
    return _ungroup(out, B, H, Hkv), torch.where(lse.isinf(), float("-inf"), lse * LN2)


def backward_from_lse(q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor, grad_out: Tensor, mask: Mask, *,
                      scale: float, q_start: int | None = None, k_start: int = 0) -> tuple[Tensor, Tensor, Tensor]:
    """The gradients (dq, dk, dv) through q's attention over these keys, where ``out`` and ``lse``
    ``(B, H, T, 1)`` are of the whole attention (every key block merged, :func:`forward_with_lse`'s
    units) and ``grad_out`` is dL/d(out): FlashAttention-2's backward, one key block at a time.
    dq is this block's share; dk, dv are complete for these keys as far as these queries go."""
    B, H, T, D = q.shape
    Hkv, S = k.shape[1], k.shape[2]
    qs, kw, vw = _prepare(q, k, v)
    block_q, block_k = tile_sizes(mask)
    groups = plan(mask, T, S, block_q, block_k, q_start, k_start)
    lse2 = _group(torch.where(lse.isinf(), float("inf"), lse * LOG2E).to(_accumulated(qs.dtype)), Hkv)
    dq, dk, dv, _ = _attend_backward(qs, kw, vw, out, lse2, grad_out, mask, Scores(), groups, scale,
                                     _starts(T, S, q_start, k_start), 0.0, 0)
    return dq, dk, dv


class _TiledAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, sinks, mask, scores, scale, dropout_p, seed, block_q, block_k):
        B, H, T, D = q.shape
        S = k.shape[2]
        qs, kw, vw = _prepare(q, k, v)
        groups = plan(mask, T, S, block_q, block_k)
        out, lse = _attend(qs, kw, vw, mask, scores, groups, B, H, scale, _starts(T, S), dropout_p, seed)
        out = _ungroup(out, B, H, k.shape[1]).to(q.dtype)  # (B, H, T, D)
        ctx.save_for_backward(qs, kw, vw, out, lse)
        ctx.setup = (mask, scores, groups, scale, dropout_p, seed)
        return out

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_out):
        qs, kw, vw, out, lse = ctx.saved_tensors
        mask, scores, groups, scale, dropout_p, seed = ctx.setup
        T, S = out.shape[2], kw.shape[1]
        dq, dk, dv, neg_d = _attend_backward(qs, kw, vw, out, lse, grad_out, mask, scores, groups, scale,
                                             _starts(T, S), dropout_p, seed)
        dsinks = None
        if scores.sinks is not None and ctx.needs_input_grad[3]:  # d sink_h = -sum of p_sink · D over h's rows
            B, H = out.shape[:2]
            Hkv = kw.shape[0] // B
            p_sink = (_sink_logits(scores.sinks, B, Hkv, T, lse.dtype) - lse).exp2_()  # (B·Hkv, T·G, 1)
            dsinks = (p_sink * neg_d).view(B, Hkv, T, H // Hkv).sum(dim=(0, 2)).reshape(H).to(scores.sinks.dtype)
        return dq, dk, dv, dsinks, None, None, None, None, None, None, None


def _prepare(q: Tensor, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """q, k, v as the kernels read them: q grouped (:func:`_group`), k, v ``(B·Hkv, S, D)``, in the
    dtype the tiles are multiplied in (half inputs in float32 where the device has no native half
    matmul). q is not scaled here: :func:`_scores` applies ``scale·log2(e)`` to the float32 product,
    since a half-precision q rounded after scaling would err by |score|·2^-9."""
    B, Hkv, S, D = k.shape
    work = q.dtype if multiplies_natively(q.device, q.dtype) else torch.float32
    qs = _group(q.to(work), Hkv)  # (B·Hkv, T·G, D)
    return qs, k.to(work).reshape(B * Hkv, S, D), v.to(work).reshape(B * Hkv, S, D)  # (B·Hkv, S, D) x2


def _starts(T: int, S: int, q_start: int | None = None, k_start: int = 0) -> tuple[int, int]:
    """(q_start, k_start) with :meth:`Mask.blocks`'s default: the queries are the last T of the S keys."""
    return (k_start + S - T if q_start is None else q_start), k_start


def _attend(qs: Tensor, kw: Tensor, vw: Tensor, mask: Mask, scores: Scores, groups: list[Group], B: int, H: int,
            scale: float, starts: tuple[int, int], dropout_p: float, seed: int) -> tuple[Tensor, Tensor]:
    """The forward over every group of rows: out ``(B·Hkv, T·G, D)`` and its log2-sum-exp2 ``(B·Hkv, T·G, 1)``."""
    Hkv = kw.shape[0] // B
    acc = _accumulated(qs.dtype)
    out, lse = torch.empty_like(qs, dtype=acc), qs.new_empty(B * Hkv, qs.shape[1], 1, dtype=acc)
    with _own_dtypes(qs.device):
        for group in groups:
            part = _Part(group, mask, scores, B, Hkv, H // Hkv, scale, starts, dropout_p, seed)
            o, l = _forward(part.take(qs), part.take(kw), part.take(vw), part)
            part.put(out, o)
            part.put(lse, l)
    return out, lse


def _attend_backward(qs: Tensor, kw: Tensor, vw: Tensor, out: Tensor, lse: Tensor, grad_out: Tensor, mask: Mask,
                     scores: Scores, groups: list[Group], scale: float, starts: tuple[int, int], dropout_p: float,
                     seed: int) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """dq ``(B, H, T, D)``, dk, dv ``(B, Hkv, S, D)`` (in ``out``'s dtype) and -D ``(B·Hkv, T·G, 1)``,
    from the log2-unit ``lse`` of the whole attention."""
    B, H, T, D = out.shape
    Hkv, S = kw.shape[0] // B, kw.shape[1]
    acc = _accumulated(qs.dtype)
    do = _group(grad_out.to(qs.dtype).contiguous(), Hkv)  # (B·Hkv, T·G, D); a stride-0 gradient (out.sum()) made
    # every product with it slower (docs/benchmarks.md, "Measurements the code cites")
    neg_d = _group((grad_out.to(acc) * out.to(acc)).sum(dim=3, keepdim=True).neg_(), Hkv)  # -D, (B·Hkv, T·G, 1)
    dq, dk, dv = (torch.empty_like(t, dtype=acc) for t in (qs, kw, vw))
    with _own_dtypes(qs.device):
        for group in groups:
            part = _Part(group, mask, scores, B, Hkv, H // Hkv, scale, starts, dropout_p, seed)
            grads = _backward(*(part.take(t) for t in (qs, kw, vw, lse, do, neg_d)), part)
            for full, g in zip((dq, dk, dv), grads):
                part.put(full, g)
    dq = _ungroup(dq.mul_(scale), B, H, Hkv).to(out.dtype)  # (B, H, T, D)
    dk = dk.mul_(scale).view(B, Hkv, S, D).to(out.dtype)  # (B, Hkv, S, D)
    dv = dv.view(B, Hkv, S, D).to(out.dtype)  # (B, Hkv, S, D)
    return dq, dk, dv, neg_d


class _Part:
    """One group of batch rows as the kernels see it: its slice of every (B·Hkv, ...) tensor,
    its mask, its tiles and the seeds of its dropout generators."""

    def __init__(self, group: Group, mask: Mask, scores: Scores, B: int, Hkv: int, G: int, scale: float,
                 starts: tuple[int, int], dropout_p: float, seed: int):
        self.tiles, self.dropout_p, self.seed = group.tiles, dropout_p, seed
        self.log2_scale = scale * LOG2E  # q · k times this: scores in log2 units
        self.q_start, self.k_start = starts  # the positions of query row 0 and key column 0
        self.batch = group.rows  # None: every batch row
        self.mask = mask if group.rows is None else mask.rows(group.rows)
        self.scores = scores
        nb = B if group.rows is None else len(group.rows)
        self.heads = (nb, Hkv, G)
        self.index = None if group.rows is None else (group.rows[:, None] * Hkv + torch.arange(Hkv)).flatten()
        self.batch_rows = torch.arange(B) if group.rows is None else group.rows  # what a score_mod sees as b

    def modify(self, s: Tensor, t: Tile) -> Tensor:
        """The score rules on a tile ``s`` (nb·Hkv, Bq·G, Bk) of log2-unit scores, in log2 units.
        Built-ins are applied in place (ALiBi: one broadcast multiply-add; soft-capping: four in-place
        ops around a sigmoid); a score_mod of the user's runs on natural-unit scores and index tensors."""
        scores, (nb, Hkv, G) = self.scores, self.heads
        Bq, Bk = t.i1 - t.i0, t.k1 - t.k0
        if scores.score_mod is None:
            if scores.alibi_slopes is not None:
                p = torch.arange(self.q_start + t.i0, self.q_start + t.i1, device=s.device, dtype=s.dtype)
                j = torch.arange(self.k_start + t.k0, self.k_start + t.k1, device=s.device, dtype=s.dtype)
                dist = p[:, None] - j[None, :]  # (Bq, Bk), exact: positions are integers below 2^24
                slopes = scores.alibi_slopes.to(s.dtype).view(1, Hkv, 1, G, 1) * -LOG2E  # -slope, log2 units
                # one multiply-add, no bias tile: faster than an int64 distance tile and a bias tile
                # (docs/benchmarks.md, "Measurements the code cites")
                s.view(nb, Hkv, Bq, G, Bk).addcmul_(slopes, dist[None, None, :, None, :])
            if scores.softcap is not None:
                # c·tanh(x/c) = 2c·sigmoid(2x/c) - c. On a 2-core AVX2 CPU, tanh_ on an 8 x 256 x 256 tile
                # took longer than the tile's two matmuls, sigmoid_ far less (docs/benchmarks.md,
                # "Measurements the code cites")
                c = scores.softcap
                s.mul_(2 * LN2 / c).sigmoid_().mul_(2 * LOG2E * c).sub_(LOG2E * c)
            return s
        grid = s.view(nb, Hkv, Bq, G, Bk) * LN2  # (nb, Hkv, Bq, G, Bk) natural units
        d = s.device
        b = self.batch_rows.to(d)[:, None, None, None, None]  # (nb, 1, 1, 1, 1)
        h = (torch.arange(Hkv, device=d)[:, None] * G + torch.arange(G, device=d))[None, :, None, :, None]  # heads
        p = torch.arange(self.q_start + t.i0, self.q_start + t.i1, device=d)[None, None, :, None, None]  # (1,1,Bq,1,1)
        j = torch.arange(self.k_start + t.k0, self.k_start + t.k1, device=d)[None, None, None, None, :]  # (1,1,1,1,Bk)
        return (scores.apply(grid, b, h, p, j) * LOG2E).view_as(s)

    def take(self, t: Tensor) -> Tensor:
        """This group's rows of a (B·Hkv, ...) tensor (the tensor itself for every row)."""
        return t if self.index is None else t.index_select(0, self.index.to(t.device))

    def put(self, full: Tensor, part: Tensor) -> None:
        """Write this group's rows ``part`` into the (B·Hkv, ...) tensor ``full``."""
        if self.index is None:
            full.copy_(part)
        else:
            full.index_copy_(0, self.index.to(full.device), part)

    def keep(self, t: Tile, p: Tensor) -> Tensor:
        """Tile ``t``'s dropout multiplier, shaped like its score tile ``p`` (nb·Hkv, Bq·G, Bk):
        0 where dropped, ``1 / (1 - dropout_p)`` where kept. A function of (seed, tile, batch
        row), so forward and backward, and any grouping of the rows, draw the same mask."""
        rows = [None] if self.batch is None else self.batch.tolist()
        shape = (p.shape[0] // len(rows), *p.shape[1:])
        draws = [torch.rand(shape, generator=torch.Generator(device=p.device).manual_seed(
            _tile_seed(self.seed, b, t)), device=p.device, dtype=p.dtype) for b in rows]
        u = draws[0] if len(draws) == 1 else torch.cat(draws)
        return (u >= self.dropout_p).to(p.dtype).div_(1.0 - self.dropout_p)


def _tile_seed(seed: int, row: int | None, t: Tile) -> int:
    """The generator seed of one tile (of one batch row; None: of all rows at once)."""
    return seed_for(seed, row, t.i0, t.k0)


def _forward(qs: Tensor, k: Tensor, v: Tensor, part: _Part) -> tuple[Tensor, Tensor]:
    """Online softmax over the part's tiles, query block by query block. Returns out
    ``(nb·Hkv, T·G, D)`` and the log2-sum-exp2 of the scores ``(nb·Hkv, T·G, 1)``."""
    G = part.heads[2]
    N, TG, D = qs.shape
    acc_dtype = _accumulated(qs.dtype)
    floor = torch.finfo(acc_dtype).min  # a finite start: a row hidden in a whole tile gets 2^(-inf - floor) = 0
    out = torch.zeros_like(qs, dtype=acc_dtype)
    lse = qs.new_full((N, TG, 1), float("inf"), dtype=acc_dtype)
    kt = k.transpose(1, 2)  # (B·Hkv, D, S)
    sinks = part.scores.sinks
    for (i0, i1), block in groupby(part.tiles, key=lambda t: (t.i0, t.i1)):
        rows = slice(i0 * G, i1 * G)
        q_i = qs[:, rows]  # (B·Hkv, Bq·G, D)
        if sinks is None:
            m = qs.new_full((N, (i1 - i0) * G, 1), floor, dtype=acc_dtype)  # running row max
            l = torch.zeros_like(m)  # running row sum of 2^(score - m)
        else:  # the sink is one more logit of every row, seen before any key: 2^(sink - sink) = 1
            m = _sink_logits(sinks, part.heads[0], part.heads[1], i1 - i0, acc_dtype)  # (B·Hkv, Bq·G, 1)
            l = torch.ones_like(m)
        acc = torch.zeros_like(q_i, dtype=acc_dtype)  # running unnormalised output
        for t in block:
            s = _scores(q_i, kt[:, :, t.k0:t.k1], part.log2_scale)  # (B·Hkv, Bq·G, Bk)
            if part.scores.modifies:
                s = part.modify(s, t)
            if t.masked:
                _hide(s, t, part)
            m_new = torch.maximum(m, s.amax(dim=2, keepdim=True))  # (B·Hkv, Bq·G, 1)
            p = s.sub_(m_new).exp2_()  # (B·Hkv, Bq·G, Bk), in place of the scores
            alpha = m.sub_(m_new).exp2_()  # 2^(m_old - m_new) rescales the old sum and output
            m = m_new
            l.mul_(alpha).add_(p.sum(dim=2, keepdim=True))
            if part.dropout_p > 0.0:
                p.mul_(part.keep(t, p))
            _add_mm_(acc.mul_(alpha), p, v[:, t.k0:t.k1])
        # A row that sees a key has l >= 1 (its maximum contributes 2^0 = 1); a row that sees none has
        # l = 0 and acc = 0: it outputs zeros, and its lse = +inf makes its P zero in the backward.
        out[:, rows] = acc.div_(l.clamp(min=1.0))
        lse[:, rows] = torch.where(l > 0, m + l.log2(), float("inf"))
    return out, lse


def _backward(qs: Tensor, k: Tensor, v: Tensor, lse: Tensor, do: Tensor, neg_d: Tensor,
              part: _Part) -> tuple[Tensor, Tensor, Tensor]:
    """FlashAttention-2 backward from the saved lse over the part's tiles, key block by key
    block. Returns dq (still to be scaled), dk (still to be divided by log2(e)), dv."""
    G = part.heads[2]
    neg_lse = lse.neg()  # (B·Hkv, T·G, 1)
    acc = _accumulated(qs.dtype)
    dq, dk, dv = (torch.zeros_like(t, dtype=acc) for t in (qs, k, v))
    kt, vt = k.transpose(1, 2), v.transpose(1, 2)  # (B·Hkv, D, S)
    by_key_block = sorted(part.tiles, key=lambda t: t.k0)
    for (k0, k1), block in groupby(by_key_block, key=lambda t: (t.k0, t.k1)):
        k_j, kt_j, vt_j = k[:, k0:k1], kt[:, :, k0:k1], vt[:, :, k0:k1]  # (B·Hkv, Bk, D), (B·Hkv, D, Bk) x2
        dk_j, dv_j = torch.zeros_like(k_j, dtype=acc), torch.zeros_like(k_j, dtype=acc)  # (B·Hkv, Bk, D)
        for t in block:
            rows = slice(t.i0 * G, t.i1 * G)
            q_i, do_i = qs[:, rows], do[:, rows]  # (B·Hkv, Bq·G, D)
            if part.scores.modifies:
                raw = _scores(q_i, kt_j, part.log2_scale)  # (B·Hkv, Bq·G, Bk) before the score rules
                user = raw.clone() if part.scores.score_mod is not None else None  # for the vjp of a score_mod
                p = part.modify(raw, t)
                capped = p.clone() if user is None and part.scores.softcap is not None else None
                p.add_(neg_lse[:, rows])  # scores - lse
            else:
                p = _scores(q_i, kt_j, part.log2_scale, neg_lse[:, rows])  # (B·Hkv, Bq·G, Bk) scores - lse
            if t.masked:
                _hide(p, t, part)
            p.exp2_()  # P, recomputed
            if part.dropout_p > 0.0:
                keep = part.keep(t, p)
                _add_mm_(dv_j, (p * keep).transpose(1, 2), do_i)
                ds = _mm(do_i, vt_j).mul_(keep).add_(neg_d[:, rows]).mul_(p)  # P * (dP - D)
            else:
                _add_mm_(dv_j, p.transpose(1, 2), do_i)
                ds = _plus_mm(neg_d[:, rows], do_i, vt_j).mul_(p)  # P * (dP - D)
            if part.scores.score_mod is not None:
                ds = _through_score_rules(ds, user, t, part)  # the gradient of the unmodified scores
            elif part.scores.softcap is not None:  # d(c·tanh(s/c))/ds = 1 - tanh²(s/c), from the capped scores
                ds.mul_(capped.mul_(1.0 / (LOG2E * part.scores.softcap)).square_().neg_().add_(1.0))
            _add_mm_(dq[:, rows], ds, k_j)
            _add_mm_(dk_j, ds.transpose(1, 2), q_i)
        dk[:, k0:k1], dv[:, k0:k1] = dk_j, dv_j
    return dq, dk, dv


def _own_dtypes(device: torch.device) -> torch.autocast:
    """A context where autocast leaves the kernels' matmuls in the dtypes they chose."""
    return torch.autocast(device.type, enabled=False)


def _accumulated(tile_dtype: torch.dtype) -> torch.dtype:
    """The dtype products, sums and softmax statistics are kept in: float32 for half-precision tiles."""
    return torch.float32 if half(tile_dtype) else tile_dtype


def _mm(a: Tensor, b: Tensor) -> Tensor:
    """a @ b (batched) in the accumulation dtype; half tiles are multiplied as they are, a cast
    to b's dtype first (P and dS), with a float32 product."""
    return _half_product(a.to(b.dtype), b) if half(b.dtype) else torch.bmm(a, b)


def _scores(q: Tensor, kt: Tensor, log2_scale: float, shift: Tensor | None = None) -> Tensor:
    """The scores of a tile in log2 units, ``log2_scale · q @ kt (+ shift)``, in float32 (or float64).
    Scores are the one product whose absolute error counts: 2^s turns an error e of s into a factor
    2^e on a weight, and a half-precision score rounded to its dtype errs by |s|·2^-9 (bfloat16's step
    at s = 180 is 1). A GPU returns the float32 product of half tiles as it is; PyTorch's CPU matmul
    rounds it, so there half tiles are multiplied in float32 for the scores alone (a cast of Bq + Bk
    rows of D against a product of Bq·Bk·D)."""
    if half(kt.dtype) and not _exact_half_product(kt.device):
        q, kt = q.float(), kt.float()
    if half(kt.dtype):
        s = _half_product(q, kt).mul_(log2_scale)
        return s if shift is None else s.add_(shift)
    if shift is None:  # beta=0: the input is ignored, the scale rides in the matmul
        return torch.baddbmm(q.new_zeros(()), q, kt, beta=0.0, alpha=log2_scale)
    return torch.baddbmm(shift, q, kt, alpha=log2_scale)


def _exact_half_product(device: torch.device) -> bool:
    """Whether ``device`` returns the float32 product of half tiles unrounded (a GPU's ``out_dtype``)."""
    return device.type == "cuda"


def _half_product(a: Tensor, b: Tensor) -> Tensor:
    """The float32 product of half-precision batched matrices, accumulated in float32. A GPU
    returns it as it is (``out_dtype``); PyTorch 2.13's CPU matmul rounds it to half precision
    first (no float32 output there), which still keeps the FlashAttention rule for P·V and the
    gradients (tested), not for the scores (:func:`_scores`)."""
    if _exact_half_product(a.device):
        return torch.bmm(a, b, out_dtype=torch.float32)
    return torch.bmm(a, b).float()


def _plus_mm(c: Tensor, a: Tensor, b: Tensor) -> Tensor:
    """c + a @ b: one fused call when the tiles are in c's dtype."""
    return torch.baddbmm(c, a, b) if c.dtype == b.dtype else _mm(a, b).add_(c)


def _add_mm_(c: Tensor, a: Tensor, b: Tensor) -> Tensor:
    """c += a @ b in place: one fused call when the tiles are in c's dtype."""
    return c.baddbmm_(a, b) if c.dtype == b.dtype else c.add_(_mm(a, b))


def _hide(s: Tensor, t: Tile, part: _Part) -> None:
    """Set the hidden entries of the score tile ``s`` (nb·Hkv, Bq·G, Bk) to -inf, in place."""
    q0, k0 = part.q_start + t.i0, part.k_start + t.k0
    allowed = part.mask.tile(q0, q0 + t.i1 - t.i0, k0, k0 + t.k1 - t.k0, s.device)  # (nb|1, H|1, Bq, Bk)
    nb, Hkv, G = part.heads
    Bq, Bk = t.i1 - t.i0, t.k1 - t.k0
    grid = s.view(nb, Hkv, Bq, G, Bk)  # (nb, Hkv, Bq, G, Bk)
    if allowed.shape[1] == 1:
        grid.masked_fill_(~allowed[:, :, :, None, :], float("-inf"))
    else:  # a mask_mod that depends on the head: (nb|1, Hkv·G, Bq, Bk) -> (nb|1, Hkv, Bq, G, Bk)
        per_head = allowed.view(allowed.shape[0], Hkv, G, Bq, Bk).transpose(2, 3)
        grid.masked_fill_(~per_head, float("-inf"))


def _through_score_rules(ds: Tensor, raw: Tensor, t: Tile, part: _Part) -> Tensor:
    """dL/d(raw score) from dL/d(modified score): the vector-Jacobian product of the score rules
    on the tile (ALiBi alone is a shift and needs none)."""
    with torch.enable_grad():
        leaf = raw.detach().requires_grad_(True)
        (grad,) = torch.autograd.grad(part.modify(leaf, t), leaf, ds)
    return grad


def _sink_logits(sinks: Tensor, nb: int, Hkv: int, rows: int, dtype: torch.dtype) -> Tensor:
    """The sink logit of every row of a (nb·Hkv, rows·G, 1) block, in log2 units (head h = hk·G + g)."""
    G = len(sinks) // Hkv
    per_head = (sinks.to(dtype) * LOG2E).view(Hkv, G)  # (Hkv, G)
    return per_head[None, :, None, :].expand(nb, Hkv, rows, G).contiguous().view(nb * Hkv, rows * G, 1)


def _group(x: Tensor, Hkv: int) -> Tensor:
    """(B, H, T, D) -> (B·Hkv, T·G, D): the G = H / Hkv query heads of each key/value head
    side by side for every position (a view when G == 1)."""
    B, H, T, D = x.shape
    G = H // Hkv
    if G == 1:
        return x.reshape(B * H, T, D)  # (B·H, T, D)
    x = x.view(B, Hkv, G, T, D).transpose(2, 3)  # (B, Hkv, T, G, D)
    return x.reshape(B * Hkv, T * G, D)  # (B·Hkv, T·G, D)


def _ungroup(x: Tensor, B: int, H: int, Hkv: int) -> Tensor:
    """(B·Hkv, T·G, D) -> (B, H, T, D), the inverse of :func:`_group`."""
    G, D = H // Hkv, x.shape[2]
    T = x.shape[1] // G
    return x.view(B, Hkv, T, G, D).transpose(2, 3).reshape(B, H, T, D)  # (B, H, T, D)
