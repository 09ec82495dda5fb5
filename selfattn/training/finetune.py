"""Fine-tuning's starting point: a model :func:`~selfattn.io.loading.load` reads, with the config
fields the flags change (attention surgery: a window, sink tokens, fewer key/value heads, ...) and its
weights carried into the new shape (:mod:`selfattn.io.carry`). A change the model cannot take, or
one that would do nothing (a window that never binds), is refused naming the flag.
"""
from __future__ import annotations

import dataclasses

import torch

from selfattn.config import GPTConfig
from selfattn.io import carry
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
    try:
        carry.check_fits(target, model)
    except ValueError as e:
        raise ValueError(f"--init-from {path}: {e}") from None
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
    try:
        model.load_state_dict(carry.carried(loaded.model, model), strict=True)
    except ValueError as e:
        raise ValueError(f"--init-from {path}: {e}") from None
    return model


def _listed(fields: dict) -> str:
    return ", ".join(f"{k}={v!r}" for k, v in fields.items())
