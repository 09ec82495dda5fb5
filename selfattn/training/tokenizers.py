"""Tokenizers: text to token ids and back, byte-exactly.

- ``ByteTokenizer``: the 256 byte values of UTF-8; any text in any language round-trips.
- ``BPETokenizer``: byte-level BPE trained locally with the ``tokenizers`` library (nothing is
  downloaded), or read from a ``tokenizer.json`` such as GPT-2's or from a model folder.

Both turn one token into its bytes (``token_bytes``), so text can be streamed token by token
(:func:`selfattn.sampling.text_pieces`), and describe themselves as a JSON-ready ``spec()``
that a checkpoint stores and :func:`from_spec` reads back.
"""
from __future__ import annotations

import os
from pathlib import Path

from selfattn._validate import one_line


class ByteTokenizer:
    """Token id = byte value of the UTF-8 encoding; vocabulary 256."""

    vocab_size = 256

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def decode(self, ids) -> str:
        return b"".join(self.token_bytes(int(i)) for i in ids).decode("utf-8", errors="replace")

    def token_bytes(self, token: int) -> bytes:
        if not 0 <= token < 256:
            raise ValueError(f"byte token {token} is outside 0..255")
        return bytes([token])

    def spec(self) -> dict:
        return {"kind": "byte"}


class BPETokenizer:
    """Byte-level BPE over a ``tokenizers.Tokenizer`` (GPT-2's scheme: bytes mapped to printable
    characters, then merges); ``token_bytes`` undoes the mapping so text streams byte-exactly."""

    def __init__(self, tok):
        self.tok = tok
        self.vocab_size = tok.get_vocab_size()
        self._byte_of = {ch: b for b, ch in _bytes_to_unicode().items()}
        self._special = {t.content for t in tok.get_added_tokens_decoder().values()}  # e.g. <|endoftext|>

    @classmethod
    def train(cls, text: str, vocab_size: int) -> BPETokenizer:
        """Learn ``vocab_size`` tokens (256 bytes + merges) from ``text``, locally."""
        if not isinstance(vocab_size, int) or isinstance(vocab_size, bool) or vocab_size < 257:
            raise ValueError(f"BPE vocab_size must be an int > 256 (the bytes plus merges), got {vocab_size!r}")
        tokenizers = _import_tokenizers()
        tok = _byte_level(tokenizers.Tokenizer(tokenizers.models.BPE()))
        trainer = tokenizers.trainers.BpeTrainer(
            vocab_size=vocab_size, show_progress=False,
            initial_alphabet=tokenizers.pre_tokenizers.ByteLevel.alphabet())
        tok.train_from_iterator(text.split("\n\n"), trainer=trainer)
        return cls(tok)

    @classmethod
    def from_json(cls, text: str, where: str = "tokenizer JSON") -> BPETokenizer:
        """The tokenizer serialised in ``text``; ValueError naming ``where`` it came from when unreadable."""
        tokenizers = _import_tokenizers()
        try:
            return cls(tokenizers.Tokenizer.from_str(text))
        except Exception as e:  # the Rust parser raises a bare Exception
            raise ValueError(f"{where} is not a tokenizer the 'tokenizers' library can read ({one_line(e)})") from None

    @classmethod
    def from_folder(cls, path: str | os.PathLike) -> BPETokenizer:
        """The tokenizer of a ``transformers`` model folder: its ``tokenizer.json``, or GPT-2's
        ``vocab.json`` + ``merges.txt``."""
        tokenizers, folder = _import_tokenizers(), Path(path)
        if (folder / "tokenizer.json").is_file():
            file = folder / "tokenizer.json"
            return cls.from_json(file.read_text(errors="replace"), str(file))
        if (folder / "vocab.json").is_file() and (folder / "merges.txt").is_file():
            try:
                bpe = tokenizers.models.BPE.from_file(str(folder / "vocab.json"), str(folder / "merges.txt"))
            except Exception as e:  # the Rust parser raises a bare Exception
                raise ValueError(f"{folder}: vocab.json + merges.txt cannot be read ({one_line(e)})") from None
            return cls(_byte_level(tokenizers.Tokenizer(bpe)))
        raise ValueError(f"{str(folder)!r} has no tokenizer.json (or vocab.json + merges.txt) beside its weights")

    def token_id(self, piece: str) -> int | None:
        """The id of a token written as the tokenizer stores it (``"<|endoftext|>"``), or None."""
        return self.tok.token_to_id(piece)

    def encode(self, text: str) -> list[int]:
        return self.tok.encode(text, add_special_tokens=False).ids

    def decode(self, ids) -> str:
        return b"".join(self.token_bytes(int(i)) for i in ids).decode("utf-8", errors="replace")

    def token_bytes(self, token: int) -> bytes:
        piece = self.tok.id_to_token(token)
        if piece is None:
            raise ValueError(f"token {token} is outside the BPE vocabulary of {self.vocab_size}")
        if piece in self._special:
            return piece.encode("utf-8")  # special tokens are literal text, not mapped bytes
        return bytes(self._byte_of[ch] for ch in piece)

    def spec(self) -> dict:
        return {"kind": "bpe", "json": self.tok.to_str()}


def from_spec(spec: dict) -> ByteTokenizer | BPETokenizer:
    """The tokenizer a checkpoint describes (the inverse of ``.spec()``)."""
    kind = spec.get("kind")
    if kind == "byte":
        return ByteTokenizer()
    if kind == "bpe":
        return BPETokenizer.from_json(spec["json"])
    raise ValueError(f"unknown tokenizer kind {kind!r}; expected 'byte' or 'bpe'")


def _byte_level(tok):
    """GPT-2's byte-level pre-tokenizer and decoder on a ``tokenizers.Tokenizer``."""
    tokenizers = _import_tokenizers()
    tok.pre_tokenizer = tokenizers.pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = tokenizers.decoders.ByteLevel()
    return tok


def _import_tokenizers():
    try:
        import tokenizers
    except ImportError as e:
        raise ImportError("the BPE tokenizer needs the 'tokenizers' package: pip install 'selfattn[train]'") from e
    return tokenizers


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's map from the 256 byte values to printable characters (the ByteLevel alphabet)."""
    keep = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    shifted = [b for b in range(256) if b not in keep]
    return {**{b: chr(b) for b in keep}, **{b: chr(256 + i) for i, b in enumerate(shifted)}}
