"""Sequences longer than one device: the sequence itself split across processes.

- :mod:`.layout`: which positions each rank holds (``"zigzag"``, ``"contiguous"``),
  :func:`shard_sequence` / :func:`unshard_sequence`.
- :mod:`.ring`: :func:`ring_attention`, exact attention over the whole sequence from the shards,
  K/V blocks travelling around the ring of ranks.
- :mod:`.shard`: :class:`SequenceShard`, what a model needs to run on its part
  (``GPT.forward(..., shard=...)``): global positions and ring attention.

``selfattn train --context-parallel N`` (under torchrun) uses both.
"""
from selfattn.distributed.layout import LAYOUTS, shard_sequence, unshard_sequence
from selfattn.distributed.ring import ring_attention
from selfattn.distributed.shard import SequenceShard

__all__ = ["LAYOUTS", "SequenceShard", "ring_attention", "shard_sequence", "unshard_sequence"]
