"""Corpora: text in, memory-mapped token ids out (tokenizers: :mod:`selfattn.tokenizers`).

- ``read_corpus(path)``: a text file, a folder of text files, or (``None``) the built-in
  corpus, the documentation that ships inside Python's standard library
  (``pydoc_data.topics``, ~465 KB of English).
- ``prepare(...)``: tokenizes a corpus once, splits train/val and caches both as flat files
  in the run folder, opened memory-mapped; later calls reuse the cache.
- ``batch(...)``: the rows of one training step, a pure function of (seed, step), so a
  resumed run and every rank of a distributed one read exactly the rows they should.
- the cache itself (``read_cache``, ``write_cache``, ``open_arrays``): named arrays written atomically
  beside a ``meta.json`` holding the recipe that built them; chat data (:mod:`selfattn.training.chat`)
  keeps its rows in the same kind of cache.

A corpus, text (:class:`Corpus`) or chat (:class:`selfattn.training.chat.ChatCorpus`), offers the
training loop one interface: ``.batch(split, seed=, step=, batch_size=, part=, parts=)`` returning
``(x, y, doc_ids or None)``, ``.n_train`` / ``.n_val`` tokens, ``.tokenizer``, ``.description``,
``.fingerprint`` and ``.block_size``.
"""
from __future__ import annotations

import hashlib
import importlib
import json
import math
import os
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import Tensor

from selfattn._util import files as _files
from selfattn._util import progress
from selfattn._util.seeds import seed_for
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
    block_size: int  # the tokens of a row :meth:`batch` returns

    @property
    def n_train(self) -> int:
        return len(self.train)

    @property
    def n_val(self) -> int:
        return len(self.val)

    def batch(self, split: str, *, seed: int, step: int, batch_size: int, part: int = 0,
              parts: int = 1) -> tuple[Tensor, Tensor, None]:
        """:func:`batch` of split ``split`` (``"train"`` or ``"val"``, also a part of its
        generator's seed) in rows of ``block_size``: ``(x, y, None)``, no doc ids (a window is one text)."""
        if split not in ("train", "val"):
            raise ValueError(f"split must be 'train' or 'val', got {split!r}")
        x, y = batch(getattr(self, split), seed=seed, step=step, batch_size=batch_size, block_size=self.block_size,
                     part=part, parts=parts, tag=split)
        return x, y, None


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
    fingerprint = check_fingerprint(text, description, trained_on)
    cache = Path(cache_dir)
    name = tokenizer if given is None else "given " + spec_digest(given.spec())
    recipe = {"fingerprint": fingerprint, "tokenizer": name,
              "bpe_vocab": bpe_vocab if tokenizer == "bpe" else None, "val_fraction": val_fraction}
    meta = read_cache(cache, recipe)
    if meta is None:
        size = f"{len(text) / 1e6:.1f}M characters" if len(text) >= 1e6 else f"{len(text):,} characters"
        if given is None and tokenizer == "bpe":
            with progress.stage(f"training a BPE tokenizer on {size}"):
                tok = BPETokenizer.train(text, bpe_vocab)
        else:
            tok = given or ByteTokenizer()
        with progress.stage(f"tokenizing {size}"):
            ids = _token_ids(text, tok)
        n_train = len(ids) - int(len(ids) * val_fraction)
        _check_lengths(n_train, len(ids) - n_train, block_size)
        with progress.stage(f"writing the token cache ({len(ids):,} tokens)"):
            meta = write_cache(cache, {"train": ids[:n_train], "val": ids[n_train:]},
                               {"recipe": recipe, "tokenizer_spec": tok.spec()})
    splits = open_arrays(cache, meta)
    _check_lengths(len(splits["train"]), len(splits["val"]), block_size)
    return Corpus(splits["train"], splits["val"], from_spec(meta["tokenizer_spec"]), description, fingerprint,
                  block_size)


def check_fingerprint(text: str, description: str, trained_on: str | None) -> str:
    """The SHA-256 of ``text``; a ValueError when it is not ``trained_on`` (the corpus of a resumed run)."""
    fingerprint = hashlib.sha256(text.encode("utf-8")).hexdigest()
    if trained_on is not None and fingerprint != trained_on:
        raise ValueError(f"the corpus ({description}, SHA-256 {fingerprint[:12]}...) is not the one this run was "
                         f"trained on (SHA-256 {trained_on[:12]}...); nothing was written")
    return fingerprint


def spec_digest(spec) -> str:
    """16 hex digits naming a JSON-ready value (a tokenizer's ``spec()``) in a cache's recipe."""
    return hashlib.sha256(json.dumps(spec, sort_keys=True).encode()).hexdigest()[:16]


def batch(split: Tensor, *, seed: int, step: int, batch_size: int, block_size: int, part: int = 0,
          parts: int = 1, tag: str = "train") -> tuple[Tensor, Tensor]:
    """Part ``part`` of ``parts`` equal slices of one batch of ``batch_size`` random windows of
    ``split``: inputs and next-token targets, both ``(batch_size // parts, block_size)`` int64.

    The windows depend only on (seed, tag, step): a resumed run reads the rows it would have
    read, and the ranks (and micro-steps) of a distributed run read disjoint slices of the very
    batch a single process would, each touching only its own rows of the memory map.
    """
    mine = part_of(batch_size, part, parts)
    g = torch.Generator().manual_seed(seed_for(seed, tag, step))
    starts = torch.randint(0, len(split) - block_size, (batch_size,), generator=g)[mine]
    chunk = torch.stack([split[s:s + block_size + 1] for s in starts.tolist()]).long()  # (rows, block_size + 1)
    return chunk[:, :-1], chunk[:, 1:]


def part_of(batch_size: int, part: int, parts: int) -> slice:
    """The rows of part ``part`` of ``parts`` equal slices of a batch of ``batch_size`` rows."""
    if batch_size % parts or not 0 <= part < parts:
        raise ValueError(f"cannot take part {part} of {parts} equal parts of a batch of {batch_size}")
    rows = batch_size // parts
    return slice(part * rows, (part + 1) * rows)


def id_dtype(vocab_size: int) -> torch.dtype:
    """The smallest dtype the cache stores ids below ``vocab_size`` in: uint8, uint16, else int32."""
    return torch.uint8 if vocab_size <= 256 else torch.uint16 if vocab_size <= 65536 else torch.int32


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
    """The ids of ``text`` in the smallest dtype that holds the vocabulary (:func:`id_dtype`)."""
    if isinstance(tok, ByteTokenizer):
        return torch.frombuffer(bytearray(text.encode("utf-8")), dtype=torch.uint8)
    return torch.tensor(tok.encode(text), dtype=torch.int32).to(id_dtype(tok.vocab_size))


def read_cache(cache: Path, recipe: dict) -> dict | None:
    """The cache's ``meta.json`` when ``recipe`` built it and every array it lists is whole; else None
    (missing, another recipe, unreadable, or an array cut short: it is rebuilt)."""
    try:
        meta = json.loads((cache / "meta.json").read_text())
        whole = all((cache / f"{name}.bin").stat().st_size == _nbytes(a) for name, a in meta["arrays"].items())
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return None
    return meta if whole and meta.get("recipe") == recipe else None


def write_cache(cache: Path, arrays: dict[str, Tensor], meta: dict) -> dict:
    """Write each array of ``arrays`` to ``<name>.bin`` (its raw values, atomically), then
    ``meta.json``: ``meta`` (with the ``"recipe"`` :func:`read_cache` compares) plus each array's
    dtype and shape under ``"arrays"``. Returns what ``meta.json`` holds."""
    cache.mkdir(parents=True, exist_ok=True)
    (cache / "meta.json").unlink(missing_ok=True)  # first: arrays half rewritten are never taken for the old cache
    meta = {**meta, "arrays": {name: {"dtype": str(a.dtype).removeprefix("torch."), "shape": list(a.shape)}
                               for name, a in arrays.items()}}
    for name, a in arrays.items():  # write(), not a memory map: a full disk is an error, not a SIGBUS
        with _files.atomic_path(cache / f"{name}.bin") as tmp, open(tmp, "wb") as f:
            f.write(memoryview(a.contiguous().flatten().numpy()))
    _files.write_text(cache / "meta.json", json.dumps(meta))  # written last: a cache without meta.json is rebuilt
    return meta


def open_arrays(cache: Path, meta: dict) -> dict[str, Tensor]:
    """Every array ``meta`` (from :func:`read_cache` or :func:`write_cache`) lists, memory-mapped, in its shape."""
    return {name: torch.from_file(str(cache / f"{name}.bin"), shared=False, size=math.prod(a["shape"]),
                                  dtype=getattr(torch, a["dtype"])).view(a["shape"])
            for name, a in meta["arrays"].items()}


def _nbytes(array: dict) -> int:
    """The bytes of an array as ``meta.json`` lists it (``{"dtype", "shape"}``)."""
    return math.prod(array["shape"]) * getattr(torch, array["dtype"]).itemsize
