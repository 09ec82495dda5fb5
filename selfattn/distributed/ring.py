"""Ring attention: exact attention over a sequence split across the ranks of a process group.

Each of the P ranks holds its shard of the queries, keys and values (:mod:`.layout`). The K/V
shards travel around the ring, rank r sending to r+1 and receiving from r−1, so at step s rank
r holds the keys of rank r−s. Each rank attends its queries to the block it holds with a kernel
that also returns the block's log-sum-exp (:func:`~selfattn.backends.tiled.forward_with_lse`, or
the Triton kernel's on a GPU), and merges the partial results exactly:

    lse = log(e^lse_a + e^lse_b),   out = e^(lse_a − lse) · out_a + e^(lse_b − lse) · out_b

The next block's send and receive run while the current one is computed. The backward makes
the same round: the K/V shards travel again with their dK/dV accumulators, each rank adds its
queries' share (FlashAttention-2's backward from the merged lse,
:func:`~selfattn.backends.tiled.backward_from_lse`), and after the last step each accumulator
goes home in one hop.

Nothing hidden is computed or sent. The mask's block map over the whole sequence says which
(query piece, key piece) pairs have any visible pair; those alone are computed, and the ring
stops after the largest rank distance any rank needs: under a window of w ≤ L/P with the
contiguous layout that is one step whatever P is, so windows and documents save communication
as well as compute. Positions in the mask (causal diagonal, window, padding, documents) are
global: every rank builds the whole sequence's padding and document ids from the shards (an
all-gather of integers).

Requests are checked on every rank, and the checks are exchanged before any block moves: a
request that is bad on one rank (a wrong shape, shards of unequal length, another layout) is
the same one-line error on every rank, never a hang.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import Tensor
from torch.autograd.function import once_differentiable

from selfattn import backends
from selfattn._util import validate as _validate
from selfattn.backends import tiled
from selfattn.backends._common import half
from selfattn.distributed.layout import check_layout, chunks, gather
from selfattn.masks import HIDDEN, Mask

BACKENDS = ("auto", "tiled", "triton")  # those with a forward that returns the log-sum-exp and a backward from it
KV, DKV, HOME = 0, 1, 2  # message tags: the travelling K/V, their gradient accumulators, the last hop home


class Traffic:
    """Bytes this process sent through ring attention (forward and backward), for the benchmark."""

    def __init__(self):
        self.sent = 0

    def reset(self) -> None:
        self.sent = 0


traffic = Traffic()


def ring_attention(q: Tensor, k: Tensor, v: Tensor, *, group: dist.ProcessGroup | None = None, causal: bool = True,
                   window: int | None = None, key_padding_mask: Tensor | None = None, doc_ids: Tensor | None = None,
                   scale: float | None = None, layout: str = "zigzag", backend: str = "auto") -> Tensor:
    """Exact attention over a sequence split across the ranks of ``group`` (default: every rank).

    q ``(B, H, T/P, D)`` and k, v ``(B, Hkv, T/P, D)`` are this rank's shard of the sequence in
    ``layout`` (see :mod:`selfattn.distributed.layout`; :func:`shard_sequence` makes them), and
    so are ``key_padding_mask`` and ``doc_ids`` ``(B, T/P)`` if given. Returns this rank's shard
    ``(B, H, T/P, D)`` of the attention over the whole sequence, differentiable in q, k and v.
    The mask rules are :func:`selfattn.attention`'s, on global positions. ``backend``: the kernel
    of each block, ``"tiled"`` (any device), ``"triton"`` (a GPU, or the CPU under Triton's
    interpreter), or ``"auto"``: triton on a CUDA device where it can serve the request, else tiled.
    """
    if not dist.is_available() or not dist.is_initialized():
        raise ValueError("ring_attention needs a process group: call torch.distributed.init_process_group first")
    if group is not None and not isinstance(group, dist.ProcessGroup):
        raise TypeError(f"group must be a torch.distributed ProcessGroup or None, got {type(group).__name__}")
    world, rank = dist.get_world_size(group), dist.get_rank(group)
    if rank < 0:
        raise ValueError("ring_attention: this process is not a member of the group")
    try:
        request, problem = _Request.check(q, k, v, causal, window, key_padding_mask, doc_ids, scale, layout,
                                          backend, world), None
    except (TypeError, ValueError) as e:
        request, problem = None, (type(e).__name__, str(e))
    _agree(group, problem, request)
    plan = _plan(request, group, world, rank, key_padding_mask, doc_ids)
    return _RingAttention.apply(q, k, v, plan)


@dataclass(frozen=True)
class _Request:
    """What every rank must agree on, checked locally."""
    B: int
    H: int
    Hkv: int
    positions: int  # per shard
    D: int
    dtype: str
    device: str
    causal: bool
    window: int | None
    scale: float
    layout: str
    padding: bool
    documents: bool
    backend: str  # the kernel of each block, resolved

    @staticmethod
    def check(q, k, v, causal, window, key_padding_mask, doc_ids, scale, layout, backend, world) -> _Request:
        _validate.qkv(q, k, v)
        B, H, T, D = q.shape
        if k.shape[2] != T:
            raise ValueError(f"ring_attention: the shards of q ({T} positions) and k, v ({k.shape[2]}) must hold "
                             f"the same positions")
        if backend not in BACKENDS:
            raise ValueError(f"backend {backend!r} cannot serve a ring: merging the blocks needs each block's "
                             f"log-sum-exp and a backward from the merged one, which backends 'tiled' and "
                             f"'triton' have")
        check_layout(layout)
        if layout == "zigzag" and T % 2:
            raise ValueError(f"layout 'zigzag' holds two equal chunks per rank, so a shard needs an even length, got "
                             f"{T} (shard_sequence pads the sequence to a multiple of 2 x {world} ranks)")
        causal = _validate.flag("causal", causal)
        window = _validate.window(window, causal)
        scale = D ** -0.5 if scale is None else _validate.positive_number("scale", scale)
        for name, t, kind in (("key_padding_mask", key_padding_mask, bool), ("doc_ids", doc_ids, int)):
            _validate.per_key(name, t, B, T, kind, q.device)
        return _Request(B, H, k.shape[1], T, D, str(q.dtype), q.device.type, causal, window, float(scale),
                        layout, key_padding_mask is not None, doc_ids is not None, block_kernel(backend, q, k, v))


def block_kernel(backend: str, q: Tensor, k: Tensor, v: Tensor) -> str:
    """The block kernel ``backend`` names for these shards: "tiled" or "triton" (which must serve them)."""
    if backend == "tiled" or (backend == "auto" and q.device.type != "cuda"):
        return "tiled"
    why = backends.availability("triton", q.device)
    if why is None:
        why = backends.load("triton").unsupported(q, k, v, Mask(), 0.0)
    if why is None:
        return "triton"
    if backend == "auto":
        return "tiled"
    raise ValueError(f"backend 'triton' cannot serve this ring: {why}")


_DISAGREEMENT = {  # _Request field -> how a difference between ranks reads
    "positions": "shards of unequal length", "layout": "different layouts", "causal": "different causal flags",
    "window": "different windows", "scale": "different scales", "padding": "a key_padding_mask on some ranks only",
    "documents": "doc_ids on some ranks only", "dtype": "different dtypes", "device": "different devices",
    "backend": "different block kernels",
}


def _agree(group, problem: tuple[str, str] | None, request: _Request | None) -> None:
    """Exchange every rank's problem and request; raise the same error on every rank unless all are
    well and identical."""
    everyone: list = [None] * dist.get_world_size(group)
    dist.all_gather_object(everyone, (problem, request), group=group)
    for r, (bad, _) in enumerate(everyone):
        if bad is not None:
            kind, message = bad
            raise (TypeError if kind == "TypeError" else ValueError)(f"ring_attention: rank {r}: {message}")
    first = everyone[0][1]
    for r, (_, other) in enumerate(everyone[1:], start=1):
        for name in _Request.__dataclass_fields__:
            a, b = getattr(first, name), getattr(other, name)
            if a != b:
                what = _DISAGREEMENT.get(name, "different shapes")
                raise ValueError(f"ring_attention: {what}: rank 0 has {name}={a!r}, rank {r} has {name}={b!r}")


@dataclass
class _Plan:
    """One call's ring: the group, the global mask, and what this rank computes at each step."""
    group: dist.ProcessGroup | None
    world: int
    rank: int
    mask: Mask
    scale: float
    kernel: object  # the block kernel's module: forward_with_lse, backward_from_lse (tiled's signature)
    steps: int  # ring steps after the first, local one: the largest rank distance any rank needs
    pairs: list[list[tuple[slice, int, slice, int]]]  # per step: (query rows, their start, key rows, their start)

    def peer(self, offset: int) -> int:
        """The global rank of the group member ``offset`` places after this one."""
        return dist.get_global_rank(self.group or dist.group.WORLD, (self.rank + offset) % self.world)


def _plan(request: _Request, group, world: int, rank: int, key_padding_mask, doc_ids) -> _Plan:
    length = request.positions * world
    kpm, docs = key_padding_mask, doc_ids
    if kpm is not None or docs is not None:  # the whole sequence's, from every rank's shard
        local = torch.stack([t.long() for t in (kpm, docs) if t is not None])  # (1 or 2, B, T/P)
        whole = iter(gather(local, 2, request.layout, group))  # (1 or 2, B, T)
        kpm = next(whole).bool() if kpm is not None else None
        docs = next(whole) if docs is not None else None
    mask = Mask(causal=request.causal, window=request.window, key_padding_mask=kpm, doc_ids=docs)
    pieces = [_pieces(request.layout, r, world, length) for r in range(world)]
    sees = [[_pairs(mask, pieces[r], pieces[src]) for src in range(world)] for r in range(world)]
    steps = max(((r - src) % world for r in range(world) for src in range(world) if sees[r][src]), default=0)
    mine = [sees[rank][(rank - s) % world] for s in range(steps + 1)]
    kernel = tiled if request.backend == "tiled" else backends.load("triton")
    return _Plan(group, world, rank, mask, request.scale, kernel, steps, mine)


def _pieces(layout: str, rank: int, world: int, length: int) -> list[tuple[slice, int]]:
    """(rows of the shard, first global position) of each chunk a rank holds."""
    out, offset = [], 0
    for start, n in chunks(layout, rank, world, length):
        out.append((slice(offset, offset + n), start))
        offset += n
    return out


def _pairs(mask: Mask, queries: list[tuple[slice, int]], keys: list[tuple[slice, int]]) -> list[tuple]:
    """The (query chunk, key chunk) pairs in which the mask lets some query see some key."""
    out = []
    for q_rows, q_start in queries:
        for k_rows, k_start in keys:
            nq, nk = q_rows.stop - q_rows.start, k_rows.stop - k_rows.start
            kind = mask.blocks(nq, nk, nq, nk, q_start, k_start).kind  # (B or 1, 1, 1): one tile
            if bool((kind != HIDDEN).any()):
                out.append((q_rows, q_start, k_rows, k_start))
    return out


class _RingAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, plan):
        out, lse = _forward(q, k, v, plan)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.plan = plan
        return out.to(q.dtype)

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_out):
        q, k, v, out, lse = ctx.saved_tensors
        dq, dk, dv = _backward(q, k, v, out, lse, grad_out, ctx.plan)
        return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), None


def _forward(q: Tensor, k: Tensor, v: Tensor, plan: _Plan) -> tuple[Tensor, Tensor]:
    """This rank's merged out ``(B, H, T/P, D)`` and lse ``(B, H, T/P, 1)`` (float32 for half inputs)."""
    work = torch.float32 if half(q.dtype) else q.dtype
    out = q.new_zeros(q.shape, dtype=work)
    lse = q.new_full((*q.shape[:3], 1), float("-inf"), dtype=work)
    kv = torch.stack([k, v])  # (2, B, Hkv, T/P, D): one message per step
    for s in range(plan.steps + 1):
        arriving = _shift(kv, plan, KV) if s < plan.steps else None  # the next block travels while this one computes
        for q_rows, q_start, k_rows, k_start in plan.pairs[s]:
            o, l = plan.kernel.forward_with_lse(q[:, :, q_rows], kv[0][:, :, k_rows], kv[1][:, :, k_rows], plan.mask,
                                                scale=plan.scale, q_start=q_start, k_start=k_start)
            _merge(out[:, :, q_rows], lse[:, :, q_rows], o, l)
        if arriving is not None:
            kv = arriving.wait()
    return out, lse


def _merge(out: Tensor, lse: Tensor, o: Tensor, l: Tensor) -> None:
    """Fold a block's (o, l) into the running (out, lse), in place: each weighted by its share of
    the merged softmax denominator. Rows that have seen no key yet (lse = -inf) stay zero."""
    new = torch.logaddexp(lse, l)
    safe = torch.where(new.isinf(), 0.0, new)  # -inf (nothing seen): both weights exp(-inf) = 0
    out.mul_((lse - safe).exp_()).add_(o * (l - safe).exp_())
    lse.copy_(new)


def _backward(q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor, grad_out: Tensor,
              plan: _Plan) -> tuple[Tensor, Tensor, Tensor]:
    work = out.dtype
    grad_out = grad_out.to(work)
    dq = torch.zeros_like(q, dtype=work)
    kv = torch.stack([k, v])  # (2, B, Hkv, T/P, D)
    dkv = torch.zeros_like(kv, dtype=work)  # the gradient of the block in hand, from the ranks it has visited
    for s in range(plan.steps + 1):
        arriving = _shift(kv, plan, KV) if s < plan.steps else None
        for q_rows, q_start, k_rows, k_start in plan.pairs[s]:
            dq_b, dk_b, dv_b = plan.kernel.backward_from_lse(
                q[:, :, q_rows], kv[0][:, :, k_rows], kv[1][:, :, k_rows], out[:, :, q_rows], lse[:, :, q_rows],
                grad_out[:, :, q_rows], plan.mask, scale=plan.scale, q_start=q_start, k_start=k_start)
            dq[:, :, q_rows] += dq_b
            dkv[0][:, :, k_rows] += dk_b
            dkv[1][:, :, k_rows] += dv_b
        if arriving is not None:
            leaving = _shift(dkv, plan, DKV)  # the accumulator follows its block
            kv, dkv = arriving.wait(), leaving.wait()
    if plan.steps:  # the accumulator in hand is of the block from `steps` ranks back: send it home
        dkv = _exchange(dkv, plan, to=-plan.steps, source=plan.steps, tag=HOME).wait()
    return dq, dkv[0], dkv[1]


class _Arriving:
    """A receive in flight (and the send that goes with it); ``wait()`` returns the received tensor."""

    def __init__(self, buffer: Tensor, works: list):
        self.buffer, self.works = buffer, works

    def wait(self) -> Tensor:
        for w in self.works:
            w.wait()
        return self.buffer


def _shift(t: Tensor, plan: _Plan, tag: int) -> _Arriving:
    """Send ``t`` to the next rank and receive the previous rank's into a new tensor."""
    return _exchange(t, plan, to=1, source=-1, tag=tag)


def _exchange(t: Tensor, plan: _Plan, *, to: int, source: int, tag: int) -> _Arriving:
    t = t.contiguous()
    buffer = torch.empty_like(t)
    traffic.sent += t.numel() * t.element_size()
    works = [dist.isend(t, plan.peer(to), group=plan.group, tag=tag),
             dist.irecv(buffer, plan.peer(source), group=plan.group, tag=tag)]
    return _Arriving(buffer, works)
