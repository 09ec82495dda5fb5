"""Jobs for the ring-attention tests, each ``job(rank, world, ...)`` run on every process of a
gloo group by :func:`selfattn.distributed.launch.run_local`; rank 0's result is the job's.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from selfattn import attention
from selfattn.config import GPTConfig
from selfattn.distributed import SequenceShard, ring, ring_attention, shard_sequence, unshard_sequence
from selfattn.distributed.launch import run_local
from selfattn.model import GPT


def run_ranks(job: str, world: int, **kwargs):
    """Rank 0's result of ``job`` (a function of this module) run on ``world`` processes."""
    return run_local(_job, world, job, kwargs)[0]


def _job(rank: int, world: int, job: str, kwargs: dict):
    return globals()[job](rank, world, **kwargs)


# Each case: (name, options). T positions in all; masks drawn from a seed, the same on every rank.
CASES = [
    ("causal", dict()),
    ("window-5", dict(window=5)),
    ("window-across-ranks", dict(window="shard+3")),
    ("documents", dict(docs=True)),
    ("key-padding", dict(padding=True)),
    ("padding-and-documents", dict(padding=True, docs=True, window=9)),
    ("GQA", dict(H=4, Hkv=2)),
    ("MQA-window", dict(H=4, Hkv=1, window=7)),
    ("not-causal", dict(causal=False)),
    ("not-causal-padding", dict(causal=False, padding=True)),
    ("odd-length", dict(T_minus=3)),
    ("long", dict(T_times=12)),  # several kernel tiles inside one chunk
]


def _case(opts: dict, world: int, dtype: torch.dtype, seed: int):
    """Full-sequence inputs of a case: q, k, v, grad_out and the mask keywords (global)."""
    g = torch.Generator().manual_seed(seed)
    T = 2 * world * 12 * opts.get("T_times", 1) - opts.get("T_minus", 0)
    B, H, Hkv, D = 2, opts.get("H", 2), opts.get("Hkv", opts.get("H", 2)), 8
    q = torch.randn(B, H, T, D, generator=g, dtype=dtype)
    k, v = (torch.randn(B, Hkv, T, D, generator=g, dtype=dtype) for _ in range(2))
    grad = torch.randn(B, H, T, D, generator=g, dtype=dtype)
    mask = {"causal": opts.get("causal", True)}
    window = opts.get("window")
    if window == "shard+3":
        window = T // world + 3
    if window is not None:
        mask["window"] = window
    if opts.get("padding"):
        pad = torch.rand(B, T, generator=g) > 0.3
        pad[0, :5] = False  # left padding: the first queries of row 0 see nothing (their output is 0)
        mask["key_padding_mask"] = pad
    if opts.get("docs"):
        mask["doc_ids"] = (torch.rand(B, T, generator=g) < 0.08).cumsum(1)
    return q, k, v, grad, mask


def _ring_vs_math(rank: int, world: int, opts: dict, layout: str, dtype: torch.dtype, seed: int,
                  backend: str = "auto") -> float:
    """Max relative error, over out, dq, dk, dv, of ring attention against the math backend on
    the whole sequence (float64 reference), over every rank."""
    q, k, v, grad, mask = _case(opts, world, dtype, seed)
    T = q.shape[2]
    ref = [t.double().requires_grad_(True) for t in (q, k, v)]
    out = attention(*ref, backend="math", **{n: m for n, m in mask.items()})
    out.backward(grad.double())
    expected = [out.detach(), *(t.grad for t in ref)]

    def part(t, pad_value=0):  # this rank's shard of a (B, ·, T, ·) or (B, T) tensor
        return shard_sequence(t, layout=layout, dim=2 if t.dim() == 4 else 1, pad_value=pad_value)

    local = [part(t).detach().requires_grad_(True) for t in (q, k, v)]
    kw = {n: m for n, m in mask.items() if n in ("causal", "window")}
    if "key_padding_mask" in mask:
        kw["key_padding_mask"] = part(mask["key_padding_mask"], pad_value=False)
    elif not mask["causal"] and T % (2 * world):  # not causal: the end padding must be masked
        kw["key_padding_mask"] = part(torch.ones(q.shape[0], T, dtype=torch.bool), pad_value=False)
    if "doc_ids" in mask:
        kw["doc_ids"] = part(mask["doc_ids"], pad_value=-1)
    got = ring_attention(*local, layout=layout, backend=backend, **kw)
    got.backward(part(grad))  # zero gradient on the padding: it is not part of the sequence
    got = [got.detach(), *(t.grad for t in local)]
    err = 0.0
    for g_, e in zip(got, expected):
        whole = unshard_sequence(g_, T, layout=layout, dim=2)
        err = max(err, ((whole.double() - e).abs().max() / e.abs().max()).item())
    return err


def parity(rank: int, world: int, backend: str = "auto", dtypes=(torch.float64, torch.float32), names=None) -> dict:
    """{case/layout/dtype: max relative error} for every case (or those in ``names``), both
    layouts, each dtype, with ``backend``'s block kernel."""
    return {f"{name}/{layout}/{str(dtype)[6:]}": _ring_vs_math(rank, world, opts, layout, dtype, i, backend)
            for i, (name, opts) in enumerate(CASES) if names is None or name in names
            for layout in ("zigzag", "contiguous") for dtype in dtypes}


def negative_controls(rank: int, world: int) -> dict:
    """The parity error of two broken rings: one that skips a block, one that merges without the
    log-sum-exp rescale."""
    results = {}
    pairs, merge = ring._pairs, ring._merge

    def skip_one(mask, queries, keys):  # the pair of the first key chunk, before the query's own, dropped
        found = pairs(mask, queries, keys)
        return [p for p in found if p[3] >= p[1]] if any(p[3] < p[1] for p in found) else found

    def no_rescale(out, lse, o, l):  # the outputs averaged as if every block had the same denominator
        seen = torch.isfinite(l)
        out.add_(torch.where(seen, o, 0.0))
        lse.copy_(torch.logaddexp(lse, l))

    for name, patch in (("skip-a-block", ("_pairs", skip_one)), ("no-rescale", ("_merge", no_rescale))):
        setattr(ring, *patch)
        try:
            results[name] = _ring_vs_math(rank, world, {}, "zigzag", torch.float64, seed=0)
        finally:
            ring._pairs, ring._merge = pairs, merge
    return results


def bad_requests(rank: int, world: int) -> dict:
    """{case: [the error every rank raised]} for requests that are bad on one rank or all."""
    q = torch.randn(1, 2, 8, 4)
    cases = {
        "unequal-shards": lambda: ring_attention(q[:, :, :6] if rank == 1 else q, q[:, :, :6] if rank == 1 else q,
                                                 q[:, :, :6] if rank == 1 else q),
        "bad-dtype-on-one-rank": lambda: ring_attention(q.long() if rank == 1 else q, q, q),
        "odd-zigzag-shard": lambda: ring_attention(q[:, :, :7], q[:, :, :7], q[:, :, :7]),
        "another-layout-on-one-rank": lambda: ring_attention(q, q, q, layout="contiguous" if rank else "zigzag"),
        "backend-without-lse": lambda: ring_attention(q, q, q, backend="sdpa"),
        "unknown-layout": lambda: ring_attention(q, q, q, layout="spiral"),
        "window-without-causal": lambda: ring_attention(q, q, q, causal=False, window=3),
    }
    out = {}
    for name, call in cases.items():
        try:
            call()
            message = None
        except (TypeError, ValueError) as e:
            message = f"{type(e).__name__}: {e}"
        everyone = [None] * world
        dist.all_gather_object(everyone, message)
        out[name] = everyone
    return out


def traffic(rank: int, world: int, layout: str, T: int, window: int | None) -> dict:
    """Bytes this rank sent in one forward and backward, and the ring's steps."""
    q = torch.randn(1, 2, T, 8)
    local = [shard_sequence(q, layout=layout, dim=2).detach().requires_grad_(True) for _ in range(3)]
    ring.traffic.reset()
    out = ring_attention(*local, layout=layout, window=window)
    forward = ring.traffic.sent
    out.sum().backward()
    return {"forward": forward, "backward": ring.traffic.sent - forward,
            "shard_bytes": local[0].numel() * local[0].element_size()}


def gpt(rank: int, world: int, pos: str, layout: str, window: int | None) -> dict:
    """A float64 GPT on the shards (loss and gradients averaged over the ranks, as DDP does)
    against the same GPT on the whole sequences: the relative differences."""
    torch.manual_seed(0)
    cfg = GPTConfig(vocab_size=64, block_size=48, n_layer=2, n_head=4, n_kv_head=2, n_embd=32, pos=pos,
                    window=window)
    model = GPT(cfg).double()
    g = torch.Generator().manual_seed(1)
    idx, targets = torch.randint(0, 64, (2, 48), generator=g), torch.randint(0, 64, (2, 48), generator=g)
    _, loss = model(idx, targets)
    loss.backward()
    expected = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad()
    shard = SequenceShard(48, layout=layout)
    _, local = model(shard.split(idx), shard.split(targets), shard=shard)
    local.backward()
    mean = local.detach().clone()
    dist.all_reduce(mean)
    err = {"loss": abs(mean.item() / world - loss.item()) / loss.item()}
    for n, p in model.named_parameters():
        dist.all_reduce(p.grad)
        err[n] = ((p.grad / world - expected[n]).abs().max() / expected[n].abs().max()).item()
    return err
