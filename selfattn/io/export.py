"""A trained GPT as a folder that Hugging Face ``transformers`` loads, offline.

``export(gpt, tokenizer, out_dir)`` writes ``config.json``, ``model.safetensors``,
``generation_config.json``, ``tokenizer.json`` and ``tokenizer_config.json``, so that
``AutoModelForCausalLM.from_pretrained(DIR)``, ``AutoTokenizer.from_pretrained(DIR)`` and
``pipeline("text-generation", model=DIR)`` work without a network, and ``selfattn sample
--ckpt DIR`` reads the folder back (:mod:`selfattn.io.loading`).

- The model becomes a ``GPT2LMHeadModel`` (:func:`selfattn.io.hf.to_hf`) when GPT-2 can say it:
  a model without biases is the same function as a GPT-2 whose biases are all zero, and
  exports as one. Otherwise it becomes the first family of :data:`selfattn.families.writing.ARCHS`
  whose ``config.json`` says all of it (a run of ``selfattn train --arch llama`` is a Llama),
  its tensors named as that family names them. A model no family can say is refused, naming
  each field GPT-2 lacks.
- The byte tokenizer becomes a byte-level BPE whose vocabulary is the 256 bytes and which
  has no merges: token id = byte value, and any UTF-8 text round-trips. A BPE run exports
  its own ``tokenizer.json``. GPT-2's ``<|endoftext|>``, when the vocabulary has it, is the
  end-of-text token of the tokenizer and the generation config.

The folder is assembled under a temporary name beside ``out_dir`` and renamed into place, so
a kill leaves the old folder or the new one, never a mix of both. A ``selfattn train`` run
folder (checkpoints, log or lock) is never replaced, ``force`` or not: it is checked before the
work and again just before the rename, in case a run started there meanwhile.
"""
from __future__ import annotations

import contextlib
import json
import os
import shutil
from dataclasses import dataclass
from pathlib import Path

import torch

from selfattn._util import files as _files
from selfattn._util import progress
from selfattn.families import writing
from selfattn.io.hf import to_hf
from selfattn.model import GPT
from selfattn.tokenizers import BPETokenizer, ByteTokenizer, SentencePieceTokenizer
from selfattn.tokenizers.bpe import bytes_to_unicode, import_tokenizers

EOT = "<|endoftext|>"
PROBE_TOKENS = 64  # tokens the export is checked on: its logits against ours
RUN_FILES = ("ckpt-*.safetensors", ".lock", "log.jsonl")  # a run folder's own files: export never deletes them

# GPTConfig field -> (whether GPT-2 can express the value, what GPT-2 lacks otherwise)
_GPT2_LACKS = {
    "pos": (lambda c: c.pos == "learned", "GPT-2 has learned absolute positions only (no rotary, no position-free)"),
    "n_kv_head": (lambda c: c.n_kv_head in (None, c.n_head),
                  "GPT-2 attention has one key/value head per query head, no GQA or MQA"),
    "window": (lambda c: c.window is None, "GPT-2 attention sees every earlier token, no sliding window"),
    "sink_tokens": (lambda c: c.sink_tokens is None, "GPT-2 has no window to keep sink tokens visible in"),
    "alibi": (lambda c: not c.alibi, "GPT-2 adds no ALiBi distance biases to its scores"),
    "softcap": (lambda c: c.softcap is None, "GPT-2 does not soft-cap its attention scores"),
    "sinks": (lambda c: not c.sinks, "GPT-2's softmax has no learned sink logits"),
    "mlp": (lambda c: c.mlp, "every GPT-2 block has an MLP; there are no attention-only blocks"),
    "mlp_kind": (lambda c: c.mlp_kind == "gelu", "GPT-2's MLP is Linear, GELU, Linear; no gated SwiGLU"),
    "intermediate_size": (lambda c: c.intermediate_size in (None, 4 * c.n_embd), "GPT-2's MLP is 4 * n_embd wide"),
    "norm": (lambda c: c.norm == "layernorm", "GPT-2 normalises with LayerNorm, not RMSNorm"),
    "head_dim": (lambda c: c.head_dim in (None, c.n_embd // c.n_head), "GPT-2's head_dim is n_embd / n_head"),
    "tie_embeddings": (lambda c: c.tie_embeddings, "GPT-2's LM head is the token embedding (tied)"),
}


@dataclass
class Special:
    """The special tokens and chat template an export carries from its source (a folder, a GGUF file):
    ``bos`` and ``eos`` ids (None and () when the source declares none), the chat template's text, and
    the llama.cpp pre-tokenizer a GGUF source names (``tokenizer.ggml.pre``; a GGUF export writes it)."""
    bos: int | None = None
    eos: tuple[int, ...] = ()
    chat_template: str | None = None
    pre: str | None = None

    @classmethod
    def of(cls, loaded) -> Special:
        """What a :class:`~selfattn.io.loading.Loaded` model carries: its bos, eos, chat template, pre-tokenizer."""
        return cls(loaded.bos, loaded.eos, loaded.chat and loaded.chat.source, loaded.pre)


@dataclass
class Exported:
    """What :func:`export` wrote."""
    path: Path  # the folder
    files: list[str]  # the names of the files in it, sorted
    architecture: str  # the transformers class the folder loads as
    logits_error: float  # max |logit| difference, exported model vs ours, on PROBE_TOKENS tokens


def unsupported(config) -> list[str]:
    """Why ``config`` (a :class:`~selfattn.model.GPTConfig`) cannot be a ``GPT2LMHeadModel``:
    one ``"field=value: reason"`` per field, empty when it can."""
    return [f"{name}={getattr(config, name)!r}: {reason}" for name, (ok, reason) in _GPT2_LACKS.items()
            if not ok(config)]


def export(gpt: GPT, tokenizer: ByteTokenizer | BPETokenizer | SentencePieceTokenizer, out_dir: str | os.PathLike, *,
           force: bool = False, special: Special | None = None) -> Exported:
    """Write ``gpt`` and ``tokenizer`` to ``out_dir`` as a ``transformers`` model folder (a SentencePiece
    tokenizer as the BPE of :meth:`~selfattn.tokenizers.SentencePieceTokenizer.to_bpe`, id for id).

    ``special``: the source's bos and eos tokens and chat template, written into ``config.json``,
    ``generation_config.json`` and the tokenizer's files; None: a run's own, ``<|endoftext|>`` as
    both where the tokenizer has it. An ``out_dir`` that exists and is not empty is refused unless
    ``force``, which replaces it whole. Raises ``ValueError`` naming every field GPT-2 cannot express.
    """
    if not isinstance(gpt, GPT):
        raise TypeError(f"export expects a selfattn GPT, got {type(gpt).__name__}")
    out = Path(out_dir).absolute()
    check_target(out, force)
    reasons = unsupported(gpt.config)
    family = writing.folder_config(gpt.config) if reasons else None
    if reasons and family is None:
        raise ValueError("cannot export to transformers' GPT2LMHeadModel: " + "; ".join(reasons) +
                         f"; and no family of {', '.join(writing.ARCHS)} computes this config either")
    if isinstance(tokenizer, SentencePieceTokenizer):  # a GGUF file's (Gemma's): tokenizer.json's form of it
        tokenizer = tokenizer.to_bpe()
    if not isinstance(tokenizer, (ByteTokenizer, BPETokenizer)):  # a model loaded without one: architecture first
        raise TypeError(f"export expects a ByteTokenizer or BPETokenizer, got {type(tokenizer).__name__}")
    if tokenizer.vocab_size > gpt.config.vocab_size:
        raise ValueError(f"the tokenizer has {tokenizer.vocab_size} tokens but the model only "
                         f"vocab_size={gpt.config.vocab_size}")
    special = special or _run_special(tokenizer)
    hf_tokenizer = _hf_tokenizer(tokenizer, gpt.config.block_size, special)
    tmp = out.with_name(f".{out.name}.tmp-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        with progress.stage("converting the model for transformers"):
            hf_model = _gpt2(gpt, special) if family is None else _write_family(gpt, *family, special, tmp)
        with progress.stage("checking its logits"):
            error = logits_error(gpt, lambda idx: hf_model(idx).logits)
        with progress.stage(f"writing {out.name}"):
            _save_quietly(hf_model if family is None else None, hf_tokenizer, tmp)
        files = sorted(p.name for p in tmp.iterdir())
        mode = _files.new_file_mode()  # what a plain open() would give: safetensors writes its file 0600
        for name in files:
            os.chmod(tmp / name, mode)
            _files.fsync(tmp / name)
        check_target(out, force)  # again: a run may have started in out_dir while the export was built
        _replace_folder(tmp, out)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return Exported(out, files, type(hf_model).__name__, error)


def byte_level_tokenizer():
    """The byte tokenizer as a ``tokenizers.Tokenizer``: a byte-level BPE over the 256 bytes,
    no merges, so token id = byte value."""
    tokenizers = import_tokenizers()
    vocab = {char: byte for byte, char in bytes_to_unicode().items()}
    tok = tokenizers.Tokenizer(tokenizers.models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = tokenizers.pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = tokenizers.decoders.ByteLevel()
    return tok


def check_target(out_dir: str | os.PathLike, force: bool, *, flags: bool = False) -> None:
    """Refuse an ``out_dir`` that :func:`export` must not write: a file; a ``selfattn train`` run
    folder, or one with a run inside (any of :data:`RUN_FILES` at any depth), ``force`` or not; a
    folder that is not empty, unless ``force``; a folder holding the current directory.
    ``flags``: name the command's ``--out`` and ``--force`` rather than the arguments."""
    out = Path(out_dir).absolute()
    name, force_name = ("--out", "--force") if flags else ("out_dir", "force=True")
    if out.exists() and not out.is_dir():
        raise ValueError(f"{name} {str(out)!r} is a file, not a folder")
    if not (out.is_dir() and any(out.iterdir())):
        return
    run = sorted(str(p.relative_to(out)) for pattern in RUN_FILES for p in out.rglob(pattern))
    if run:
        raise ValueError(f"will not replace {str(out)!r}, force or not: it holds a selfattn run ("
                         f"{', '.join(run[:3])}{', ...' if len(run) > 3 else ''}); choose another {name}")
    if not force:
        raise ValueError(f"{name} {str(out)!r} exists and is not empty; pass {force_name} to replace it")
    if out == Path.cwd() or out in Path.cwd().parents:
        raise ValueError(f"will not replace {str(out)!r}: it holds the current directory")


def _gpt2(gpt: GPT, special: Special):
    """``gpt`` as a ``GPT2LMHeadModel`` in eval mode, ``special`` its configs' special tokens."""
    with torch.random.fork_rng(devices=[]):  # building the models draws initial weights: leave the caller's RNG be
        hf_model = to_hf(writing.with_zero_biases(gpt)).eval()
    for config in (hf_model.config, hf_model.generation_config):
        for name, value in _special_ids(special).items():
            setattr(config, name, value)
    return hf_model


def _write_family(gpt: GPT, model_type: str, hf_config: dict, special: Special, folder: Path):
    """Write ``gpt`` into ``folder`` as ``model_type``'s ``config.json``, ``model.safetensors`` and
    ``generation_config.json``; return ``transformers``' model of the folder (eager attention), read
    back to check it."""
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM

    folder.mkdir(parents=True)
    ids = _special_ids(special)
    (folder / "config.json").write_text(json.dumps({**hf_config, **ids, "torch_dtype": "float32"}, indent=2))
    (folder / "generation_config.json").write_text(json.dumps(ids, indent=2))
    tensors = {name: t.detach().float().cpu() for name, t in writing.folder_tensors(model_type, gpt).items()}
    save_file(tensors, folder / "model.safetensors", metadata={"format": "pt"})
    with torch.random.fork_rng(devices=[]), _no_progress_bar():
        return AutoModelForCausalLM.from_pretrained(folder, attn_implementation="eager").eval()


def _run_special(tokenizer) -> Special:
    """A run's special tokens: ``<|endoftext|>`` as bos and eos where its tokenizer has it."""
    eot = tokenizer.token_id(EOT) if isinstance(tokenizer, BPETokenizer) else None
    return Special() if eot is None else Special(eot, (eot,))


def _special_ids(special: Special) -> dict:
    """The configs' ``bos_token_id``, ``eos_token_id`` (a list when several end an answer) and ``pad_token_id``."""
    eos = special.eos[0] if len(special.eos) == 1 else list(special.eos) or None
    return dict(bos_token_id=special.bos, eos_token_id=eos, pad_token_id=special.eos[0] if special.eos else None)


def _hf_tokenizer(tokenizer, block_size: int, special: Special):
    from transformers import PreTrainedTokenizerFast

    if isinstance(tokenizer, ByteTokenizer):
        tok = byte_level_tokenizer()
    else:
        tok = import_tokenizers().Tokenizer.from_str(tokenizer.tok.to_str())  # a copy: the caller's stays as it is
    names = {}
    if isinstance(tokenizer, BPETokenizer):  # the tokens' text, as tokenizer_config.json names them
        names = {key: tokenizer.tok.id_to_token(i) for key, i in (("bos_token", special.bos),
                 ("eos_token", special.eos[0] if special.eos else None)) if i is not None}
    if special.chat_template is not None:
        names["chat_template"] = special.chat_template
    return PreTrainedTokenizerFast(tokenizer_object=tok, model_max_length=block_size,
                                   clean_up_tokenization_spaces=False, **names)


def write_tokenizer(tokenizer: ByteTokenizer | BPETokenizer, folder: str | os.PathLike, *, block_size: int,
                    special: Special | None = None) -> list[str]:
    """Write ``tokenizer``'s files into ``folder`` as :func:`export` writes them (``tokenizer.json``,
    ``tokenizer_config.json``: ``AutoTokenizer.from_pretrained(folder)`` reads them), ``special``'s tokens
    and chat template in them; returns the names written."""
    folder = Path(folder)
    before = set(os.listdir(folder)) if folder.is_dir() else set()
    _save_quietly(None, _hf_tokenizer(tokenizer, block_size, special or _run_special(tokenizer)), folder)
    return sorted(set(os.listdir(folder)) - before)


@torch.no_grad()
def logits_error(gpt: GPT, exported) -> float:
    """Max |logit difference| of ``exported`` (``idx (1, T) -> logits (1, T, V)``, on ``gpt``'s device) against
    ``gpt`` in eval mode, on :data:`PROBE_TOKENS` tokens spread over the vocabulary."""
    T = min(PROBE_TOKENS, gpt.config.block_size)
    idx = (torch.arange(T, device=gpt.wte.weight.device) * 7919 % gpt.config.vocab_size)[None]  # (1, T)
    was = gpt.training
    try:
        ours = gpt.eval()(idx)[0]
    finally:
        gpt.train(was)
    return float((exported(idx).float() - ours.float()).abs().max())


def _save_quietly(hf_model, hf_tokenizer, folder: Path) -> None:
    """``save_pretrained`` of the model (None: its files are written already) and the tokenizer,
    without transformers' progress bar (a library prints nothing)."""
    with _no_progress_bar():
        if hf_model is not None:
            hf_model.save_pretrained(folder)
        hf_tokenizer.save_pretrained(folder)


@contextlib.contextmanager
def _no_progress_bar():
    """transformers' progress bars off inside, as they were after."""
    from transformers.utils import logging

    shown = logging.is_progress_bar_enabled()
    logging.disable_progress_bar()
    try:
        yield
    finally:
        if shown:
            logging.enable_progress_bar()


def _replace_folder(new: Path, out: Path) -> None:
    """Rename ``new`` to ``out``; an existing ``out`` is moved aside first and removed after."""
    old = out.with_name(f".{out.name}.old-{os.getpid()}")
    if out.exists():
        os.replace(out, old)
    os.replace(new, out)
    shutil.rmtree(old, ignore_errors=True)
    _files.fsync(out.parent)
