"""Ablation: heads knocked out of a forward, to measure what the model does without them.

Inside ``with ablate(model, [(layer, head), ...]):`` each listed head's ``blocks.{layer}.attn.hook_z`` (its weighted
sum of values, ``(B, T, H, D)``) is replaced before the output projection: by zeros (the head writes nothing, its
share of the projection's bias aside), or with ``mean=`` by that head's mean over the batch and positions of a
reference run (the head writes what it writes on average, a constant). Every other head and site runs as it is.
It is :func:`~selfattn.interp.hooks` on the ``hook_z`` sites: it nests with other hooks and goes when the block ends.
"""
from __future__ import annotations

import contextlib
from collections.abc import Iterable, Iterator

import torch
from torch import Tensor

from selfattn.interp.sites import _gpt, hooks


def _heads(model, heads: Iterable) -> dict[int, list[int]]:
    """``{layer: [head, ...]}`` from pairs ``(layer, head)``, each checked against the model's layers and heads."""
    L, H = len(model.blocks), model.config.n_head
    by_layer: dict[int, list[int]] = {}
    for pair in heads:
        if (not isinstance(pair, (tuple, list)) or len(pair) != 2
                or not all(isinstance(i, int) and not isinstance(i, bool) for i in pair)):
            raise TypeError(f"heads must be pairs (layer, head) of ints, got {pair!r}")
        layer, head = pair
        if not (0 <= layer < L and 0 <= head < H):
            raise ValueError(f"head (layer {layer}, head {head}) out of range: the model has {L} layers "
                             f"(0..{L - 1}) of {H} heads (0..{H - 1})")
        by_layer.setdefault(layer, []).append(head)
    return by_layer


@contextlib.contextmanager
def ablate(model, heads: Iterable, *, mean: dict[str, Tensor] | None = None) -> Iterator[None]:
    """Run the block with ``heads`` ablated: their ``hook_z`` zero, or their mean over a reference run.

    heads: pairs ``(layer, head)`` (query heads); none ablates nothing.
    mean: None (zero ablation), or the cache of :func:`~selfattn.interp.run_with_cache` on reference prompts
        holding each ablated layer's ``blocks.{l}.attn.hook_z``: each head's z is then its mean over that run's
        batch and positions, ``(D,)``, the same at every position.
    """
    model = _gpt(model)
    by_layer = _heads(model, heads)
    names = {f"blocks.{layer}.attn.hook_z": picked for layer, picked in by_layer.items()}
    fill = {}
    for name in names:
        if mean is None:
            fill[name] = None
        elif not isinstance(mean, dict) or name not in mean:
            raise ValueError(f"mean must be the cache of run_with_cache on reference prompts holding {name!r} "
                             f"(names=lambda n: n.endswith('hook_z') keeps every layer's)")
        else:
            fill[name] = mean[name].mean(dim=(0, 1))  # (B, T, H, D) -> (H, D)

    def knock_out(z: Tensor, name: str) -> Tensor:  # z (B, T, H, D)
        picked = names[name]
        out = z.clone()
        if fill[name] is None:
            out[:, :, picked] = 0.0
        else:
            out[:, :, picked] = fill[name][picked].to(device=z.device, dtype=z.dtype)  # (k, D), every position
        return out

    with hooks(model, {name: knock_out for name in names}):
        yield


def random_heads(model, k: int, *, avoid: Iterable = (), generator: torch.Generator | None = None
                 ) -> list[tuple[int, int]]:
    """``k`` distinct heads ``(layer, head)`` drawn at random from the model's heads not in ``avoid``: a
    control for an ablation of chosen heads."""
    model = _gpt(model)
    avoid = {tuple(p) for p in _pairs(model, avoid)}
    pool = [(layer, head) for layer in range(len(model.blocks)) for head in range(model.config.n_head)
            if (layer, head) not in avoid]
    if isinstance(k, bool) or not isinstance(k, int) or not 0 <= k <= len(pool):
        raise ValueError(f"k must be an int in 0..{len(pool)} (the heads not avoided), got {k!r}")
    order = torch.randperm(len(pool), generator=generator)[:k]
    return [pool[i] for i in order.tolist()]


def _pairs(model, heads: Iterable) -> list[tuple[int, int]]:
    return [(layer, head) for layer, picked in _heads(model, heads).items() for head in picked]
