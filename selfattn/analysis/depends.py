"""What a model's prediction depends on: the "depends on" section of the attention page.

For the token the model predicts at the last position of an input, activation patching
(:func:`selfattn.interp.patch`) measures which heads and which input positions carry it: the input
is the clean run; a corrupted input of the same length (the user's, or by default the same tokens in
a shuffled order: their content kept, their arrangement gone) the run patched into. The metric is
the predicted token's logit at the last position; each patch is reported as the share of the gap
it restores, ``(patched - corrupt) / (clean - corrupt)`` (1: the whole clean logit back), for

- every head's output (``hook_z``, all positions at once): an ``(L, H)`` grid;
- every input position (the residual stream entering block 0, the token's embedding): ``(T,)``, one
  forward of T rows.

Patching costs forwards: about L·H/2 of the input for the heads and T for the positions; the page
computes it for inputs of at most :data:`MAX_TOKENS` tokens (longer ones say so).
"""
from __future__ import annotations

import torch
from torch import Tensor

from selfattn.interp import hooks, patch, run_with_cache
from selfattn.model import GPT

MAX_TOKENS = 32  # the longest input the page patches: a prompt (the sweeps cost L·H/2 + T forwards of it)
SHUFFLE_SEED = 0  # the default corruption's order


def shuffled(idx: Tensor) -> Tensor:
    """The default corruption: ``idx`` ``(T,)`` in an order drawn from :data:`SHUFFLE_SEED`."""
    order = torch.randperm(idx.shape[0], generator=torch.Generator().manual_seed(SHUFFLE_SEED))
    return idx[order]


@torch.no_grad()
def depends_on(model: GPT, idx: Tensor, corrupt: Tensor | None = None) -> dict:
    """What the prediction after ``idx`` ``(T,)`` depends on, against ``corrupt`` ``(T,)`` (None: :func:`shuffled`).

    Returns a dict: ``token`` (the predicted id), ``clean`` and ``corrupt`` (its logit on each run),
    ``corrupt_tokens``, ``heads`` ``[[share] * H] * L`` and ``positions`` ``[share] * T``; the shares are
    None when the corruption leaves the logit as it was (no gap to restore), and ``why`` says so.
    """
    corrupt = shuffled(idx) if corrupt is None else corrupt
    if corrupt.shape != idx.shape:
        raise ValueError(f"the corrupted input must be as long as the input, {idx.shape[0]} tokens; got "
                         f"{corrupt.shape[0]}")
    device = next(model.parameters()).device
    clean_ids, corrupt_ids = idx[None].to(device), corrupt[None].to(device)  # (1, T) each
    logits, cache = run_with_cache(model, clean_ids, names=lambda n: n.endswith(("hook_resid_pre", "attn.hook_z")))
    token = int(logits[0, -1].argmax())

    def metric(lg: Tensor) -> Tensor:  # (..., 1, T, V) -> (...): the predicted token's logit at the end
        return lg[..., 0, -1, token].float()

    clean, bad = float(metric(logits)), float(metric(model(corrupt_ids)[0]))
    gap = clean - bad
    heads = patch(model, corrupt_ids, cache, metric, site="z", by="head")  # (L, H)
    positions = _by_position(model, corrupt_ids, cache["blocks.0.hook_resid_pre"], token)  # (T,)
    out = {"token": token, "clean": round(clean, 4), "corrupt": round(bad, 4), "corrupt_tokens": corrupt.tolist(),
           "why": None}
    if abs(gap) < 1e-6 * max(1.0, abs(clean)):
        return {**out, "heads": None, "positions": None,
                "why": "the corrupted input leaves the predicted token's logit as it was: no gap to restore"}
    return {**out, "heads": _shares(heads, bad, gap), "positions": _shares(positions, bad, gap)}


def _by_position(model: GPT, corrupt_ids: Tensor, clean: Tensor, token: int) -> Tensor:
    """The predicted token's logit at the end of the corrupted run ``(1, T)`` with the residual entering block 0
    (``clean`` ``(1, T, C)``) patched at each one position: ``(T,)``, one forward of T rows."""
    T = corrupt_ids.shape[1]
    one = torch.eye(T, dtype=torch.bool, device=clean.device)[:, :, None]  # (T rows, T positions, 1)

    def swap(x: Tensor, _) -> Tensor:  # (T, T, C): row i takes the clean residual at position i
        return torch.where(one, clean, x)

    with hooks(model, {"blocks.0.hook_resid_pre": swap}):
        h = model.hidden(corrupt_ids.expand(T, T), None, None, 0)  # (T, T, C)
    return model.logits(h[:, -1])[:, token].float()  # the last position's logits only: (T,)


def _shares(values: Tensor, corrupt: float, gap: float) -> list:
    """``(values - corrupt) / gap`` as nested lists, to 4 decimals."""
    return ((values.double().cpu() - corrupt) / gap).mul(1e4).round().div(1e4).tolist()
