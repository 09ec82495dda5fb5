"""What happens to a score between ``scale · q · k`` and the softmax: one description for every backend.

In order, each off unless given:

1. ALiBi (Press et al., 2022): ``+ bias``, ``bias = -slope_h · (p - j)`` for a query at key
   position p and a key at position j; :func:`alibi_slopes` gives the paper's slopes per head;
2. soft-capping (Gemma 2): ``c · tanh(score / c)``;
3. ``score_mod(score, b, h, q_idx, kv_idx) -> score``: a function of the user's (FlexAttention's
   signature), called on broadcasting index tensors; ``q_idx`` is the query's position in key
   coordinates (``S - T + i``), unlike FlexAttention's 0..T-1, so ``q_idx - kv_idx`` is the distance
   with or without a cache. Scores are float32 for half-precision inputs, else in the inputs'
   dtype, and ``score_mod`` returns a tensor of the same dtype (:func:`check_score_mod`);

then the mask (:mod:`selfattn.masks`) hides pairs with ``-inf``, and the softmax runs over the
visible keys plus, with learned sinks (gpt-oss), one logit ``sinks[h]`` per head that joins every
row's denominator and carries no value: the weights of a row sum to less than one.
"""
from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor

from selfattn._util import validate as _validate


@dataclass(frozen=True, eq=False)
class Scores:
    alibi_slopes: Tensor | None = None  # (H,) ALiBi slope per query head
    softcap: float | None = None  # c of c · tanh(score / c)
    score_mod: Callable | None = None  # score_mod(score, b, h, q_idx, kv_idx) -> score
    sinks: Tensor | None = None  # (H,) sink logit per query head, in the softmax's denominator

    @property
    def modifies(self) -> bool:
        """Whether any score is changed before the softmax (sinks change only the softmax)."""
        return self.alibi_slopes is not None or self.softcap is not None or self.score_mod is not None

    @property
    def is_plain(self) -> bool:
        return not self.modifies and self.sinks is None

    def apply(self, s: Tensor, b: Tensor, h: Tensor, p: Tensor, j: Tensor) -> Tensor:
        """The modified scores: ``s`` (natural-log units) with index tensors ``b``, ``h``, ``p``
        (query positions), ``j`` (key positions) broadcasting against it."""
        if self.alibi_slopes is not None:
            s = s - self.alibi_slopes.to(s.dtype)[h] * (p - j).to(s.dtype)
        if self.softcap is not None:
            s = torch.tanh(s / self.softcap) * self.softcap
        if self.score_mod is not None:
            out = self.score_mod(s, b, h, p, j)
            if not isinstance(out, Tensor) or out.shape != s.shape:
                raise ValueError(f"score_mod must return a tensor shaped like its score {tuple(s.shape)}, got "
                                 f"{tuple(out.shape) if isinstance(out, Tensor) else type(out).__name__}")
            s = out
        return s

    def closes_over_grad(self) -> bool:
        """Whether ``score_mod`` uses tensors that require grad (a learned bias): its output requires
        grad even when its input does not."""
        if self.score_mod is None:
            return False
        i = torch.zeros(1, dtype=torch.long)
        with torch.enable_grad():
            out = self.score_mod(torch.zeros(1), i, i, i, i)
        return isinstance(out, Tensor) and out.requires_grad


def check_score_mod(score_mod: Callable, dtype: torch.dtype, device) -> None:
    """Call ``score_mod`` once on a one-element score for inputs of ``dtype``, before any backend
    runs it, and refuse what it returns unless it is a tensor of the score's dtype and shape: one
    error, the same on every backend (tiled would cast a bool or float64 result silently, the
    others fail deep inside torch, and flex traces the function)."""
    wanted = torch.float32 if dtype in (torch.float16, torch.bfloat16) else dtype  # what backends score in
    score = torch.zeros(1, 1, 1, 1, dtype=wanted, device=device)
    index = torch.zeros(1, 1, 1, 1, dtype=torch.long, device=device)
    with torch.no_grad():
        out = score_mod(score, index, index, index, index)
    if not isinstance(out, Tensor):
        raise TypeError(f"score_mod must return a tensor, the modified score, got {type(out).__name__}")
    if out.dtype != wanted:
        why = f" (the scores of {dtype} inputs)" if wanted != dtype else ""
        raise TypeError(f"score_mod must return a tensor of its score's dtype {wanted}{why}, got {out.dtype}")
    if out.shape != score.shape:
        raise ValueError(f"score_mod must return a tensor shaped like its score: it turned a score of shape "
                         f"{tuple(score.shape)} into {tuple(out.shape)}")


def alibi_slopes(n_head: int) -> Tensor:
    """ALiBi's slopes (Press et al., 2022): a geometric sequence from ``2^(-8/n)`` for n heads;
    for n not a power of two, the slopes of the closest smaller power of two, then every other
    slope of twice that many heads. ``(n_head,)`` float32."""
    _validate.positive_int("n_head", n_head)
    def power_of_two(n: int) -> list[float]:
        start = 2 ** (-8 / n)
        return [start ** (i + 1) for i in range(n)]
    closest = 2 ** math.floor(math.log2(n_head))
    slopes = power_of_two(closest)
    if closest < n_head:
        slopes += power_of_two(2 * closest)[0::2][:n_head - closest]
    return torch.tensor(slopes, dtype=torch.float32)
