"""One loader for every model path a command accepts: a run folder, a checkpoint file, or a
local folder written by ``transformers``' ``save_pretrained``.

- run folder of ``selfattn train``: its newest ``ckpt-*.safetensors``;
- checkpoint file: ``ckpt-*.safetensors``, or a ``torch.save`` state dict (``.pt``, ``.pth``,
  ``.bin``, loaded with ``weights_only=True``) beside the run's ``config.json``;
- ``transformers`` folder (a ``config.json`` with a ``model_type``), dispatched on its
  ``model_type``: ``gpt2`` through :func:`selfattn.hf.load_gpt2`, tokenizer from the folder's
  ``tokenizer.json`` or ``vocab.json`` + ``merges.txt``; the families of :mod:`selfattn.models`
  (``llama``, ``mistral``, ``qwen2``) from ``config.json`` and ``model.safetensors`` (or its
  shards) by their mapping, without ``transformers``, tokenizer from ``tokenizer.json`` when it
  is a byte-level BPE (Qwen2's, Llama 3's), else none (:meth:`Loaded.require_tokenizer` says
  so). Any other ``model_type`` is refused, naming it and the file.

A model loads whole or not at all: weights with a tensor missing or one the model lacks are
refused, naming them. Each file is read once and its digest checked once; nothing is ever
downloaded.
"""
from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path

from selfattn import _validate, models
from selfattn._validate import one_line
from selfattn.model import GPT, GPTConfig
from selfattn.training import checkpoint
from selfattn.training.tokenizers import BPETokenizer, ByteTokenizer, from_spec

GPT2_EOT = "<|endoftext|>"  # GPT-2's end-of-text token: an empty prompt starts from it


@dataclass
class Loaded:
    """A model ready to use, with what it needs to read and write text."""
    model: GPT  # on the CPU, in training mode (call .eval() for inference)
    tokenizer: ByteTokenizer | BPETokenizer | None  # None: the folder has none this library reads
    start_token: int | None  # what an empty prompt starts from: a newline, <|endoftext|> or bos; None: none
    source: Path  # the checkpoint file or transformers folder the weights came from

    def require_tokenizer(self) -> ByteTokenizer | BPETokenizer:
        """The tokenizer; a ValueError naming the source when the model came without one."""
        if self.tokenizer is None:
            raise ValueError(f"{self.source} has no tokenizer selfattn can read (it reads byte-level BPE "
                             f"tokenizer.json files), so this model cannot encode or decode text")
        return self.tokenizer


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


def _load_family(path: Path) -> Loaded:
    """A folder of a family of :mod:`selfattn.models`: its config.json and safetensors weights,
    mapped; its tokenizer when it is one this library reads, else None."""
    config_file = path / "config.json"
    hf = _json_object(config_file)
    family = models.FAMILIES[hf["model_type"]]
    config = family.config(hf, str(config_file))
    try:
        model = GPT(config)
    except (TypeError, ValueError) as e:  # sizes the attention refuses (heads, window)
        raise type(e)(f"{config_file}: {e}") from None
    model.load_state_dict(models.state_dict(family, _safetensors_weights(path), model, str(path)))
    tokenizer = _byte_level_bpe(path)
    bos = hf.get("bos_token_id")  # an empty prompt starts from it, else from a newline
    has_bos = isinstance(bos, int) and not isinstance(bos, bool) and 0 <= bos < config.vocab_size
    start = bos if has_bos else None if tokenizer is None else _newline(tokenizer)
    return Loaded(model, tokenizer, start, path)


def _safetensors_weights(folder: Path) -> dict:
    """Every tensor of the folder's ``model.safetensors``, or of the shards its index names."""
    index = folder / "model.safetensors.index.json"
    names = sorted(set(_json_object(index).get("weight_map", {}).values())) if index.is_file() \
        else ["model.safetensors"]
    if not all((folder / name).is_file() for name in names):
        pickles = sorted(p.name for p in folder.glob("pytorch_model*.bin"))
        hint = (f": it holds its weights as a pickle ({pickles[0]}), which is never loaded. Convert it once, where "
                f"you trust the file: AutoModelForCausalLM.from_pretrained('{folder}').save_pretrained('{folder}') "
                f"writes model.safetensors") if pickles else ""
        raise ValueError(f"{folder} has no {', '.join(n for n in names if not (folder / n).is_file())}{hint}")
    try:
        from safetensors.torch import load_file
    except ImportError as e:
        raise ImportError("reading a transformers folder needs 'safetensors': pip install 'selfattn[train]'") from e
    tensors = {}
    for name in names:
        try:
            tensors |= load_file(folder / name)
        except Exception as e:  # the Rust reader raises its own types for malformed files
            raise ValueError(f"{folder / name} cannot be read as safetensors ({one_line(e)})") from None
    return tensors


def _byte_level_bpe(folder: Path) -> BPETokenizer | None:
    """The folder's ``tokenizer.json`` when it is a byte-level BPE (GPT-2's scheme, which
    :class:`BPETokenizer` streams byte-exactly: Qwen2, Llama 3); None without one, or for
    another kind (the SentencePiece-style BPE of Llama 2 and Mistral)."""
    file = folder / "tokenizer.json"
    if not file.is_file():
        return None
    spec = _json_object(file)
    kinds = [(spec.get(part) or {}).get("type") for part in ("model", "decoder")]
    return BPETokenizer.from_json(file.read_text(), str(file)) if kinds == ["BPE", "ByteLevel"] else None


_FAMILIES = {"gpt2": _load_gpt2} | dict.fromkeys(models.FAMILIES, _load_family)  # model_type -> loader of its folders


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
