"""One loader for every model path a command accepts: a run folder, a checkpoint file, or a
local GPT-2 folder written by ``transformers``' ``save_pretrained``.

- run folder of ``selfattn train``: its newest ``ckpt-*.safetensors``;
- checkpoint file: ``ckpt-*.safetensors``, or a ``torch.save`` state dict (``.pt``, ``.pth``,
  ``.bin``, loaded with ``weights_only=True``) beside the run's ``config.json``;
- GPT-2 folder (a ``config.json`` with a ``model_type``): weights through
  :func:`selfattn.hf.load_gpt2`, tokenizer from the folder's ``tokenizer.json`` or
  ``vocab.json`` + ``merges.txt``.

Each file is read once and its digest checked once; nothing is ever downloaded.
"""
from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path

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
    start_token: int  # the token an empty prompt starts from: a newline, or GPT-2's <|endoftext|>
    source: Path  # the checkpoint file or GPT-2 folder the weights came from


def load(path: str | os.PathLike) -> Loaded:
    """The model at ``path`` (see the module docstring for the kinds of path).

    Raises ``ValueError`` (a :class:`~selfattn.training.checkpoint.CheckpointError` for a
    damaged file) naming the path when it holds no model this library can read.
    """
    path = Path(path)
    if not path.exists():
        raise ValueError(f"{str(path)!r} does not exist (expected a run folder, a checkpoint file or a GPT-2 folder)")
    if path.is_dir() and is_transformers_folder(path):
        return _load_gpt2(path)
    if path.is_dir():
        found = checkpoint.latest(path)
        if found is None:
            raise ValueError(f"{str(path)!r} holds no checkpoint (ckpt-*.safetensors) and no transformers config.json")
        path = found
    weights, meta = checkpoint.read_weights(path)
    if meta is None:  # a bare state dict: the run's config.json beside it describes the model
        meta = _run_config(path.parent)
    tokenizer = from_spec(meta["tokenizer"])
    model = GPT(GPTConfig(**meta["model"]))
    try:
        model.load_state_dict(weights)
    except RuntimeError as e:
        raise ValueError(f"{path}: weights do not fit the configured model: {one_line(e)}") from None
    return Loaded(model, tokenizer, tokenizer.encode("\n")[0], path)


def is_transformers_folder(path: Path) -> bool:
    """A folder written by ``save_pretrained``: its ``config.json`` names a ``model_type``."""
    config = path / "config.json"
    return config.is_file() and "model_type" in json.loads(config.read_text())


def _load_gpt2(path: Path) -> Loaded:
    from selfattn.hf import load_gpt2

    tokenizer = BPETokenizer.from_folder(path)
    start = tokenizer.token_id(GPT2_EOT)
    if start is None:
        start = tokenizer.encode("\n")[0]
    return Loaded(load_gpt2(path), tokenizer, start, path)


def _run_config(folder: Path) -> dict:
    """The model config and tokenizer of the run in ``folder``, from its config.json."""
    try:
        run = json.loads((folder / "config.json").read_text())
    except FileNotFoundError:
        raise ValueError(f"a bare state dict needs the run's config.json beside it; none in {str(folder)!r}") from None
    kind = run["train"]["tokenizer"]
    spec = {"kind": "byte"} if kind == "byte" else {"kind": "bpe", "json": (folder / "tokenizer.json").read_text()}
    return {"model": run["model"], "tokenizer": spec}
