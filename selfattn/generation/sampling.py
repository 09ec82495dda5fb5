"""Choosing the next token from logits (temperature, top-k, top-p, greedy).

The filters are pure functions over logits ``(..., V)``: they return new logits with the
excluded tokens set to ``-inf`` and never touch the ones they keep, so each is testable
exactly on a hand-made distribution. :func:`next_token` chains them in the usual order
(temperature, then top-k, then top-p, as in Hugging Face ``transformers``) and draws.
"""
from __future__ import annotations

import math
import numbers

import torch
from torch import Tensor

from selfattn.backends._common import half


def top_k_filter(logits: Tensor, k: int) -> Tensor:
    """Keep the ``k`` largest logits of each row (all tokens tied with the k-th are kept);
    ``k >= V`` keeps everything."""
    if k >= logits.shape[-1]:
        return logits
    kth = torch.topk(logits, k, dim=-1).values[..., -1:]  # (..., 1) the k-th largest logit
    return logits.masked_fill(logits < kth, float("-inf"))


def top_p_filter(logits: Tensor, p: float) -> Tensor:
    """Nucleus filter: keep the smallest set of most probable tokens whose probability sums
    to at least ``p``. A token is dropped when the tokens ranked above it already hold ``p``
    of the mass, so the most probable token is always kept and ``p = 1`` keeps everything."""
    if p >= 1.0:
        return logits
    sorted_logits, order = torch.sort(logits, dim=-1, descending=True)  # (..., V)
    probs = torch.softmax(sorted_logits.float(), dim=-1)  # (..., V) in float32 at least
    mass_above = probs.cumsum(dim=-1) - probs  # (..., V) probability of the tokens ranked above
    drop = torch.empty_like(mass_above, dtype=torch.bool).scatter_(-1, order, mass_above >= p)  # (..., V)
    return logits.masked_fill(drop, float("-inf"))


def next_token(logits: Tensor, *, temperature: float = 1.0, top_k: int | None = None,
               top_p: float | None = None, generator: torch.Generator | None = None) -> Tensor:
    """One token per row of ``logits`` ``(B, V)``: ``(B,)`` int64.

    ``temperature == 0`` is greedy (argmax, the first of tied maxima; top-k and top-p are
    irrelevant then). Otherwise the logits are divided by the temperature, filtered, and one
    token is drawn with ``torch.multinomial`` using ``generator`` (reproducible draws).
    """
    if temperature == 0:
        return greedy(logits)
    probs = probabilities(logits, temperature=temperature, top_k=top_k, top_p=top_p)  # (B, V)
    return torch.multinomial(probs, 1, generator=generator).squeeze(-1)  # (B,)


def greedy(logits: Tensor) -> Tensor:
    """The argmax over the last dim of ``logits`` (..., V), the first of tied maxima: ``(...)``
    int64. Half-precision logits are compared in float32 (exact, the same index): PyTorch's CPU
    argmax of them is slower than the cast and a float32 argmax (``docs/benchmarks.md``,
    "Measurements the code cites")."""
    return (logits.float() if half(logits.dtype) else logits).argmax(dim=-1)


def probabilities(logits: Tensor, *, temperature: float, top_k: int | None = None,
                  top_p: float | None = None) -> Tensor:
    """The distribution :func:`next_token` draws from, ``(..., V)`` in float32 at least: the
    logits divided by ``temperature`` (> 0), filtered by ``top_k`` then ``top_p``, softmaxed.
    Speculative sampling compares the target's and the draft's through it."""
    logits = logits.float() / temperature  # (..., V)
    if top_k is not None:
        logits = top_k_filter(logits, top_k)
    if top_p is not None:
        logits = top_p_filter(logits, top_p)
    return torch.softmax(logits, dim=-1)  # (..., V)


def check_sampling(temperature, top_k, top_p, *, flags: bool = False) -> None:
    """Validate sampling options once, before generation starts; errors name the value, and with
    ``flags`` the command's flags (``--top-p``) rather than the arguments (``top_p``)."""
    def name(arg: str) -> str:
        return "--" + arg.replace("_", "-") if flags else arg
    unset = "unset" if flags else "None"
    if (not isinstance(temperature, numbers.Real) or isinstance(temperature, bool) or not math.isfinite(temperature)
            or temperature < 0):
        raise ValueError(f"{name('temperature')} must be a finite number >= 0 (0 = greedy), got {temperature!r}")
    if top_k is not None and (not isinstance(top_k, int) or isinstance(top_k, bool) or top_k <= 0):
        raise ValueError(f"{name('top_k')} must be a positive int or {unset}, got {top_k!r}")
    if top_p is not None and (not isinstance(top_p, numbers.Real) or isinstance(top_p, bool)
                              or not 0.0 < top_p <= 1.0):
        raise ValueError(f"{name('top_p')} must be in (0, 1] or {unset}, got {top_p!r}")
