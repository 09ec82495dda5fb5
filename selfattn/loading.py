"""One loader for every model path a command accepts: a run folder, a checkpoint file, or a
local GPT-2 folder written by ``transformers``' ``save_pretrained``.

- run folder of ``selfattn train``: its newest ``ckpt-*.safetensors``;
- checkpoint file: ``ckpt-*.safetensors``, or a ``torch.save`` state dict (``.pt``, ``.pth``,
  ``.bin``, loaded with ``weights_only=True``) beside the run's ``config.json``;
- ``transformers`` folder (a ``config.json`` with a ``model_type``), dispatched on its
  ``model_type``; ``gpt2`` only for now: weights through :func:`selfattn.hf.load_gpt2`,
  tokenizer from the folder's ``tokenizer.json`` or ``vocab.json`` + ``merges.txt``. Any other
  ``model_type`` is refused, naming it and the file.

A model loads whole or not at all: weights with a tensor missing or one the model lacks are
refused, naming them. Each file is read once and its digest checked once; nothing is ever
downloaded.
"""
from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path

from selfattn import _validate
from selfattn._validate import one_line
from selfattn.model import GPT, GPTConfig
from selfattn.training import checkpoint
from selfattn.training.tokenizers import BPETokenizer, ByteTokenizer, from_spec

GPT2_EOT = "<|endoftext|>"  # GPT-2's end-of-text token: an empty prompt starts from it


@dataclass
class Loaded:
    """A model ready to use, with what it needs to read and write text."""
    model: GPT  # on the CPU, in training mode (call .eval() for inference)
    tokenizer: ByteTokenizer | BPETokenizer
    start_token: int | None  # what an empty prompt starts from: a newline, or GPT-2's <|endoftext|>; None: neither
    source: Path  # the checkpoint file or GPT-2 folder the weights came from


def load(path: str | os.PathLike) -> Loaded:
    """The model at ``path`` (see the module docstring for the kinds of path).

    Raises ``ValueError`` (a :class:`~selfattn.training.checkpoint.CheckpointError` for a
    damaged file) naming the path when it holds no model this library can read.
    """
    path = Path(path)
    if not path.exists():
        raise ValueError(f"{str(path)!r} does not exist (expected a run folder, a checkpoint file or a GPT-2 folder)")
    if path.is_dir():
        found = checkpoint.read_latest(path)  # checkpoints first: a run folder's config.json is our own
        if found is None and is_transformers_folder(path):
            return _load_transformers(path)
        if found is None:
            raise ValueError(f"{str(path)!r} holds no checkpoint (ckpt-*.safetensors) and no transformers config.json")
        path, tensors, header = found
        weights, meta = checkpoint.weights_of(tensors, header), header["meta"]
    else:
        weights, meta = checkpoint.read_weights(path)
    if meta is None:  # a bare state dict: the run's config.json beside it describes the model
        meta = _run_config(path.parent)
    if not (isinstance(meta, dict) and isinstance(meta.get("model"), dict) and isinstance(meta.get("tokenizer"), dict)):
        raise ValueError(f"{path}: its meta describes no model (no 'model' and 'tokenizer' entries)")
    tokenizer = from_spec(meta["tokenizer"])
    model = GPT(GPTConfig(**_validate.config_fields(GPTConfig, meta["model"], str(path))))
    try:
        model.load_state_dict(weights)
    except RuntimeError as e:
        raise ValueError(f"{path}: weights do not fit the configured model: {one_line(e)}") from None
    return Loaded(model, tokenizer, _newline(tokenizer), path)


def is_transformers_folder(path: Path) -> bool:
    """A folder written by ``save_pretrained``: its ``config.json`` names a ``model_type``
    (a ``config.json`` that is not a JSON object is a ValueError naming it)."""
    config = path / "config.json"
    return config.is_file() and "model_type" in _json_object(config)


def _load_transformers(path: Path) -> Loaded:
    """A ``transformers`` folder, by the ``model_type`` of its ``config.json``."""
    config = path / "config.json"
    model_type = _json_object(config)["model_type"]
    if not isinstance(model_type, str) or model_type not in _FAMILIES:
        raise ValueError(f"unsupported model_type {model_type!r} in {config}: this version loads "
                         f"{', '.join(_FAMILIES)} folders")
    return _FAMILIES[model_type](path)


def _load_gpt2(path: Path) -> Loaded:
    from selfattn.hf import load_gpt2

    tokenizer = BPETokenizer.from_folder(path)
    start = tokenizer.token_id(GPT2_EOT)
    return Loaded(load_gpt2(path), tokenizer, _newline(tokenizer) if start is None else start, path)


_FAMILIES = {"gpt2": _load_gpt2}  # model_type -> loader of its folders


def _newline(tokenizer: ByteTokenizer | BPETokenizer) -> int | None:
    """The first token of "\\n", or None when the tokenizer has no way to write a newline."""
    ids = tokenizer.encode("\n")
    return ids[0] if ids else None


def _run_config(folder: Path) -> dict:
    """The model config and tokenizer of the run in ``folder``, from its config.json."""
    config = folder / "config.json"
    if not config.is_file():
        raise ValueError(f"a bare state dict needs the run's config.json beside it; none in {str(folder)!r}")
    run = _json_object(config)
    if not isinstance(run.get("model"), dict) or not isinstance(run.get("train"), dict):
        raise ValueError(f"{config}: not the config.json of a selfattn run (no 'model' and 'train' objects)")
    if run["train"].get("tokenizer", "byte") == "byte":
        return {"model": run["model"], "tokenizer": {"kind": "byte"}}
    if not (folder / "tokenizer.json").is_file():
        raise ValueError(f"{config} names a BPE tokenizer, but there is no tokenizer.json beside it")
    return {"model": run["model"], "tokenizer": {"kind": "bpe", "json": (folder / "tokenizer.json").read_text()}}


def _json_object(path: Path) -> dict:
    """The JSON object in the file ``path``; ValueError naming the file when it holds none."""
    try:
        content = json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise ValueError(f"{path}: invalid JSON at line {e.lineno} column {e.colno}: {e.msg}") from None
    except UnicodeDecodeError as e:
        raise ValueError(f"{path}: not UTF-8 text (byte {e.start})") from None
    if not isinstance(content, dict):
        raise ValueError(f"{path}: expected a JSON object, got {type(content).__name__}")
    return content
