"""One loader for every model path a command accepts: a run folder, a checkpoint file, a local
folder written by ``transformers``' ``save_pretrained``, or a GGUF file of llama.cpp.

- run folder of ``selfattn train``: its best checkpoint by val loss (``best.safetensors``), else its
  newest ``ckpt-*.safetensors``;
- checkpoint file: ``ckpt-*.safetensors``, or a ``torch.save`` state dict (``.pt``, ``.pth``,
  ``.bin``, loaded with ``weights_only=True``) beside the run's ``config.json``;
- ``transformers`` folder (a ``config.json`` with a ``model_type``), dispatched on its
  ``model_type``: ``gpt2`` through :func:`selfattn.io.hf.load_gpt2`, tokenizer from the folder's
  ``tokenizer.json`` or ``vocab.json`` + ``merges.txt``; the families of :mod:`selfattn.families`
  from ``config.json`` and ``model.safetensors`` (or its shards) by their mapping, without
  ``transformers`` (:mod:`selfattn.formats.hf_folder`): the tokenizer from ``tokenizer.json`` when
  :class:`~selfattn.tokenizers.BPETokenizer` decodes it token by token (byte-level or SentencePiece-style BPE),
  else none (:meth:`Loaded.require_tokenizer` says so); the bos, eos and chat template beside it.
  Any other ``model_type`` is refused, naming it and the file;
- GGUF file (``.gguf``, or any file that starts as one; :mod:`selfattn.formats.gguf`): its
  metadata as a ``config.json`` and its tensors, dequantised one at a time, by the same mapping;
  its tokenizer, bos, eos and chat template from its metadata.

A model loads whole or not at all: weights with a tensor missing or one the model lacks are
refused, naming them. A family's weights are copied into the model one tensor at a time. Each
file is read once and its digest checked once; nothing is ever downloaded.
"""
from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass
from pathlib import Path

import torch

from selfattn import families, lora
from selfattn._util import validate as _validate
from selfattn._util.jsonfile import json_object as _json_object
from selfattn._util.validate import one_line
from selfattn.config import GPTConfig
from selfattn.formats import checkpoint, gguf, hf_folder
from selfattn.io import carry
from selfattn.model import GPT
from selfattn.tokenizers import BPETokenizer, ByteTokenizer, from_spec
from selfattn.tokenizers.chat import ChatTemplate

GPT2_EOT = "<|endoftext|>"  # GPT-2's end-of-text token: an empty prompt starts from it


@dataclass
class Loaded:
    """A model ready to use, with what it needs to read and write text."""
    model: GPT  # on the CPU, in training mode (call .eval() for inference)
    tokenizer: ByteTokenizer | BPETokenizer | None  # None: the folder has none this library reads
    start_token: int | None  # what an empty prompt starts from: a newline, <|endoftext|> or bos; None: none
    source: Path  # the checkpoint file, transformers folder or GGUF file the weights came from
    eos: tuple[int, ...] = ()  # the tokens that end an answer (empty: none is known)
    chat: ChatTemplate | None = None  # how a conversation is written for this model; None: it has no template
    no_tokenizer: str = "it reads byte-level and SentencePiece-style BPE tokenizer.json files"  # why None
    bos: int | None = None  # the beginning-of-sequence token the source declares (None: none)
    family: str | None = None  # the model_type of the folder or GGUF file it came from (None: a run of ours, GPT-2)
    base: Path | None = None  # a LoRA run's base model, which its adapters were trained on (None: not a LoRA run)
    pre: str | None = None  # the llama.cpp pre-tokenizer a GGUF source names (tokenizer.ggml.pre; None: none)

    def require_tokenizer(self) -> ByteTokenizer | BPETokenizer:
        """The tokenizer; a ValueError naming the source when the model came without one."""
        if self.tokenizer is None:
            raise ValueError(f"{self.source} has no tokenizer selfattn can read ({self.no_tokenizer}), so this "
                             f"model cannot encode or decode text")
        return self.tokenizer

    def require_chat(self) -> ChatTemplate:
        """The chat template; a ValueError naming the source when the model came without one."""
        if self.chat is None:
            raise ValueError(f"{self.source} has no chat template (tokenizer_config.json's chat_template, "
                             f"chat_template.jinja or a GGUF file's tokenizer.chat_template)")
        return self.chat


def load(path: str | os.PathLike, *, merge: bool = True, base: str | os.PathLike | None = None) -> Loaded:
    """Load the model at ``path`` with what it needs to read and write text.

    Args:
        path: a run folder, a checkpoint file, a ``transformers`` folder or a GGUF file (the module
            docstring says how each is read).
        merge: merge a LoRA run's adapters into its base (False: keep them as adapters).
        base: a LoRA run's base model at another place than the one its meta names (it moved); its
            digest is checked all the same. None: the meta's path. A ValueError for a path that is no LoRA run.

    Returns:
        a :class:`Loaded`: the model (on the CPU, in training mode), its tokenizer (or why it has
        none), bos, eos, chat template and where it came from.

    Raises ``ValueError`` (a :class:`~selfattn.formats.checkpoint.CheckpointError` for a
    damaged file) naming the path when it holds no model this library can read, and naming the
    tensor when a weight is NaN or infinite (a damaged file, a NaN quantisation scale): checked
    once, here, so no command samples from or audits such a model.

    A LoRA run (``selfattn train --init-from BASE --lora-rank R``) holds adapters only: its base is
    loaded from the path its meta names and checked against the digest the adapters were trained on
    (another model there is a ValueError naming both), and the adapters are merged into it; with
    ``merge=False`` they are kept as adapters (:mod:`selfattn.lora`), for writing them apart. A base
    that is no longer where the meta says is a ValueError naming it as the run's base; ``base`` gives
    its new place.
    """
    loaded = _read(Path(path), merge, None if base is None else Path(base))
    if base is not None and loaded.base is None:
        raise ValueError(f"--base {str(base)!r} is the base model of a LoRA run, but {loaded.source} is not one "
                         f"(it holds its whole model); leave --base out")
    _check_finite(loaded.model, loaded.source)
    return loaded


def _check_finite(model: GPT, source: Path) -> None:
    for name, tensor in model.state_dict().items():  # a sum is one pass; only a non-finite one is looked into
        if tensor.is_floating_point() and not bool(torch.isfinite(tensor.sum(dtype=torch.float32))) and \
                not bool(torch.isfinite(tensor).all()):
            bad = int((~torch.isfinite(tensor)).sum())
            raise ValueError(f"{source}: the weights hold {bad} NaN or infinite value{'s' * (bad > 1)} in {name} "
                             f"{tuple(tensor.shape)}; the file is damaged")


def _read(path: Path, merge: bool = True, base: Path | None = None) -> Loaded:
    """The model at ``path``, as read (:func:`load` checks it); ``base``: a LoRA run's base at a new place."""
    if not path.exists():
        raise ValueError(f"{str(path)!r} does not exist (expected a run folder, a checkpoint file, a transformers "
                         f"folder or a GGUF file)")
    if path.is_file() and (path.suffix == ".gguf" or gguf.is_gguf(path)):
        return _load_gguf(path)
    if path.is_dir():
        found = checkpoint.read_run(path)  # checkpoints first: a run folder's config.json is our own
        if found is None and is_transformers_folder(path):
            return _load_transformers(path)
        if found is None:
            why = ("its config.json names no model_type (a transformers config.json does)"
                   if (path / "config.json").is_file() else "no transformers config.json")
            raise ValueError(f"{str(path)!r} holds no checkpoint (ckpt-*.safetensors), and {why}")
        path, tensors, header = found
        weights, meta = checkpoint.weights_of(tensors, header), header["meta"]
    else:
        weights, meta = checkpoint.read_weights(path)
    if meta is None:  # a bare state dict: the run's config.json beside it describes the model
        meta = _run_config(path.parent)
    if not (isinstance(meta, dict) and isinstance(meta.get("model"), dict) and isinstance(meta.get("tokenizer"), dict)):
        raise ValueError(f"{path}: its meta describes no model (no 'model' and 'tokenizer' entries)")
    tokenizer = from_spec(meta["tokenizer"])
    config = GPTConfig(**_validate.config_fields(GPTConfig, meta["model"], str(path)))
    try:
        if "lora" in meta:
            base = _base_path(meta["lora"], path, base)
            model = _adapted(config, meta["lora"], weights, path, merge, base)
        else:
            model = GPT(config)
            model.load_state_dict(weights)
    except RuntimeError as e:
        raise ValueError(f"{path}: weights do not fit the configured model: {one_line(e)}") from None
    base = base if "lora" in meta else None
    return _with_special(Loaded(model, tokenizer, _newline(tokenizer), path, base=base), meta.get("special"))


def _base_path(adapters: dict, path: Path, given: Path | None) -> Path:
    """Where the base of the LoRA run at ``path`` is: ``given`` (its new place), else the path its meta names;
    a ValueError naming it as the run's base when nothing is there."""
    base = given if given is not None else Path(adapters["base"]["path"])
    if not base.exists():
        raise ValueError(f"the base model of the LoRA run {path}, {str(base)!r}, does not exist"
                         + (" (moved?); give its new place with --base PATH" if given is None else
                            f" (--base; the run was trained on {adapters['base']['path']})"))
    return base


def _adapted(config: GPTConfig, adapters: dict, weights: dict, path: Path, merge: bool, where: Path) -> GPT:
    """A LoRA run's model: its base (``adapters["base"]``: path and digest; read from ``where``) carried
    into ``config``, the adapters ``weights`` on it, merged into its weights when ``merge``."""
    base = _read(where)
    lora.check_base(adapters["base"], lora.base_digest(base.model), str(path), at=str(where))
    model = GPT.empty(config)
    model.load_state_dict(carry.carried(base.model, model))
    lora.add_lora(model, **adapters["settings"])
    lora.load_adapter_state(model, weights)
    return lora.merge(model) if merge else model


def special_of(loaded: Loaded) -> dict:
    """What a fine-tuned run keeps of the model it started from, beside its tokenizer, JSON-ready:
    the start token, bos, eos, chat template, family and pre-tokenizer name (read back by :func:`load`)."""
    chat = loaded.chat
    return {"start": loaded.start_token, "bos": loaded.bos, "eos": list(loaded.eos),
            "chat_template": chat and chat.source, "chat_tokens": chat.tokens if chat else {}, "family": loaded.family,
            "pre": loaded.pre}


def _with_special(loaded: Loaded, special: dict | None) -> Loaded:
    """``loaded`` (a run) given the special tokens and chat template of :func:`special_of` (None: none)."""
    if special is None:
        return loaded
    if not (isinstance(special, dict) and {"start", "bos", "eos", "chat_template", "chat_tokens"} <= set(special)):
        raise ValueError(f"{loaded.source}: its meta's 'special' entry is damaged (expected start, bos, eos, "
                         f"chat_template and chat_tokens)")
    return dataclasses.replace(loaded, start_token=special["start"], bos=special["bos"], eos=tuple(special["eos"]),
                               chat=chat_of(special, loaded.source), family=special.get("family"),
                               pre=special.get("pre"))  # runs of earlier versions kept no family or pre


def chat_of(special: dict, source) -> ChatTemplate | None:
    """The chat template :func:`special_of` kept of the model a run started from (None: it had none)."""
    template = special["chat_template"]
    where = f"{source} (the chat template of the model it started from)"
    return ChatTemplate(template, special["chat_tokens"], where) if template else None


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
    from selfattn.io.hf import load_gpt2

    tokenizer = BPETokenizer.from_folder(path)
    start = tokenizer.token_id(GPT2_EOT)
    return Loaded(load_gpt2(path), tokenizer, _newline(tokenizer) if start is None else start, path)


def _load_family(path: Path) -> Loaded:
    """A folder of a family of :mod:`selfattn.families`: its config.json and safetensors weights,
    mapped; its tokenizer when it is one this library reads, else None; its bos, eos, chat template."""
    config_file = path / "config.json"
    hf = hf_folder.config(path)
    family = families.FAMILIES[hf["model_type"]]
    tensors = hf_folder.Safetensors(path)
    model = families.empty(family, hf, tensors, str(path), str(config_file))
    families.load(family, tensors, model, str(path))
    tokenizer = hf_folder.tokenizer(path)
    bos, eos = hf_folder.special_ids(path, hf, model.config.vocab_size)
    start = bos if bos is not None else None if tokenizer is None else _newline(tokenizer)  # else from a newline
    return Loaded(model, tokenizer, start, path, eos, hf_folder.chat_template(path), bos=bos, family=hf["model_type"])


def _load_gguf(path: Path) -> Loaded:
    """A GGUF file: its metadata as a config.json and its tensors, mapped by the family's mapping; its
    tokenizer (None, saying why, when this library reads no tokenizer of its kind), bos, eos, chat template."""
    from selfattn.tokenizers.gguf import from_metadata

    file = gguf.read(path)
    family = families.FAMILIES[file.config["model_type"]]
    model = families.empty(family, file.config, file.tensors, str(path), f"{path} (its metadata as a config.json)")
    families.load(family, file.tensors, model, str(path))
    try:
        tokenizer, why = from_metadata(file.metadata), ""
    except ValueError as e:
        tokenizer, why = None, str(e).removeprefix(f"{path}: ")
    vocab, meta = model.config.vocab_size, file.metadata
    special = {name: meta.value(f"tokenizer.ggml.{name}_token_id", int, None) for name in ("bos", "eos", "eot")}
    special = {name: i for name, i in special.items() if i is not None and 0 <= i < vocab}
    chat = None
    if tokenizer is not None and "tokenizer.chat_template" in meta:
        names = {f"{name}_token": tokenizer.piece(i) for name, i in special.items() if name != "eot"}
        chat = ChatTemplate(meta.value("tokenizer.chat_template", str), names, f"{path} (tokenizer.chat_template)")
    start = special.get("bos", None if tokenizer is None else _newline(tokenizer))
    eos = tuple(dict.fromkeys(special[name] for name in ("eos", "eot") if name in special))
    return Loaded(model, tokenizer, start, path, eos, chat, why or Loaded.no_tokenizer, bos=special.get("bos"),
                  family=file.config["model_type"], pre=meta.value("tokenizer.ggml.pre", str, None))


# model_type -> the loader of its folders; GPT-2's through transformers (its Conv1D weights are stored transposed)
_FAMILIES = {"gpt2": _load_gpt2} | {model_type: _load_family for model_type in families.FAMILIES
                                    if model_type != "gpt2"}


def _newline(tokenizer) -> int | None:
    """The first token of "\\n", or None when the tokenizer has no way to write a newline (a SentencePiece
    vocabulary with neither the character nor its byte token refuses to encode it)."""
    try:
        ids = tokenizer.encode("\n")
    except ValueError:
        return None
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
