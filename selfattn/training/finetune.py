"""Fine-tuning's starting point: a model :func:`~selfattn.io.loading.load` reads, with the config
fields the flags change (attention surgery: a window, sink tokens, fewer key/value heads, ...) and its
weights carried into the new shape (:mod:`selfattn.io.carry`). A change the model cannot take, or
one that would do nothing (a window that never binds), is refused naming the flag.
"""
from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass
from pathlib import Path

import torch

from selfattn import lora
from selfattn.config import GPTConfig
from selfattn.io import carry
from selfattn.io.loading import Loaded, chat_of, load, special_of
from selfattn.model import GPT
from selfattn.tokenizers import BPETokenizer, ByteTokenizer, from_spec
from selfattn.tokenizers.chat import ChatTemplate


@dataclass
class Start:
    """What a fine-tuning run starts from."""
    model: GPT  # the source's weights in the run's config; for LoRA, with adapters (the base frozen)
    tokenizer: ByteTokenizer | BPETokenizer  # the source's own
    chat: ChatTemplate | None  # the source's chat template (None: it has none)
    meta: dict  # what every checkpoint keeps of the source: "special" (its special tokens), "lora" (settings, base)


class Source:
    """The model ``--init-from`` names, loaded once: :func:`~selfattn.training.resume.resolve_configs` reads
    its config, the run takes it (:meth:`take` hands it over once and forgets it, so that whoever still holds
    this keeps no weights alive while the run trains)."""

    def __init__(self, path: str):
        self.path = path
        self.loaded: Loaded | None = source(path)  # None once taken

    def take(self) -> Loaded:
        loaded, self.loaded = self.loaded, None
        if loaded is None:
            raise ValueError(f"the source {self.path!r} was taken already: a Source serves one run")
        return loaded


def begin(init_from: str, config: GPTConfig, adapters: dict | None, saved: dict | None,
          base: str | os.PathLike | None = None, given: Source | None = None) -> Start:
    """The model a run fine-tunes: the source ``init_from`` carried into ``config``, and for LoRA
    (``adapters``: :func:`selfattn.lora.add_lora`'s rank, alpha, dropout, mlp) adapters on it, drawn
    from the torch RNG. ``saved``: the meta of the checkpoint a run resumes from (None: a new run); a
    full fine-tune then takes every weight from the checkpoint and needs no source, a LoRA run loads
    its base again (from ``base`` when it moved there) and refuses one whose digest is not the one its
    adapters were trained on. ``given``: the source of ``init_from`` already loaded (a new run's), taken
    here; None: loaded here."""
    if base is not None and (saved is None or adapters is None):
        raise ValueError("--base gives a LoRA run's moved base model when it resumes: pass it with --resume, for a "
                         "run trained with --lora-rank")
    if saved is not None and adapters is None:
        special = saved.get("special")
        return Start(GPT(config), from_spec(saved["tokenizer"]), special and chat_of(special, init_from),
                     {"special": special})
    path = init_from if saved is None else str(base or saved["lora"]["base"]["path"])
    if saved is not None and not Path(path).exists():
        if base is not None:
            raise ValueError(f"--base {path!r} does not exist")
        raise ValueError(f"the base model of this LoRA run, {path!r}, does not exist (moved?); give its new place "
                         f"with --base PATH")
    loaded = given.take() if given is not None and saved is None and given.path == path else source(path)
    model = start_from(loaded, config, path)
    meta = {"special": special_of(loaded)}
    if adapters is not None:
        base = {"path": str(Path(loaded.source).absolute()), "digest": lora.base_digest(loaded.model)}
        if saved is not None:
            lora.check_base(saved["lora"]["base"], base["digest"], "the run resumed")
        try:
            lora.add_lora(model, family=loaded.family, **adapters)
        except ValueError as e:
            raise ValueError(f"--lora-rank: {e}") from None
        meta["lora"] = {"settings": lora.lora_settings(model), "base": base}
    tokenizer = loaded.tokenizer if saved is None else from_spec(saved["tokenizer"])
    return Start(model, tokenizer, loaded.chat, meta)


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
