"""Attribution patching (AtP): every patch of a site estimated at once, to first order, from one backward.

A patch moves the site's activation from the corrupted run's value a to the clean run's a'; to first order the
metric moves by ``grad · (a' - a)``, the gradient taken in the corrupted run (Nanda, "Attribution patching",
2023). One forward and one backward of the corrupted prompt give the gradient at every layer's site, one
forward of the clean prompt its values: the estimate of every patch of :func:`~selfattn.interp.patch` (less the
corrupted run's metric) for the cost of about three forwards.

Where attention saturates the first order fails for queries and keys: the softmax is flat where it is nearly
one-hot. The QK fix of AtP* (Kramár et al., 2024) computes the patched attention pattern exactly (the patched
layer's block alone, the patches batched as rows) and takes the first order from the pattern on:
``grad_pattern · (pattern' - pattern)``.
"""
from __future__ import annotations

import torch
from torch import Tensor

from selfattn.interp.patching import Site, laid_out, masks, metric_values, patched, site_of
from selfattn.interp.sites import _gpt, _installed, run_with_cache


class _Leaves:
    """A tap that adds a zero leaf requiring grad to each site of ``names`` (its gradient is the site's) and keeps
    the site's value; after an outer tap."""

    def __init__(self, names, outer):
        self.names, self.outer, self.values, self.leaves = set(names), outer, {}, {}

    def asks(self, name: str) -> bool:
        return name in self.names or (self.outer is not None and self.outer.asks(name))

    def __call__(self, name: str, x: Tensor) -> Tensor:
        if self.outer is not None:
            x = self.outer(name, x)
        if name not in self.names:
            return x
        self.values[name] = x.detach()
        self.leaves[name] = torch.zeros_like(x, requires_grad=True)
        return x + self.leaves[name]


def gradients(model, ids: Tensor, metric, names: list[str]) -> tuple[dict[str, Tensor], dict[str, Tensor]]:
    """The sites ``names`` of a forward of ``ids`` and the metric's gradient at each (zeros where none flows)."""
    leaves = _Leaves(names, model.tap)
    checkpointing, model.checkpointing = model.checkpointing, False  # a recomputed block would make new leaves
    try:
        with torch.enable_grad(), _installed(model, leaves):
            logits, _ = model(ids)
            value = metric_values(metric, logits[None])[0]
            grads = torch.autograd.grad(value, [leaves.leaves[n] for n in names], allow_unused=True)
    finally:
        model.checkpointing = checkpointing
    return leaves.values, {n: torch.zeros_like(leaves.values[n]) if g is None else g for n, g in zip(names, grads)}


def _grid(x: Tensor, site: Site) -> Tensor:
    """``x`` ``(B, ...)`` summed over every axis but the site's positions and heads: ``(T, n)``."""
    keep = [site.positions] + ([] if site.heads is None else [site.heads])
    summed = x.sum([d for d in range(x.dim()) if d not in keep])
    if site.heads is None:
        return summed[:, None]
    return summed if site.positions < site.heads else summed.T


def _by(grid: Tensor, by: str) -> Tensor:
    """The patches' values from a grid ``(T, n)`` of per-element values, shaped as :func:`patch` returns them."""
    return {"layer": lambda: grid.sum(), "position": lambda: grid.sum(1), "head": lambda: grid.sum(0),
            "head,position": lambda: grid}[by]()


class _Keep:
    """A tap that keeps the tensor at one site (and asks for it)."""

    def __init__(self, name: str, outer):
        self.name, self.outer, self.kept = name, outer, None

    def asks(self, name: str) -> bool:
        return name == self.name or (self.outer is not None and self.outer.asks(name))

    def __call__(self, name: str, x: Tensor) -> Tensor:
        if self.outer is not None:
            x = self.outer(name, x)
        if name == self.name:
            self.kept = x
        return x


@torch.no_grad()
def _qk_fixed(model, layer: int, by: str, site: Site, resid: Tensor, clean: Tensor, pattern: Tensor,
              grad: Tensor, batch_size: int) -> Tensor:
    """AtP*'s estimate of each patch of q or k at ``layer``: ``grad · (pattern' - pattern)`` summed, pattern' the
    exact pattern of the patched block (its rows batched), ``pattern`` and ``grad`` ``(B, H, T, S)``."""
    B, T, _ = resid.shape
    grid, shape = masks(by, T, clean.shape[site.heads], resid.device)
    keep, values = _Keep(f"blocks.{layer}.attn.hook_pattern", model.tap), []
    for chunk in grid.split(batch_size):
        with _installed(model, keep):
            patched(model, layer, resid, clean, laid_out(chunk, site, clean.dim()), site, stop=layer + 1)
        change = keep.kept.unflatten(0, (chunk.shape[0], B)) - pattern  # (P, B, H, T, S)
        values.append((change * grad).flatten(1).sum(1))
    return torch.cat(values).reshape(shape)


def attribution_patch(model, clean_ids: Tensor, corrupt_ids: Tensor, metric, *, site: str, by: str = "position",
                      qk_fix: bool = False, batch_size: int = 64) -> Tensor:
    """Attribution patching: the first-order estimate of each patch of :func:`~selfattn.interp.patch`.

    Args:
        model, metric, site, by: as :func:`~selfattn.interp.patch` (the metric sees logits ``(1, B, T, V)``).
        clean_ids, corrupt_ids: ``(B, T)`` the clean and corrupted prompts, of one length.
        qk_fix: for ``site="q"`` or ``"k"``, AtP*'s fix: the patched attention pattern computed exactly, the
            first order taken from it on (see the module docstring); ``batch_size`` patches a forward of a block.

    Returns:
        ``grad · (clean - corrupt)`` summed over each patch's elements and the batch, shaped as
        :func:`~selfattn.interp.patch` returns: the estimate of ``patch(...)`` minus the corrupted run's metric.
    """
    model, spec = _gpt(model), site_of(site, by)
    for ids in (clean_ids, corrupt_ids):
        model.check_idx(ids)
    if clean_ids.shape[1] != corrupt_ids.shape[1]:
        raise ValueError(f"the clean prompt has {clean_ids.shape[1]} positions and the corrupted one "
                         f"{corrupt_ids.shape[1]}: patching needs prompts of one length")
    if clean_ids.shape != corrupt_ids.shape:
        raise ValueError(f"clean_ids {tuple(clean_ids.shape)} and corrupt_ids {tuple(corrupt_ids.shape)} must be "
                         f"batches of one size")
    if qk_fix and site not in ("q", "k"):
        raise ValueError(f"qk_fix (AtP*) fixes the estimates of queries and keys: site 'q' or 'k', not {site!r}")
    L = len(model.blocks)
    names = [spec.name(i) for i in range(L)]
    extra = [f"blocks.{i}.{s}" for i in range(L) for s in ("hook_resid_pre", "attn.hook_pattern")] if qk_fix else []
    with torch.no_grad():
        _, clean = run_with_cache(model, clean_ids, names=set(names).__contains__)  # no dry run
    absent = [n for n in names if n not in clean]
    if absent:
        raise ValueError(f"this model has no site {absent[0]!r} (selfattn.interp.sites(model) lists them)")
    values, grads = gradients(model, corrupt_ids, metric, list(dict.fromkeys(names + extra)))
    out = []
    for i, name in enumerate(names):
        if qk_fix:
            pattern = f"blocks.{i}.attn.hook_pattern"
            out.append(_qk_fixed(model, i, by, spec, values[f"blocks.{i}.hook_resid_pre"], clean[name],
                                 values[pattern], grads[pattern], batch_size))
        else:
            out.append(_by(_grid(grads[name] * (clean[name] - values[name]), spec), by))
    return torch.stack(out)


def rank_correlation(a: Tensor, b: Tensor) -> float:
    """Spearman's rank correlation of two tensors of the same shape (ties ranked by their mean rank)."""
    if not (isinstance(a, Tensor) and isinstance(b, Tensor)) or a.shape != b.shape or a.numel() < 2:
        raise ValueError(f"rank_correlation needs two tensors of one shape with 2 or more values, got "
                         f"{getattr(a, 'shape', type(a).__name__)} and {getattr(b, 'shape', type(b).__name__)}")
    ra, rb = _ranks(a), _ranks(b)
    ra, rb = ra - ra.mean(), rb - rb.mean()
    return (ra @ rb / (ra.norm() * rb.norm())).item()


def _ranks(x: Tensor) -> Tensor:
    """1-based ranks of ``x``'s values, flattened, in float64; equal values share their mean rank."""
    x = x.detach().flatten().double()
    order = x.argsort()
    _, group, counts = torch.unique_consecutive(x[order], return_inverse=True, return_counts=True)
    mean_rank = counts.cumsum(0) - (counts - 1) / 2  # each group of equal values: the mean of its ranks
    ranks = torch.empty_like(x)
    ranks[order] = mean_rank[group].double()
    return ranks
