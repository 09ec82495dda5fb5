"""Corpora: text in, memory-mapped token ids out (tokenizers: :mod:`selfattn.tokenizers`).

- ``read_corpus(path)``: a text file, a folder of text files, or (``None``) the built-in
  corpus, the documentation that ships inside Python's standard library
  (``pydoc_data.topics``, ~465 KB of English).
- ``prepare(...)``: tokenizes a corpus once, splits train/val and caches both as flat files
  in the run folder, opened memory-mapped; later calls reuse the cache.
- ``batch(...)``: the rows of one training step, a pure function of (seed, step), so a
  resumed run and every rank of a distributed one read exactly the rows they should.
"""
from __future__ import annotations

import hashlib
import importlib
import json
import os
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import Tensor

from selfattn import _files
from selfattn._seeds import stream_seed
from selfattn.tokenizers import BPETokenizer, ByteTokenizer, from_spec

MAX_CORPUS_BYTES = 4 * 2 ** 30  # the corpus is read and tokenized whole, in memory: past this, refused


def read_corpus(path: str | os.PathLike | None) -> tuple[str, str]:
    """(text, description). ``None`` = the built-in corpus; a folder = every non-hidden file
    under it, sorted, joined by blank lines. Raises ``ValueError`` naming the offending file
    for a missing path, a device or a pipe, a corpus over :data:`MAX_CORPUS_BYTES`, an empty
    corpus or a file that is not UTF-8 text."""
    if path is None:
        try:
            topics = importlib.import_module("pydoc_data.topics").topics
        except ImportError as e:
            raise ValueError("the built-in corpus needs the standard library's pydoc_data, which this "
                             "Python lacks; pass --data PATH") from e
        text = "\n\n".join(topics[key] for key in sorted(topics))
        return text, f"built-in corpus: Python's pydoc_data.topics ({len(topics)} documents)"
    root = Path(path)
    if not root.exists():
        raise ValueError(f"data path {str(root)!r} does not exist")
    if root.is_dir():
        files = sorted(p for p in root.rglob("*") if p.is_file()
                       and not any(part.startswith(".") for part in p.relative_to(root).parts))
        if not files:
            raise ValueError(f"data folder {str(root)!r} has no files")
    elif root.is_file():
        files = [root]
    else:
        raise ValueError(f"data path {str(root)!r} is not a regular file or a folder (a device or a pipe?): "
                         f"give a text file")
    size = sum(f.stat().st_size for f in files)
    if size > MAX_CORPUS_BYTES:
        raise ValueError(f"data path {str(root)!r} holds {size:,} bytes, more than the {MAX_CORPUS_BYTES:,} this "
                         f"reader tokenizes in memory")
    text = "\n\n".join(_read_text(f) for f in files)
    if not text.strip():
        raise ValueError(f"data path {str(root)!r} holds no text (empty)")
    return text, f"{root} ({len(files)} file{'s' * (len(files) != 1)})"


@dataclass
class Corpus:
    """Train and val token ids (memory-mapped 1-D integer tensors) and their tokenizer."""
    train: Tensor
    val: Tensor
    tokenizer: ByteTokenizer | BPETokenizer
    description: str  # where the text came from, for people
    fingerprint: str  # SHA-256 of the text: a resumed run checks it still trains on the same corpus


def prepare(cache_dir: str | os.PathLike, *, data: str | None, tokenizer: str | ByteTokenizer | BPETokenizer,
            bpe_vocab: int, val_fraction: float, block_size: int, trained_on: str | None = None) -> Corpus:
    """Tokenize the corpus into ``cache_dir`` (once: a whole cache whose recipe and corpus
    fingerprint match is reused) and open both splits memory-mapped. Val is the last
    ``val_fraction`` of the tokens. ``tokenizer``: ``"byte"``, ``"bpe"`` (trained here on the corpus)
    or a tokenizer to use as it is (a model's own, when fine-tuning). Raises ``ValueError``, before
    anything is written, when either split is shorter than one block plus one token, or when the
    corpus is not the one of fingerprint ``trained_on`` (the corpus a resumed run was trained on)."""
    given = None if isinstance(tokenizer, str) else tokenizer
    if given is None and tokenizer not in ("byte", "bpe"):
        raise ValueError(f"tokenizer must be 'byte' or 'bpe', got {tokenizer!r}")
    if not 0.0 < val_fraction < 1.0:
        raise ValueError(f"val_fraction must be in (0, 1), got {val_fraction!r}")
    text, description = read_corpus(data)
    fingerprint = hashlib.sha256(text.encode("utf-8")).hexdigest()
    if trained_on is not None and fingerprint != trained_on:
        raise ValueError(f"the corpus ({description}, SHA-256 {fingerprint[:12]}...) is not the one this run was "
                         f"trained on (SHA-256 {trained_on[:12]}...); nothing was written")
    cache = Path(cache_dir)
    name = tokenizer if given is None else \
        "given " + hashlib.sha256(json.dumps(given.spec(), sort_keys=True).encode()).hexdigest()[:16]
    recipe = {"fingerprint": fingerprint, "tokenizer": name,
              "bpe_vocab": bpe_vocab if tokenizer == "bpe" else None, "val_fraction": val_fraction}
    meta = _cached(cache, recipe)
    if meta is None:
        tok = given or (ByteTokenizer() if tokenizer == "byte" else BPETokenizer.train(text, bpe_vocab))
        ids = _token_ids(text, tok)
        n_val = int(len(ids) * val_fraction)
        _check_lengths(len(ids) - n_val, n_val, block_size)
        meta = _write_cache(cache, ids, n_val, tok, recipe)
    _check_lengths(meta["n_train"], meta["n_val"], block_size)
    tok = from_spec(meta["tokenizer_spec"])
    dtype = getattr(torch, meta["dtype"])
    splits = {name: torch.from_file(str(cache / f"{name}.bin"), shared=False, size=meta[f"n_{name}"], dtype=dtype)
              for name in ("train", "val")}
    return Corpus(splits["train"], splits["val"], tok, description, fingerprint)


def batch(split: Tensor, *, seed: int, step: int, batch_size: int, block_size: int, part: int = 0,
          parts: int = 1, tag: str = "train") -> tuple[Tensor, Tensor]:
    """Part ``part`` of ``parts`` equal slices of one batch of ``batch_size`` random windows of
    ``split``: inputs and next-token targets, both ``(batch_size // parts, block_size)`` int64.

    The windows depend only on (seed, tag, step): a resumed run reads the rows it would have
    read, and the ranks (and micro-steps) of a distributed run read disjoint slices of the very
    batch a single process would, each touching only its own rows of the memory map.
    """
    if batch_size % parts or not 0 <= part < parts:
        raise ValueError(f"cannot take part {part} of {parts} equal parts of a batch of {batch_size}")
    rows = batch_size // parts
    g = torch.Generator().manual_seed(stream_seed(seed, tag, step))
    starts = torch.randint(0, len(split) - block_size, (batch_size,), generator=g)[part * rows:(part + 1) * rows]
    chunk = torch.stack([split[s:s + block_size + 1] for s in starts.tolist()]).long()  # (rows, block_size + 1)
    return chunk[:, :-1], chunk[:, 1:]


def _read_text(path: Path) -> str:
    raw = path.read_bytes()
    if b"\x00" in raw:
        raise ValueError(f"data file {str(path)!r} looks binary (it contains NUL bytes); give a text file")
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as e:
        bad = raw[e.start:e.start + 1]
        raise ValueError(f"data file {str(path)!r} is not UTF-8 text (byte {e.start} is {bad!r})") from None


def _check_lengths(n_train: int, n_val: int, block_size: int) -> None:
    for name, n in (("train", n_train), ("val", n_val)):
        if n < block_size + 1:
            raise ValueError(f"corpus too short: {n_train + n_val} tokens split into {n_train} train / {n_val} val, "
                             f"but one block of the {name} split needs block_size + 1 = {block_size + 1}; use more "
                             f"text or a smaller --block-size")


def _token_ids(text: str, tok: ByteTokenizer | BPETokenizer) -> Tensor:
    """The ids of ``text`` in the smallest dtype that holds the vocabulary: uint8, uint16, else int32."""
    if isinstance(tok, ByteTokenizer):
        return torch.frombuffer(bytearray(text.encode("utf-8")), dtype=torch.uint8)
    dtype = torch.uint16 if tok.vocab_size <= 65536 else torch.int32
    return torch.tensor(tok.encode(text), dtype=torch.int32).to(dtype)


def _cached(cache: Path, recipe: dict) -> dict | None:
    """The cache's ``meta.json`` when ``recipe`` built it and both splits are whole; else None
    (missing, another recipe, unreadable, or a split cut short: it is rebuilt)."""
    try:
        meta = json.loads((cache / "meta.json").read_text())
        itemsize = getattr(torch, meta["dtype"]).itemsize
        whole = all((cache / f"{name}.bin").stat().st_size == meta[f"n_{name}"] * itemsize for name in ("train", "val"))
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return None
    return meta if whole and meta.get("recipe") == recipe else None


def _write_cache(cache: Path, ids: Tensor, n_val: int, tok: ByteTokenizer | BPETokenizer, recipe: dict) -> dict:
    cache.mkdir(parents=True, exist_ok=True)
    (cache / "meta.json").unlink(missing_ok=True)  # first: splits half rewritten are never taken for the old cache
    meta = {"recipe": recipe, "tokenizer_spec": tok.spec(), "dtype": str(ids.dtype).removeprefix("torch."),
            "n_train": len(ids) - n_val, "n_val": n_val}
    for name, part in (("train", ids[:len(ids) - n_val]), ("val", ids[len(ids) - n_val:])):
        with _files.atomic_path(cache / f"{name}.bin") as tmp, open(tmp, "wb") as f:
            f.write(memoryview(part.numpy()))  # write(), not a memory map: a full disk is an error, not a SIGBUS
    _files.write_text(cache / "meta.json", json.dumps(meta))  # written last: a cache without meta.json is rebuilt
    return meta
