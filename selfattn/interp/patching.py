"""Activation patching: a clean run's activations put into a corrupted run, one site at a time, many patches a forward.

Each patch replaces, in the corrupted run, the activation at one site of layer l (``blocks.{l}.attn.hook_z``, ...)
on some positions and heads by the clean run's, and reads a metric of the logits. The corrupted prompt runs once,
its residual stream kept at each layer's entry (``hook_resid_pre``); the patches of layer l are rows of one batch
that starts from that residual (the layers below are not recomputed, they are the same in every row), each row
with its own patch, through layers l .. L-1 and the head. A patch is a mask over the site's positions and heads:
the row takes the clean value where the mask is true.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor

from selfattn.interp.sites import _gpt, _installed, run_with_cache


@dataclass(frozen=True)
class Site:
    """Where a short site name lives in each block, and which axes of its tensor (batch first) are the positions
    and the heads (None: it has no heads)."""
    hook: str
    positions: int
    heads: int | None

    def name(self, layer: int) -> str:
        return f"blocks.{layer}.{self.hook}"


SITES = {  # short name -> its site; k and v by KV head (grouped-query models have fewer)
    "resid_pre": Site("hook_resid_pre", 1, None),  # (B, T, C)
    "resid_mid": Site("hook_resid_mid", 1, None),
    "resid_post": Site("hook_resid_post", 1, None),
    "attn_out": Site("hook_attn_out", 1, None),
    "mlp_out": Site("hook_mlp_out", 1, None),
    "z": Site("attn.hook_z", 1, 2),  # (B, T, H, D)
    "result": Site("attn.hook_result", 1, 2),  # (B, T, H, C)
    "q": Site("attn.hook_q", 1, 2),  # (B, T, H, D)
    "k": Site("attn.hook_k", 1, 2),  # (B, T, Hkv, D)
    "v": Site("attn.hook_v", 1, 2),  # (B, T, Hkv, D)
    "pattern": Site("attn.hook_pattern", 2, 1),  # (B, H, T, S): the positions are the queries'
}
BY = ("layer", "position", "head", "head,position")  # -> (L,), (L, T), (L, H), (L, T, H)


def site_of(site, by) -> Site:
    """The :class:`Site` of a short name, checked with ``by``; ValueError naming a bad one."""
    if site not in SITES:
        raise ValueError(f"site must be one of {', '.join(SITES)}, got {site!r}")
    if by not in BY:
        raise ValueError(f"by must be one of {', '.join(map(repr, BY))}, got {by!r}")
    if "head" in by and SITES[site].heads is None:
        raise ValueError(f"site {site!r} has no heads: patch it by='position' or by='layer', not by={by!r}")
    return SITES[site]


def masks(by: str, T: int, n: int, device=None) -> tuple[Tensor, tuple[int, ...]]:
    """The patches of one layer as masks ``(P, T, n)`` over its positions and ``n`` heads (1 without heads),
    and the shape their values take: ``()``, ``(T,)``, ``(n,)`` or ``(T, n)`` (position-major)."""
    if by == "layer":
        return torch.ones(1, T, n, dtype=torch.bool, device=device), ()
    eye_t, eye_n = torch.eye(T, dtype=torch.bool, device=device), torch.eye(n, dtype=torch.bool, device=device)
    if by == "position":
        return eye_t[:, :, None].expand(T, T, n), (T,)
    if by == "head":
        return eye_n[:, None, :].expand(n, T, n), (n,)
    return (eye_t[:, None, :, None] & eye_n[None, :, None, :]).reshape(T * n, T, n), (T, n)


def laid_out(grid: Tensor, site: Site, ndim: int) -> Tensor:
    """Masks ``(P, T, n)`` in the layout of the site's tensor of ``ndim`` axes: ``(P, 1, ...)``, T on its position
    axis, n on its head axis, 1 elsewhere; it broadcasts against the rows ``(P, B, ...)``."""
    P, T, n = grid.shape
    shape = [P, 1] + [1] * (ndim - 1)
    shape[1 + site.positions] = T
    if site.heads is not None:
        shape[1 + site.heads] = n
        if site.heads < site.positions:
            grid = grid.transpose(1, 2)  # (P, n, T)
    return grid.reshape(shape)


class _Swap:
    """A tap that puts ``fn(x)`` in place of the site ``name``, after an outer tap (the user's hooks)."""

    def __init__(self, name: str, fn: Callable[[Tensor], Tensor], outer):
        self.name, self.fn, self.outer = name, fn, outer

    def asks(self, name: str) -> bool:
        return name == self.name or (self.outer is not None and self.outer.asks(name))

    def __call__(self, name: str, x: Tensor) -> Tensor:
        if self.outer is not None:
            x = self.outer(name, x)
        return self.fn(x) if name == self.name else x


def metric_values(metric, logits: Tensor) -> Tensor:
    """``metric(logits)`` for logits ``(P, B, T, V)``, checked to be ``(P,)``."""
    out = metric(logits)
    P = logits.shape[0]
    if not isinstance(out, Tensor) or out.shape != (P,):
        got = tuple(out.shape) if isinstance(out, Tensor) else type(out).__name__
        raise ValueError(f"metric must map logits (P, B, T, V) = {tuple(logits.shape)} to one value a patch, "
                         f"shape ({P},), got {got}: write it over the leading axes (logits[..., -1, a], a mean over "
                         f"axis -1 for the batch), as selfattn.interp.logit_diff does")
    return out


def clean_sites(cache, names: list[str], corrupt: dict[str, Tensor], site: Site) -> list[Tensor]:
    """The clean run's tensors at ``names``, checked against the corrupted run's (lengths named)."""
    if not isinstance(cache, dict):
        raise TypeError(f"clean_cache must be the dict of run_with_cache(model, clean_ids), got {type(cache).__name__}")
    missing = [n for n in names if n not in cache and n in corrupt]
    if missing:
        raise ValueError(f"clean_cache holds no {missing[0]!r}: run run_with_cache on the clean prompt with names "
                         f"that include every layer's (or names=None)")
    out = []
    for name in names:
        if name not in corrupt:
            raise ValueError(f"this model has no site {name!r} (selfattn.interp.sites(model) lists them)")
        clean, ours = cache[name], corrupt[name]
        T_clean, T = clean.shape[site.positions], ours.shape[site.positions]
        if T_clean != T:
            raise ValueError(f"the clean prompt has {T_clean} positions and the corrupted one {T}: patching needs "
                             f"prompts of one length")
        if clean.shape != ours.shape:
            raise ValueError(f"clean_cache[{name!r}] has shape {tuple(clean.shape)}, the corrupted run's "
                             f"{tuple(ours.shape)}: one batch of prompts of one length, from this model")
        out.append(clean.to(device=ours.device, dtype=ours.dtype))
    return out


def _per_forward(batch_size, rows: int, T: int, width: int) -> int:
    if batch_size is None:  # the logits of a forward, (P·B, T, V), at most 2**26 values
        return max(1, 2 ** 26 // (rows * T * width))
    if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
        raise ValueError(f"batch_size must be a positive int (patches a forward) or None, got {batch_size!r}")
    return batch_size


def patched(model, layer: int, resid: Tensor, clean: Tensor, where: Tensor, site: Site, *, stop=None) -> Tensor:
    """Rows ``(P·B, T, C)`` from ``resid`` ``(B, T, C)`` entering block ``layer``, each of the P patches ``where``
    ``(P, 1, ...)`` taking ``clean`` at the site: the final hidden states (or the residual after block ``stop - 1``)."""
    P, (B, T, C) = where.shape[0], resid.shape

    def swap(x: Tensor) -> Tensor:  # (P·B, ...)
        return torch.where(where, clean, x.unflatten(0, (P, B))).flatten(0, 1)

    rows = resid.expand(P, B, T, C).reshape(P * B, T, C)  # (P·B, T, C)
    with _installed(model, _Swap(site.name(layer), swap, model.tap)):
        return model.hidden(None, None, None, 0, start=layer, stop=stop, x=rows)


@torch.no_grad()
def patch(model, corrupt_ids: Tensor, clean_cache: dict, metric, *, site: str, by: str = "position",
          batch_size: int | None = None) -> Tensor:
    """Activation patching: the metric of the corrupted run with each patch of the clean run's activations.

    Args:
        model: a :class:`~selfattn.model.GPT` (in eval mode: dropout would make each row differ).
        corrupt_ids: ``(B, T)`` the corrupted prompts.
        clean_cache: from :func:`~selfattn.interp.run_with_cache` on the clean prompts ``(B, T)``, holding
            the site at every layer.
        metric: logits ``(P, B, T, V)`` (P patches, each the whole batch) -> ``(P,)``; one written over the
            leading axes serves a plain run ``(B, T, V) -> ()`` too, as :func:`logit_diff` does.
        site: ``resid_pre``, ``resid_mid``, ``resid_post``, ``attn_out``, ``mlp_out`` (positions), ``z``,
            ``result``, ``q``, ``k``, ``v`` (positions and heads; k and v by KV head), ``pattern`` (query
            positions and heads, every key).
        by: ``"layer"`` (every position and head at once), ``"position"`` (every head), ``"head"`` (every
            position) or ``"head,position"`` (one of each).
        batch_size: patches a forward (each B rows); None: as many as keep the logits within 2**26 values.

    Returns:
        the metric ``(L,)``, ``(L, T)``, ``(L, H)`` or ``(L, T, H)`` by ``by`` (H the site's heads: Hkv for k, v).
    """
    model, spec = _gpt(model), site_of(site, by)
    model.check_idx(corrupt_ids)
    B, T = corrupt_ids.shape
    L = len(model.blocks)
    starts, names = [f"blocks.{i}.hook_resid_pre" for i in range(L)], [spec.name(i) for i in range(L)]
    _, corrupt = run_with_cache(model, corrupt_ids, names=set(starts + names).__contains__)  # no dry run
    clean = clean_sites(clean_cache, names, corrupt, spec)
    n = 1 if spec.heads is None else clean[0].shape[spec.heads]
    grid, shape = masks(by, T, n, corrupt_ids.device)
    per = _per_forward(batch_size, B, T, max(model.config.vocab_size, model.config.n_embd))
    out = []
    for layer in range(L):
        values = []
        for chunk in grid.split(per):
            h = patched(model, layer, corrupt[starts[layer]], clean[layer],
                        laid_out(chunk, spec, clean[layer].dim()), spec)
            values.append(metric_values(metric, model.logits(h).unflatten(0, (chunk.shape[0], B))))
        out.append(torch.cat(values).reshape(shape))
    return torch.stack(out)


def logit_diff(answer, wrong, position: int = -1) -> Callable[[Tensor], Tensor]:
    """A metric: ``logit[answer] - logit[wrong]`` at ``position``, averaged over the batch.

    answer, wrong: token ids, an int or ``(B,)`` (one a prompt).
    Returns ``metric(logits (..., B, T, V)) -> (...)``: ``(P,)`` for :func:`patch`, a scalar for a plain run.
    """
    for ids in (answer, wrong):
        t = torch.as_tensor(ids)
        if t.is_floating_point() or t.dtype == torch.bool or t.dim() > 1:
            raise TypeError(f"answer and wrong must be a token id or a (B,) tensor of them, got {ids!r}")

    def metric(logits: Tensor) -> Tensor:
        at = logits[..., position, :]  # (..., B, V)

        def pick(ids) -> Tensor:
            ids = torch.as_tensor(ids, device=at.device).expand(at.shape[:-1])  # (..., B)
            return at.gather(-1, ids[..., None])[..., 0]
        return (pick(answer) - pick(wrong)).mean(-1)
    return metric
