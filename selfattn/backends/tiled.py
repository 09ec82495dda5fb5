"""The FlashAttention algorithm in plain PyTorch: memory linear in T, a custom backward.

Forward (FlashAttention-2): the queries are cut into blocks of ``block_q`` rows and the keys
into blocks of ``block_k`` columns. Each query block walks over the key blocks keeping, per
row, the running maximum ``m`` of its scores, the running sum ``l`` of ``exp(score - m)`` and
the running output ``acc``; when the maximum grows, ``l`` and ``acc`` are rescaled by
``exp(m_old - m_new)``. Only one ``(block_q, block_k)`` score tile per head exists at a time,
so memory grows with T, not T². A tile that the mask hides entirely is never computed
(:meth:`Mask.hides`); the tile mask is built only for tiles that are partly hidden
(:meth:`Mask.needs_tile`). The forward saves the per-row log-sum-exp ``lse = m + log l``.
(q is pre-multiplied by ``scale·log2(e)``, so the scores, ``m`` and ``lse`` are in log2
units and every exponential is an ``exp2``, three times faster than ``exp`` on CPU.)

Backward (FlashAttention-2), key block by key block: the probabilities are recomputed from
the saved ``lse`` (``P = exp(S - lse)``), with ``D = rowsum(dO * O)`` and
``dS = P * (dP - D)``; nothing of size T x S is ever stored.

A query row that sees no key (padding) has ``l = 0``: it outputs zeros, and its ``lse`` is
set to +inf so its recomputed P, hence its gradients, are exactly zero.

GQA never repeats K/V: q ``(B, H, T, D)`` is laid out as ``(B·Hkv, T·G, D)`` (G = H / Hkv,
the G query heads of one key/value head side by side for each position), so one batched
matmul over B·Hkv serves all G query heads of a key/value head, and ``dK``, ``dV`` sum over
the group inside the matmul.

Dropout is supported: each tile draws its keep-mask from its own generator, seeded from one
number drawn from torch's global generator per call, so the backward regenerates exactly
the forward's mask without storing it. Half-precision inputs are computed in float32.
"""
from __future__ import annotations

from itertools import groupby
from typing import NamedTuple

import torch
from torch import Tensor
from torch.autograd.function import once_differentiable

from selfattn._validate import positive_ints
from selfattn.backends._common import half
from selfattn.masks import Mask

# Tile sizes: each tile costs ~10 PyTorch calls, so tiles must be large enough to hide the
# per-call overhead. 256 x 256 was the fastest or tied of 128..512 on a 2-core CPU, float32
# forward+backward, D = 64, from (B=16, T=1024) to (B=2, T=8192); see the README.
BLOCK_Q = 256  # query rows per tile
BLOCK_K = 256  # key columns per tile
LOG2E = 1.4426950408889634  # log2(e): scores are kept in log2 units, so exp is exp2 (3x faster on CPU)
RETURNS_WEIGHTS = False


def available(device: torch.device) -> str | None:
    return None  # plain PyTorch: wherever PyTorch runs


def unsupported(q: Tensor, k: Tensor, v: Tensor, mask: Mask, dropout_p: float) -> str | None:
    return None  # every mask, dtype, head size and dropout


class Tile(NamedTuple):
    """One visited tile: query indices [i0, i1) and key indices [k0, k1); ``masked`` when
    part of it is hidden, so the tile mask must be applied."""
    i0: int
    i1: int
    k0: int
    k1: int
    masked: bool


def plan(mask: Mask, T: int, S: int, block_q: int = BLOCK_Q, block_k: int = BLOCK_K) -> list[Tile]:
    """The tiles the kernel computes, query block by query block; hidden tiles are left out.

    Query i sits at key index ``S - T + i`` (bottom-right alignment, see :mod:`selfattn.masks`).
    """
    offset = S - T
    tiles = []
    for i0 in range(0, T, block_q):
        i1 = min(i0 + block_q, T)
        p0, p1 = offset + i0, offset + i1  # the block's key-index positions
        for k0 in range(0, S, block_k):
            k1 = min(k0 + block_k, S)
            if not mask.hides(p0, p1, k0, k1):
                tiles.append(Tile(i0, i1, k0, k1, mask.needs_tile(p0, p1, k0, k1)))
    return tiles


def run(q: Tensor, k: Tensor, v: Tensor, mask: Mask, *, scale: float, dropout_p: float = 0.0,
        block_q: int = BLOCK_Q, block_k: int = BLOCK_K, seed: int | None = None) -> Tensor:
    """Attention of q ``(B, H, T, D)`` over k, v ``(B, Hkv, S, D)`` -> ``(B, H, T, D)``.

    ``block_q``, ``block_k``: tile sizes. ``seed``: the dropout seed (default: drawn from
    torch's global generator, and only when ``dropout_p > 0``).
    """
    positive_ints(block_q=block_q, block_k=block_k)
    if dropout_p > 0.0 and seed is None:
        seed = int(torch.randint(2 ** 62, ()).item())
    return _TiledAttention.apply(q, k, v, mask, float(scale), float(dropout_p), seed or 0, block_q, block_k)


class _TiledAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, mask, scale, dropout_p, seed, block_q, block_k):
        B, H, T, D = q.shape
        Hkv, S = k.shape[1], k.shape[2]
        work = torch.float32 if half(q.dtype) else q.dtype
        qs = _group(q.to(work) * (scale * LOG2E), Hkv)  # (B·Hkv, T·G, D), scores come out in log2 units
        kw = k.to(work).reshape(B * Hkv, S, D)  # (B·Hkv, S, D)
        vw = v.to(work).reshape(B * Hkv, S, D)  # (B·Hkv, S, D)
        tiles = plan(mask, T, S, block_q, block_k)
        out, lse = _forward(qs, kw, vw, mask, tiles, (B, Hkv, H // Hkv), S - T, dropout_p, seed)
        out = _ungroup(out, B, H, Hkv).to(q.dtype)  # (B, H, T, D)
        ctx.save_for_backward(qs, kw, vw, out, lse)
        ctx.setup = (mask, tiles, scale, dropout_p, seed, Hkv, S - T)
        return out

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_out):
        qs, kw, vw, out, lse = ctx.saved_tensors
        mask, tiles, scale, dropout_p, seed, Hkv, offset = ctx.setup
        B, H, T, D = out.shape
        S = kw.shape[1]
        grad_out = grad_out.to(qs.dtype)
        do = _group(grad_out, Hkv)  # (B·Hkv, T·G, D)
        neg_d = _group((grad_out * out.to(qs.dtype)).sum(dim=3, keepdim=True).neg_(), Hkv)  # -D, (B·Hkv, T·G, 1)
        dq, dk, dv = _backward(qs, kw, vw, lse, do, neg_d, mask, tiles, (B, Hkv, H // Hkv), offset, dropout_p, seed)
        dq = _ungroup(dq.mul_(scale), B, H, Hkv).to(out.dtype)  # (B, H, T, D)
        dk = dk.div_(LOG2E).view(B, Hkv, S, D).to(out.dtype)  # (B, Hkv, S, D); qs carried scale·log2(e)
        dv = dv.view(B, Hkv, S, D).to(out.dtype)  # (B, Hkv, S, D)
        return dq, dk, dv, None, None, None, None, None, None


def _forward(qs, k, v, mask, tiles, heads, offset, dropout_p, seed):
    """Online softmax, query block by query block. Returns out ``(B·Hkv, T·G, D)`` and the
    log2-sum-exp2 of the scores ``(B·Hkv, T·G, 1)``."""
    G = heads[2]
    N, TG, D = qs.shape
    floor = torch.finfo(qs.dtype).min  # a finite start: a row hidden in a whole tile gets 2^(-inf - floor) = 0
    out = torch.zeros_like(qs)
    lse = qs.new_full((N, TG, 1), float("inf"))
    kt = k.transpose(1, 2)  # (B·Hkv, D, S)
    for (i0, i1), block in groupby(enumerate(tiles), key=lambda nt: (nt[1].i0, nt[1].i1)):
        rows = slice(i0 * G, i1 * G)
        q_i = qs[:, rows]  # (B·Hkv, Bq·G, D)
        m = qs.new_full((N, (i1 - i0) * G, 1), floor)  # running row max
        l = torch.zeros_like(m)  # running row sum of 2^(score - m)
        acc = torch.zeros_like(q_i)  # running unnormalised output
        for n, t in block:
            s = torch.bmm(q_i, kt[:, :, t.k0:t.k1])  # (B·Hkv, Bq·G, Bk) scores
            if t.masked:
                _hide(s, mask, t, heads, offset)
            m_new = torch.maximum(m, s.amax(dim=2, keepdim=True))  # (B·Hkv, Bq·G, 1)
            p = s.sub_(m_new).exp2_()  # (B·Hkv, Bq·G, Bk), in place of the scores
            alpha = m.sub_(m_new).exp2_()  # 2^(m_old - m_new) rescales the old sum and output
            m = m_new
            l.mul_(alpha).add_(p.sum(dim=2, keepdim=True))
            if dropout_p > 0.0:
                p.mul_(_keep(seed, n, p, dropout_p))
            acc.mul_(alpha).baddbmm_(p, v[:, t.k0:t.k1])
        # A row that sees a key has l >= 1 (its maximum contributes 2^0 = 1); a row that sees none has
        # l = 0 and acc = 0: it outputs zeros, and its lse = +inf makes its P zero in the backward.
        out[:, rows] = acc.div_(l.clamp(min=1.0))
        lse[:, rows] = torch.where(l > 0, m + l.log2(), float("inf"))
    return out, lse


def _backward(qs, k, v, lse, do, neg_d, mask, tiles, heads, offset, dropout_p, seed):
    """FlashAttention-2 backward from the saved lse, key block by key block.
    Returns dq (still to be scaled), dk (still to be divided by log2(e)), dv."""
    G = heads[2]
    neg_lse = lse.neg()  # (B·Hkv, T·G, 1)
    dq, dk, dv = torch.zeros_like(qs), torch.zeros_like(k), torch.zeros_like(v)
    kt, vt = k.transpose(1, 2), v.transpose(1, 2)  # (B·Hkv, D, S)
    by_key_block = sorted(enumerate(tiles), key=lambda nt: nt[1].k0)  # stable: n stays each tile's index
    for (k0, k1), block in groupby(by_key_block, key=lambda nt: (nt[1].k0, nt[1].k1)):
        k_j, kt_j, vt_j = k[:, k0:k1], kt[:, :, k0:k1], vt[:, :, k0:k1]  # (B·Hkv, Bk, D), (B·Hkv, D, Bk) x2
        dk_j, dv_j = torch.zeros_like(k_j), torch.zeros_like(k_j)  # (B·Hkv, Bk, D)
        for n, t in block:
            rows = slice(t.i0 * G, t.i1 * G)
            q_i, do_i = qs[:, rows], do[:, rows]  # (B·Hkv, Bq·G, D)
            p = torch.baddbmm(neg_lse[:, rows], q_i, kt_j)  # (B·Hkv, Bq·G, Bk) scores - lse
            if t.masked:
                _hide(p, mask, t, heads, offset)
            p.exp2_()  # P, recomputed
            if dropout_p > 0.0:
                keep = _keep(seed, n, p, dropout_p)
                dv_j.baddbmm_((p * keep).transpose(1, 2), do_i)
                ds = torch.bmm(do_i, vt_j).mul_(keep).add_(neg_d[:, rows]).mul_(p)  # P * (dP - D)
            else:
                dv_j.baddbmm_(p.transpose(1, 2), do_i)
                ds = torch.baddbmm(neg_d[:, rows], do_i, vt_j).mul_(p)  # P * (dP - D)
            dq[:, rows] += torch.bmm(ds, k_j)
            dk_j.baddbmm_(ds.transpose(1, 2), q_i)
        dk[:, k0:k1], dv[:, k0:k1] = dk_j, dv_j
    return dq, dk, dv


def _hide(s: Tensor, mask: Mask, t: Tile, heads: tuple[int, int, int], offset: int) -> None:
    """Set the hidden entries of the score tile ``s`` (B·Hkv, Bq·G, Bk) to -inf, in place."""
    allowed = mask.tile(offset + t.i0, offset + t.i1, t.k0, t.k1, s.device)  # (B or 1, 1, Bq, Bk)
    B, Hkv, G = heads
    grid = s.view(B, Hkv, t.i1 - t.i0, G, t.k1 - t.k0)  # (B, Hkv, Bq, G, Bk)
    grid.masked_fill_(~allowed[:, :, :, None, :], float("-inf"))


def _keep(seed: int, n: int, p: Tensor, dropout_p: float) -> Tensor:
    """Tile ``n``'s dropout multiplier: 0 where dropped, ``1 / (1 - dropout_p)`` where kept.
    Deterministic in (seed, n), so forward and backward draw the same mask."""
    gen = torch.Generator(device=p.device).manual_seed(seed + n)
    u = torch.rand(p.shape, generator=gen, device=p.device, dtype=p.dtype)
    return (u >= dropout_p).to(p.dtype).div_(1.0 - dropout_p)


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
