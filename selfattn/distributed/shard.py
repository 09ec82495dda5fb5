"""What a model needs to run on one rank's part of a sequence: :class:`SequenceShard`."""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import Tensor

from selfattn.distributed import layout as layouts
from selfattn.distributed.ring import ring_attention


@dataclass(frozen=True)
class SequenceShard:
    """This rank's part of sequences of ``length`` positions split over ``group`` (None: the
    default group) in ``layout``: the global positions of its tokens, and attention over the
    whole sequence (:func:`~selfattn.distributed.ring_attention`).

    ``GPT.forward(shard.split(idx), shard.split(targets), shard=shard)`` runs a GPT on this
    rank's tokens; its loss is the mean over this rank's positions.
    """
    length: int
    group: dist.ProcessGroup | None = None
    layout: str = "zigzag"

    def __post_init__(self):
        layouts.check_layout(self.layout)
        if not dist.is_available() or not dist.is_initialized():
            raise ValueError("a SequenceShard needs a process group: call torch.distributed.init_process_group first")
        if self.rank < 0:
            raise ValueError("this process is not a member of the SequenceShard's group")
        layouts.check_length(self.length, self.layout, self.world)

    @property
    def world(self) -> int:
        return dist.get_world_size(self.group)

    @property
    def rank(self) -> int:
        return dist.get_rank(self.group)

    def positions(self, device=None) -> Tensor:
        """The global positions of this rank's tokens, int64 ``(length / world,)``."""
        return torch.cat([torch.arange(a, a + n, device=device)
                          for a, n in layouts.chunks(self.layout, self.rank, self.world, self.length)])

    def split(self, x: Tensor, dim: int = 1) -> Tensor:
        """This rank's part of ``x``, which holds the whole sequence along ``dim``."""
        if not isinstance(x, Tensor) or x.dim() <= dim or x.shape[dim] != self.length:
            raise ValueError(f"split: dimension {dim} of {tuple(getattr(x, 'shape', ()))} is not the sequence "
                             f"length {self.length}")
        return layouts.split(x, dim, self.layout, self.rank, self.world)

    def gather(self, part: Tensor, dim: int = 1) -> Tensor:
        """The whole sequence along ``dim`` from every rank's ``part`` (an all-gather; no gradient)."""
        return layouts.gather(part, dim, self.layout, self.group)

    def attention(self, q: Tensor, k: Tensor, v: Tensor, **options) -> Tensor:
        """:func:`~selfattn.distributed.ring_attention` of this rank's q, k, v over the group."""
        return ring_attention(q, k, v, group=self.group, layout=self.layout, **options)
