"""Which positions of a sequence each rank holds: the layouts, and sharding and unsharding.

A sequence of L positions is split over the P ranks of a process group:

- ``"contiguous"``: rank r holds positions ``[r·L/P, (r+1)·L/P)``. Simple, but under a causal
  mask the last rank's queries see every key and the first rank's see only their own.
- ``"zigzag"``: the sequence is cut into 2P chunks of L/(2P) and rank r holds chunks r and
  2P−1−r, an early one and a late one, so every rank has the same causal work.

L must be a multiple of P (contiguous) or 2P (zigzag). :func:`shard_sequence` pads a sequence
at its end to that length: under a causal mask no real position ever sees a padding one, so
the real positions' outputs and gradients are exactly those of the unpadded sequence (with
``causal=False``, mark the padding with a ``key_padding_mask``); :func:`unshard_sequence`
drops the padding again.
"""
from __future__ import annotations

import torch
import torch.distributed as dist
from torch import Tensor

LAYOUTS = ("zigzag", "contiguous")


def chunks(layout: str, rank: int, world: int, length: int) -> list[tuple[int, int]]:
    """The pieces of the sequence ``rank`` holds, in the order its shard stores them: (first position, size)."""
    if layout == "contiguous":
        n = length // world
        return [(rank * n, n)]
    n = length // (2 * world)
    return [(rank * n, n), ((2 * world - 1 - rank) * n, n)]


def multiple(layout: str, world: int) -> int:
    """What the sequence length must be a multiple of."""
    return world if layout == "contiguous" else 2 * world


def check_layout(layout: str) -> str:
    if layout not in LAYOUTS:
        raise ValueError(f"layout must be one of {', '.join(map(repr, LAYOUTS))}, got {layout!r}")
    return layout


def split(x: Tensor, dim: int, layout: str, rank: int, world: int) -> Tensor:
    """Rank ``rank``'s part of ``x``, which holds the whole sequence along ``dim``."""
    return torch.cat([x.narrow(dim, a, n) for a, n in chunks(layout, rank, world, x.shape[dim])], dim=dim)


def gather(part: Tensor, dim: int, layout: str, group: dist.ProcessGroup | None) -> Tensor:
    """The whole sequence along ``dim`` from every rank's ``part`` (an all-gather; no gradient)."""
    world = dist.get_world_size(group)
    parts = [torch.empty_like(part) for _ in range(world)]
    dist.all_gather(parts, part.contiguous(), group=group)
    pieces = {}
    for r, p in enumerate(parts):
        offset = 0
        for a, n in chunks(layout, r, world, part.shape[dim] * world):
            pieces[a] = p.narrow(dim, offset, n)
            offset += n
    return torch.cat([pieces[a] for a in sorted(pieces)], dim=dim)


def check_length(length, layout: str, world: int) -> int:
    m = multiple(layout, world)
    if not isinstance(length, int) or length <= 0 or length % m:
        raise ValueError(f"length={length!r}: layout {layout!r} over {world} ranks needs a positive multiple of {m} "
                         f"(shard_sequence pads to one)")
    return length


def shard_sequence(x: Tensor, *, group: dist.ProcessGroup | None = None, layout: str = "zigzag", dim: int = 1,
                   pad_value: float | int = 0) -> Tensor:
    """This rank's shard of ``x``, which holds the whole sequence along ``dim`` on every rank;
    the sequence is first padded at its end with ``pad_value`` to a length the layout can split
    (use -100 for the targets of a cross-entropy, which then ignores the padding)."""
    check_layout(layout)
    if not isinstance(x, Tensor):
        raise TypeError(f"shard_sequence: x must be a tensor, got {type(x).__name__}")
    m = multiple(layout, dist.get_world_size(group))
    pad = -x.shape[dim] % m
    if pad:
        shape = list(x.shape)
        shape[dim] = pad
        x = torch.cat([x, x.new_full(shape, pad_value)], dim=dim)
    return split(x, dim, layout, dist.get_rank(group), dist.get_world_size(group))


def unshard_sequence(shard: Tensor, length: int, *, group: dist.ProcessGroup | None = None, layout: str = "zigzag",
                     dim: int = 1) -> Tensor:
    """The whole sequence, its first ``length`` positions, from every rank's ``shard`` along
    ``dim`` (the inverse of :func:`shard_sequence`; an all-gather, without gradient)."""
    check_layout(layout)
    whole = gather(shard, dim, layout, group)
    if not isinstance(length, int) or not 0 < length <= whole.shape[dim]:
        raise ValueError(f"unshard_sequence: length={length!r} must be in 1..{whole.shape[dim]}, the sharded length")
    return whole.narrow(dim, 0, length)
