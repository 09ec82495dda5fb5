"""A loaded model's weights carried into a changed config (attention surgery before fine-tuning).

Any field that changes no parameter shape takes the weights as they are (a window, sink tokens,
ALiBi, soft-capping, a RoPE base). One shape change is carried over: fewer key/value heads
(``n_kv_head`` a divisor of the source's), each new head the mean of the group of heads it replaces,
its key and value rows (and biases, and a k-norm over the whole projection) averaged, as the GQA
paper (Ainslie et al., 2023) converts multi-head checkpoints. Any other shape change is refused,
naming the tensors the weights cannot fill.
"""
from __future__ import annotations

import torch
from torch import Tensor

from selfattn.model import GPT


def carried(source: GPT, target: GPT) -> dict[str, Tensor]:
    """``source``'s state dict in ``target``'s shapes: the key/value heads pooled where ``target``
    has fewer, every other tensor as it is; a ValueError (:func:`check_fits`) for any other shape."""
    check_fits(target, source)
    state = source.state_dict()
    for i, (theirs, ours) in enumerate(zip(source.blocks, target.blocks)):
        group = theirs.attn.n_kv_head // ours.attn.n_kv_head
        if group == 1:
            continue
        H, D = theirs.attn.n_head, theirs.attn.head_dim
        for name in ("weight", "bias"):
            key = f"blocks.{i}.attn.qkv.{name}"
            if key in state:
                q, kv = state[key].split([H * D, state[key].shape[0] - H * D])  # (H·D, ...), (2·Hkv·D, ...)
                state[key] = torch.cat([q, _pooled(kv, group, D)])
        key = f"blocks.{i}.attn.k_norm.weight"
        if key in state and state[key].shape[0] != D:  # a k-norm over the whole projection: one gain per channel
            state[key] = _pooled(state[key], group, D)
    return state


def _pooled(rows: Tensor, group: int, D: int) -> Tensor:
    """Rows of heads of D rows each, every ``group`` consecutive heads averaged into one (in float64)."""
    heads = rows.reshape(-1, group, D, *rows.shape[1:])  # (heads / group, group, D, ...)
    return heads.double().mean(dim=1).to(rows.dtype).flatten(0, 1)  # (heads / group · D, ...)


def check_fits(model: GPT, source: GPT) -> None:
    """Refuse a ``model`` whose tensors the weights of ``source`` cannot fill, naming them (fewer
    key/value heads, a divisor of the source's, are pooled: not a misfit)."""
    theirs, ours = source.state_dict(), model.state_dict()
    pooled = {f"blocks.{i}.attn.{name}" for i, (a, b) in enumerate(zip(source.blocks, model.blocks))
              if a.attn.n_kv_head != b.attn.n_kv_head and a.attn.n_kv_head % b.attn.n_kv_head == 0
              and a.attn.head_dim == b.attn.head_dim and a.attn.n_head == b.attn.n_head
              for name in ("qkv.weight", "qkv.bias", "k_norm.weight")}
    wrong = [f"{k} {tuple(ours[k].shape)} != {tuple(theirs[k].shape)}" for k in ours
             if k in theirs and k not in pooled and ours[k].shape != theirs[k].shape]
    wrong += [f"no {k}" for k in sorted(set(ours) - set(theirs))]
    if wrong:
        raise ValueError("the flags change the model's shape, which its weights cannot fill: "
                         + "; ".join(wrong[:4]) + (f" and {len(wrong) - 4} more" if len(wrong) > 4 else ""))
