"""Fine-tuning's starting point: a model :func:`~selfattn.io.loading.load` reads, with the config
fields the flags change (attention surgery) and its weights carried into the new shape.

Any field that changes no parameter shape is set as it is: a sliding window, sink tokens, ALiBi,
soft-capping, a RoPE base, dropout, the backend. The weights then compute the changed attention
from the first step, and fine-tuning adapts them to it. One shape change is carried over:

- fewer key/value heads (``n_kv_head`` a divisor of the source's): each new head is the mean of the
  group of heads it replaces, its key and value rows (and biases, and a k-norm over the whole
  projection) averaged, as the GQA paper (Ainslie et al., 2023) converts multi-head checkpoints.

Any other shape change (a width, a vocabulary, a layer count) is refused, naming the tensors the
source's weights cannot fill.
"""
from __future__ import annotations

import dataclasses

import torch
from torch import Tensor

from selfattn.config import GPTConfig
from selfattn.io.loading import Loaded, load
from selfattn.model import GPT


def source(path: str) -> Loaded:
    """The model ``--init-from`` names, with its tokenizer; a ValueError naming the flag otherwise."""
    try:
        loaded = load(path)
        loaded.require_tokenizer()
    except ValueError as e:
        raise ValueError(f"--init-from: {e}") from None
    return loaded


def changed_config(model: GPT, fields: dict, path: str) -> GPTConfig:
    """The config of ``model`` (read from ``path``) with ``fields`` set, refused (a ValueError naming
    the flag) when the model cannot take them or its weights cannot fill the shapes they make."""
    try:
        config = dataclasses.replace(model.config, **fields)
        _check_binds(config, fields)
        with torch.device("meta"):  # shapes only, nothing allocated
            target = GPT(config)
    except (TypeError, ValueError) as e:
        raise ValueError(f"--init-from {path}: the model cannot take {_listed(fields)}: {e}") from None
    _check_fits(target, model, path)
    return config


def _check_binds(config: GPTConfig, fields: dict) -> None:
    """Refuse a window or sink tokens set to a value that would change nothing (a surgery that
    silently does nothing is a mistake): a window not shorter than ``block_size``, sink tokens
    without a window, or as many as the window holds."""
    window, sinks = config.window, config.sink_tokens
    if "window" in fields and window is not None and window >= config.block_size:
        raise ValueError(f"window={window} is not shorter than block_size={config.block_size}: it would never bind")
    if "sink_tokens" in fields and sinks is not None and (window is None or sinks >= window):
        raise ValueError(f"sink_tokens={sinks} keeps the first tokens visible past a sliding window, "
                         f"which needs a window longer than them (window={window})")


def start_from(loaded: Loaded, config: GPTConfig, path: str) -> GPT:
    """A model of ``config`` (from :func:`changed_config`) holding ``loaded``'s weights, fewer
    key/value heads mean-pooled."""
    model = GPT.empty(config)
    _check_fits(model, loaded.model, path)
    model.load_state_dict(_carried(loaded.model, model), strict=True)
    return model


def _carried(source: GPT, target: GPT) -> dict[str, Tensor]:
    """``source``'s state dict in ``target``'s shapes: the key/value heads pooled where ``target``
    has fewer, every other tensor as it is."""
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


def _check_fits(model: GPT, source: GPT, path: str) -> None:
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
        raise ValueError(f"--init-from {path}: the flags change the model's shape, which its weights cannot fill: "
                         + "; ".join(wrong[:4]) + (f" and {len(wrong) - 4} more" if len(wrong) > 4 else ""))


def _listed(fields: dict) -> str:
    return ", ".join(f"{k}={v!r}" for k, v in fields.items())
