"""Taps: named points of a forward where a tensor may be read or replaced, for tools above the model.

A tap is any object with ``tap(name, tensor) -> tensor`` (the tensor that flows on) and
``tap.asks(name) -> bool`` (whether it wants a site that costs something to compute, such as each
head's write or the explicit attention pattern). The model (:attr:`selfattn.model.GPT.tap`) calls it
at every site of a forward when one is set, and not at all when it is None, its default: the
unhooked model runs exactly its own code. The sites carry TransformerLens's names
(``blocks.3.attn.hook_z``); :mod:`selfattn.interp` makes taps of hooks and caches.

The rule that keeps an observed forward exact: a tap that returns the very tensor it was given
changes nothing, and where the model computes a site only to show it (each head's write, the
attention scores and pattern beside a fused backend, a norm's scale) it goes on with its own
computation, so the output is bitwise what it is without a tap; a tap that returns another tensor
replaces the site, and the rest of the forward computes from it.
"""
from __future__ import annotations

from typing import Protocol

import torch
from torch import Tensor, nn


class Tap(Protocol):
    def __call__(self, name: str, x: Tensor) -> Tensor:
        """The tensor that flows on from the site ``name``: ``x`` itself, or a replacement."""

    def asks(self, name: str) -> bool:
        """Whether the site ``name`` is wanted (sites that cost work are computed only then)."""


def site(tap: Tap | None, name: str, x: Tensor) -> Tensor:
    """``x`` at the site ``name``: what ``tap`` makes of it, or ``x`` itself without a tap."""
    return x if tap is None else tap(name, x)


class _Scoped:
    """A tap seen from inside a module: its names relative to ``prefix`` (``blocks.3.attn.``)."""

    def __init__(self, tap: Tap, prefix: str):
        self.tap, self.prefix = tap, prefix

    def __call__(self, name: str, x: Tensor) -> Tensor:
        return self.tap(self.prefix + name, x)

    def asks(self, name: str) -> bool:
        return self.tap.asks(self.prefix + name)


def scoped(tap: Tap | None, prefix: str) -> Tap | None:
    """``tap`` with every name prefixed by ``prefix``; None without a tap."""
    return None if tap is None else _Scoped(tap, prefix)


def affine(norm: nn.Module) -> tuple[bool, Tensor | None, Tensor | None]:
    """What a norm does around its division by the scale, as data: ``(centres, weight, bias)``.
    LayerNorm: ``(x - mean) / scale * weight + bias``; RMSNorm: ``x / scale * (offset + weight)``.
    A weight or bias that is absent is None."""
    if isinstance(norm, nn.LayerNorm):
        return True, norm.weight, norm.bias
    return False, norm.weight + norm.offset if norm.offset else norm.weight, None


_NORM_SITES = ("hook_in", "hook_scale", "hook_normalized")


def normed(norm: nn.Module, x: Tensor, tap: Tap | None) -> Tensor:
    """``norm(x)``, with the sites ``hook_in`` (x), ``hook_scale`` ``(..., 1)`` (the divisor ``sqrt(mean(x'²) + eps)``
    of the centred (LayerNorm) or plain (RMSNorm) input x', in float32 at least) and
    ``hook_normalized`` (``x' / scale``, before the weight and bias) under a tap that asks for any of
    them (they cost a second pass over x). An identity norm has no sites. A replaced scale or
    normalized input flows on through the weight and bias."""
    if tap is None or isinstance(norm, nn.Identity) or not any(map(tap.asks, _NORM_SITES)):
        return norm(x)
    centres, weight, bias = affine(norm)
    x = tap("hook_in", x)
    work = x.to(torch.promote_types(x.dtype, torch.float32))  # (..., C)
    if centres:
        work = work - work.mean(dim=-1, keepdim=True)
    scale = (work.pow(2).mean(dim=-1, keepdim=True) + norm.eps).sqrt()  # (..., 1)
    shown = tap("hook_scale", scale)
    normalized = work / shown
    seen = tap("hook_normalized", normalized)
    if shown is scale and seen is normalized:
        return norm(x)  # nothing replaced: the norm's own kernel, bitwise
    out = seen * weight.to(seen.dtype) if weight is not None else seen
    return (out if bias is None else out + bias.to(out.dtype)).to(x.dtype)
