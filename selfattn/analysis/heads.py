"""Look inside the heads: capture attention maps, score head roles, plot them.

``capture(model, layers)`` records the attention weights of chosen ``SelfAttention`` layers
during an ordinary forward pass. Only the captured layers switch to the ``math`` backend
(the one that can return weights), and only for the duration of the ``with`` block.

The scores take stacked maps ``att`` of shape ``(L, B, H, T, T)`` (L captured layers, a full
causal forward without a cache, so S = T) and return one number per head, ``(L, H)``,
averaged over the batch. Query 0 can see only itself, so every head has the same weight
there; the row-wise scores leave it out and average over queries ``i = 1 .. T-1``.

============================  =====================================================
score                         formula (w = att[l, b, h], averaged over b and the rows)
============================  =====================================================
previous-token                w[i, i-1]
first-token (attention sink)  w[i, 0]
duplicate-token               sum of w[i, j] over j < i with tok[j] == tok[i]
induction                     sum of w[i, j+1] over j+1 < i with tok[j] == tok[i]
mean attention distance       sum_j w[i, j] * (i - j), in positions
entropy                       -sum_j w[i, j] * ln w[i, j], in nats (uniform over the
                              i+1 visible keys gives ln(i+1))
============================  =====================================================

Duplicate-token and induction average only over the queries that have at least one such
key (a query whose token is new has nothing to attend to). On a sequence of L distinct
random tokens repeated twice, the induction score is the mean of ``w[i, i-L+1]`` over the
second copy. A sequence without such a query leaves the score undefined: the function raises,
and :func:`head_scores` gives NaN ("hello" has a duplicate token, the adjacent "ll", but no
induction target, which needs a token between the two copies).
"""
from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence

import torch
from torch import Tensor, nn

from selfattn._util import plot as _plot
from selfattn._util.validate import positive_ints
from selfattn.self_attention import SelfAttention

ROLES = ("previous-token", "induction", "duplicate-token", "first-token")
UNDEFINED = {"induction": "no token recurs with another token between its two copies",  # score -> when it is NaN
             "duplicate-token": "no token occurs twice"}


def attention_layers(model: nn.Module) -> list[SelfAttention]:
    """The ``SelfAttention`` modules of ``model`` in definition order (layer 0 first)."""
    if not isinstance(model, nn.Module):
        raise TypeError(f"expected an nn.Module, got {type(model).__name__}")
    return [m for m in model.modules() if isinstance(m, SelfAttention)]


@contextlib.contextmanager
def capture(model: nn.Module, layers: Sequence[int] | None = None,
            heads: Sequence[int] | None = None) -> Iterator[dict[int, Tensor]]:
    """Record attention weights during forward passes of ``model``.

    ``with capture(model, layers=[0, 1]) as maps: model(idx)`` fills ``maps[layer]`` with the
    weights ``(B, len(heads), T, S)`` of that layer's latest call (detached). ``layers``
    index :func:`attention_layers` (default: all); ``heads`` selects query heads (default:
    all). Only the captured layers run the ``math`` backend, and only inside the block;
    backends and hooks are restored on exit, also on exceptions. Outputs are unchanged
    (bitwise if the layer already used ``math``, else up to the backends' rounding; in
    training mode with dropout the backends draw different dropout masks).
    """
    modules = attention_layers(model)
    if not modules:
        raise ValueError(f"{type(model).__name__} contains no selfattn.SelfAttention layer to capture")
    layers = list(range(len(modules))) if layers is None else list(layers)
    bad = [i for i in layers if not isinstance(i, int) or not 0 <= i < len(modules)]
    if bad or not layers:
        raise ValueError(f"layers {bad or layers} out of range: the model has {len(modules)} attention layers "
                         f"(0..{len(modules) - 1})")
    maps: dict[int, Tensor] = {}
    saved, handles = [], []
    try:
        for i in dict.fromkeys(layers):
            module = modules[i]
            index = _head_index(heads, module.n_head)
            saved.append((module, module.backend))
            module.backend = "math"
            asked: dict[str, bool] = {}
            handles.append(module.register_forward_pre_hook(_ask_for_weights(asked), with_kwargs=True))
            handles.append(module.register_forward_hook(_record(maps, i, index, asked), with_kwargs=True))
        yield maps
    finally:
        for handle in handles:
            handle.remove()
        for module, backend in saved:
            module.backend = backend


def _head_index(heads: Sequence[int] | None, n_head: int) -> list[int] | None:
    if heads is None:
        return None
    heads = list(heads)
    bad = [h for h in heads if not isinstance(h, int) or not 0 <= h < n_head]
    if bad or not heads:
        raise ValueError(f"heads {bad or heads} out of range: the layer has {n_head} heads (0..{n_head - 1})")
    return heads


def _ask_for_weights(asked: dict[str, bool]):
    def hook(module, args, kwargs):
        asked["weights"] = bool(kwargs.get("return_weights", False))
        return args, {**kwargs, "return_weights": True}
    return hook


def _record(maps: dict[int, Tensor], layer: int, heads: list[int] | None, asked: dict[str, bool]):
    def hook(module, args, kwargs, output):
        y, weights = output
        weights = weights.detach()  # (B, H, T, S)
        maps[layer] = weights if heads is None else weights[:, heads]  # (B, len(heads), T, S)
        return output if asked["weights"] else y
    return hook


@torch.no_grad()
def attention_maps(model: nn.Module, idx: Tensor, layers: Sequence[int] | None = None) -> Tensor:
    """Run ``model(idx)`` once and return the weights of ``layers`` (default all), stacked
    ``(L, B, H, T, T)`` in float32: the input of the scores below."""
    n = len(attention_layers(model))
    layers = list(range(n)) if layers is None else list(layers)
    with capture(model, layers) as maps:
        model(idx)
    missing = [i for i in layers if i not in maps]
    if missing:
        raise ValueError(f"the forward pass of {type(model).__name__} never called attention layers {missing}")
    return torch.stack([maps[i].float() for i in layers])  # (L, B, H, T, T)


def repeated_tokens(vocab_size: int, length: int, batch: int = 1, *,
                    generator: torch.Generator | None = None) -> Tensor:
    """``batch`` rows of ``length`` distinct random tokens, each row repeated twice: ``(B, 2·length)``.

    Distinct tokens make every earlier occurrence unique, so the induction target of a query
    in the second copy is exactly one key.
    """
    positive_ints(vocab_size=vocab_size, length=length, batch=batch)
    if length > vocab_size:
        raise ValueError(f"length={length} distinct tokens need vocab_size >= length, got {vocab_size}")
    rows = [torch.randperm(vocab_size, generator=generator)[:length] for _ in range(batch)]
    half = torch.stack(rows)  # (B, length)
    return torch.cat([half, half], dim=1)  # (B, 2·length)


def previous_token_score(att: Tensor) -> Tensor:
    """Mean of ``w[i, i-1]`` over queries i >= 1: 1.0 for a head that always looks one back. ``(L, H)``."""
    rows = torch.diagonal(_check_att(att), offset=-1, dim1=-2, dim2=-1)  # (L, B, H, T-1)
    return rows.mean(dim=(1, 3))


def first_token_score(att: Tensor) -> Tensor:
    """Mean of ``w[i, 0]`` over queries i >= 1: the attention sink. ``(L, H)``."""
    return _check_att(att)[..., 1:, 0].mean(dim=(1, 3))


def mean_attention_distance(att: Tensor) -> Tensor:
    """Mean over queries i >= 1 of ``sum_j w[i, j] * (i - j)``, in positions. ``(L, H)``."""
    att = _check_att(att)
    T = att.shape[-1]
    pos = torch.arange(T, device=att.device, dtype=att.dtype)
    dist = (pos[:, None] - pos[None, :]).clamp(min=0)  # (T, T): i - j, and 0 where masked
    return (att * dist).sum(-1)[..., 1:].mean(dim=(1, 3))


def attention_entropy(att: Tensor) -> Tensor:
    """Mean over queries i >= 1 of ``-sum_j w[i, j] ln w[i, j]`` in nats (0 ln 0 = 0). ``(L, H)``."""
    att = _check_att(att)
    plogp = att * att.clamp(min=torch.finfo(att.dtype).tiny).log()  # (L, B, H, T, T); 0 where w = 0
    return -plogp.sum(-1)[..., 1:].mean(dim=(1, 3))


def duplicate_token_score(att: Tensor, tokens: Tensor) -> Tensor:
    """Weight on the earlier copies of the current token, ``sum_j w[i, j]`` over
    ``j < i, tok[j] == tok[i]``, averaged over the queries that have one. ``(L, H)``."""
    att = _check_att(att)
    return _masked_mass(att, _earlier_copies(tokens, att), "duplicate-token")


def induction_score(att: Tensor, tokens: Tensor) -> Tensor:
    """Weight on the tokens right after the earlier copies of the current token,
    ``sum_j w[i, j+1]`` over ``j + 1 < i, tok[j] == tok[i]``, averaged over the queries that
    have one. ``(L, H)``."""
    att = _check_att(att)
    return _masked_mass(att, _induction_targets(tokens, att), "induction")


def head_scores(att: Tensor, tokens: Tensor | None) -> dict[str, Tensor]:
    """Every score of this module, name -> ``(L, H)``: the roles of :data:`ROLES`, then
    ``mean-distance`` and ``entropy``. With ``tokens=None`` the two scores that need the
    tokens (induction, duplicate-token) are left out; one that ``tokens`` leave undefined (no
    query has a target) is NaN."""
    scores = {"previous-token": previous_token_score(att)}
    if tokens is not None:
        att = _check_att(att)
        scores |= {name: _masked_mass(att, targets(tokens, att), name, undefined=float("nan")) for name, targets in
                   (("induction", _induction_targets), ("duplicate-token", _earlier_copies))}
    return scores | {"first-token": first_token_score(att), "mean-distance": mean_attention_distance(att),
                     "entropy": attention_entropy(att)}


def rank_heads(scores: dict[str, Tensor], top: int = 3) -> list[tuple[str, list[tuple[int, int, float]]]]:
    """For each role in :data:`ROLES` present in ``scores``, its ``top`` heads, best first,
    as ``(layer, head, score)``; none for a role that is undefined (NaN)."""
    ranked = []
    for role in ROLES:
        if role in scores:
            s = scores[role].nan_to_num(nan=float("-inf"))  # (L, H)
            order = s.flatten().argsort(descending=True, stable=True)[:top]
            ranked.append((role, [(int(k) // s.shape[1], int(k) % s.shape[1], float(s.flatten()[k]))
                                  for k in order if not scores[role].flatten()[k].isnan()]))
    return ranked


def plot_attention_grid(att: Tensor, path, *, labels: Sequence[str] | None = None,
                        layers: Sequence[int] | None = None, heads: Sequence[int] | None = None,
                        title: str | None = None) -> None:
    """Save a PNG grid of attention maps, one row per layer and one column per head.

    ``att`` is ``(L, H, T, S)`` (one batch row). ``labels`` names the S key tokens (the
    queries are the last T) and is drawn on the axes when S <= 32; ``layers``/``heads`` are
    the original indices, for the titles.
    """
    if att.dim() != 4:
        raise ValueError(f"plot_attention_grid expects att of shape (L, H, T, S), got {tuple(att.shape)}")
    L, H, T, S = att.shape
    layers = list(range(L)) if layers is None else list(layers)
    heads = list(range(H)) if heads is None else list(heads)
    if len(layers) != L or len(heads) != H:
        raise ValueError(f"{len(layers)} layer and {len(heads)} head labels for att of shape {tuple(att.shape)}")
    if labels is not None and len(labels) != S:
        raise ValueError(f"{len(labels)} token labels for {S} positions")
    size = 2.6 if labels is None or S > 32 else max(2.6, 0.22 * S + 1.2)
    fig = _plot.figure(figsize=(size * H, size * L))
    axes = fig.subplots(L, H, squeeze=False)
    for r in range(L):
        for c in range(H):
            ax = axes[r][c]
            ax.imshow(att[r, c].detach().float().cpu().numpy(), cmap="viridis", vmin=0.0, vmax=1.0)
            ax.set_title(f"layer {layers[r]} head {heads[c]}", fontsize=9)
            if labels is not None and S <= 32:
                ax.set_xticks(range(S), labels[:S], rotation=90, fontsize=6)
                ax.set_yticks(range(T), labels[S - T:], fontsize=6)
            else:
                ax.set_xlabel("key", fontsize=7)
                ax.set_ylabel("query", fontsize=7)
                ax.tick_params(labelsize=6)
                for axis in (ax.xaxis, ax.yaxis):
                    axis.get_major_locator().set_params(integer=True)
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    _plot.save(fig, path, dpi=100)


def _check_att(att: Tensor) -> Tensor:
    if not isinstance(att, Tensor):
        raise TypeError(f"att must be a tensor, got {type(att).__name__}")
    if att.dim() != 5 or att.shape[-1] != att.shape[-2]:
        raise ValueError(f"att must be stacked maps (L, B, H, T, T) of a forward without cache, "
                         f"got shape {tuple(att.shape)}")
    if att.shape[-1] < 2:
        raise ValueError(f"head scores need T >= 2 positions, got T={att.shape[-1]}")
    return att.float()


def _earlier_copies(tokens: Tensor, att: Tensor) -> Tensor:
    if not isinstance(tokens, Tensor) or tokens.is_floating_point() or tokens.dtype == torch.bool:
        raise TypeError(f"tokens must be an integer tensor (B, T), got {getattr(tokens, 'dtype', type(tokens))}")
    B, T = att.shape[1], att.shape[-1]
    if tokens.shape != (B, T):
        raise ValueError(f"tokens must have shape (B={B}, T={T}) to match att {tuple(att.shape)}, "
                         f"got {tuple(tokens.shape)}")
    tokens = tokens.to(att.device)
    same = tokens[:, :, None] == tokens[:, None, :]  # (B, T, T): [b, i, j] = tok[i] == tok[j]
    return same & torch.ones(T, T, dtype=torch.bool, device=att.device).tril(-1)  # j < i


def _induction_targets(tokens: Tensor, att: Tensor) -> Tensor:
    """(B, T, T): [b, i, j+1] = tok[j] == tok[i] and j + 1 < i, the key after an earlier copy."""
    copies = _earlier_copies(tokens, att)  # (B, T, T): [b, i, j] = j < i and tok[j] == tok[i]
    after = torch.zeros_like(copies)
    after[:, :, 1:] = copies[:, :, :-1]  # (B, T, T): [b, i, j+1] = copies[b, i, j]
    T = att.shape[-1]
    return after & torch.ones(T, T, dtype=torch.bool, device=att.device).tril(-1)  # j + 1 < i


def _masked_mass(att: Tensor, targets: Tensor, name: str, undefined: float | None = None) -> Tensor:
    """Mean over the (b, i) rows with any target of the weight on the targets ``(B, T, T)``. (L, H).
    Without any such row the score ``name`` is undefined: ``undefined`` everywhere, or a ValueError."""
    rows = targets.any(-1)  # (B, T)
    if not rows.any():
        if undefined is not None:
            return att.new_full((att.shape[0], att.shape[2]), undefined)
        raise ValueError(f"{UNDEFINED[name]} in `tokens`, so the {name} score is undefined; "
                         f"use a sequence with repeats, e.g. repeated_tokens()")
    mass = (att * targets[None, :, None]).sum(-1)  # (L, B, H, T)
    return (mass * rows[None, :, None]).sum(dim=(1, 3)) / rows.sum()
