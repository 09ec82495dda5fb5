"""``BPETokenizer``: a ``tokenizers.Tokenizer`` whose tokens decode one at a time, byte-exactly.

Two ways of writing a token's bytes as its piece are read, told apart by the tokenizer's decoder:

- byte-level (GPT-2's scheme, also Llama 3's, Qwen2's, SmolLM's): each byte is mapped to one
  printable character (``Ġ`` for a space), and the merges join them; ``token_bytes`` undoes the map;
- SentencePiece-style (Llama 2's, Mistral's; a ``Metaspace`` decoder, or one that replaces ``▁``
  and falls back to bytes): ``▁`` stands for a space, ``<0xNN>`` for a byte the vocabulary lacks.

A tokenizer of another kind (WordPiece, say) is not one :class:`BPETokenizer` can decode token by token:
:func:`scheme` says None for it. Special and added tokens (``<|endoftext|>``, ``<|im_start|>``)
are literal text. Byte-level BPE is trained locally with the ``tokenizers`` library (nothing is
downloaded), or read from a ``tokenizer.json`` such as GPT-2's or from a model folder.
"""
from __future__ import annotations

import json
import os
import re
from pathlib import Path

from selfattn._util.jsonfile import text
from selfattn._util.validate import one_line

BYTE_LEVEL, SENTENCEPIECE = "byte-level", "sentencepiece"  # the two schemes token_bytes reads
_BYTE_PIECE = re.compile(r"<0x([0-9A-Fa-f]{2})>")  # SentencePiece's byte fallback tokens
SPACE = "\u2581"  # ▁, SentencePiece's space


class BPETokenizer:
    """A ``tokenizers.Tokenizer`` whose tokens turn into bytes one at a time (``token_bytes``), so
    text decodes token by token, byte-exactly; refused (ValueError) when :func:`scheme` does not know its pieces."""

    def __init__(self, tok, where: str = "the tokenizer"):
        self.tok = tok
        self.vocab_size = tok.get_vocab_size()
        self.scheme = scheme(tok)
        if self.scheme is None:
            raise ValueError(f"{where} writes its tokens neither as byte-level BPE nor SentencePiece-style "
                             f"pieces (its decoder is {_decoder_names(tok)}), so it cannot decode text token by token")
        self._byte_of = {ch: b for b, ch in bytes_to_unicode().items()}
        self._special = {t.content for t in tok.get_added_tokens_decoder().values()}  # e.g. <|endoftext|>

    @classmethod
    def train(cls, text: str, vocab_size: int) -> BPETokenizer:
        """Learn ``vocab_size`` tokens (256 bytes + merges) from ``text``, locally."""
        if not isinstance(vocab_size, int) or isinstance(vocab_size, bool) or vocab_size < 257:
            raise ValueError(f"BPE vocab_size must be an int > 256 (the bytes plus merges), got {vocab_size!r}")
        tokenizers = import_tokenizers()
        tok = _byte_level(tokenizers.Tokenizer(tokenizers.models.BPE()))
        trainer = tokenizers.trainers.BpeTrainer(
            vocab_size=vocab_size, show_progress=False,
            initial_alphabet=tokenizers.pre_tokenizers.ByteLevel.alphabet())
        tok.train_from_iterator(text.split("\n\n"), trainer=trainer)
        return cls(tok)

    @classmethod
    def from_json(cls, text: str, where: str = "tokenizer JSON") -> BPETokenizer:
        """The tokenizer serialised in ``text``; ValueError naming ``where`` it came from when unreadable."""
        return cls(parse(text, where), where)

    @classmethod
    def from_folder(cls, path: str | os.PathLike) -> BPETokenizer:
        """The tokenizer of a ``transformers`` model folder: its ``tokenizer.json``, or GPT-2's
        ``vocab.json`` + ``merges.txt``."""
        tokenizers, folder = import_tokenizers(), Path(path)
        if (folder / "tokenizer.json").is_file():
            file = folder / "tokenizer.json"
            return cls(read(file), str(file))
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

    def piece(self, token: int) -> str:
        """The text of ``token`` as the tokenizer stores it (``"<|im_start|>"``, ``"Ġthe"``)."""
        piece = self.tok.id_to_token(token)
        if piece is None:
            raise ValueError(f"token {token} is outside the BPE vocabulary of {self.vocab_size}")
        return piece

    def encode(self, text: str, *, special: bool = False) -> list[int]:
        """The ids of ``text``, special tokens written in it (``<|im_start|>``) matched as such;
        ``special``: with the tokens the tokenizer puts around a prompt (Llama's bos) as well."""
        return self.tok.encode(text, add_special_tokens=special).ids

    def decode(self, ids) -> str:
        return b"".join(self.token_bytes(int(i)) for i in ids).decode("utf-8", errors="replace")

    def token_bytes(self, token: int) -> bytes:
        piece = self.piece(token)
        if piece in self._special:
            return piece.encode("utf-8")  # special tokens are literal text, not mapped bytes
        if self.scheme == BYTE_LEVEL:
            return bytes(self._byte_of[ch] for ch in piece)
        byte = _BYTE_PIECE.fullmatch(piece)
        return bytes([int(byte.group(1), 16)]) if byte else piece.replace(SPACE, " ").encode("utf-8")

    def spec(self) -> dict:
        return {"kind": "bpe", "json": self.tok.to_str()}


def read(file: Path):
    """The ``tokenizers.Tokenizer`` of a ``tokenizer.json`` file; a ValueError naming it when it is
    not UTF-8 (and the offset of its first byte that is not) or not a tokenizer."""
    return parse(text(file), str(file))


def parse(serialised: str, where: str):
    """The ``tokenizers.Tokenizer`` serialised in ``serialised``; ValueError naming ``where`` when unreadable."""
    tokenizers = import_tokenizers()
    try:
        return tokenizers.Tokenizer.from_str(serialised)
    except Exception as e:  # the Rust parser raises a bare Exception
        raise ValueError(f"{where} is not a tokenizer the 'tokenizers' library can read ({one_line(e)})") from None


def scheme(tok) -> str | None:
    """How ``tok`` writes a token's bytes as its piece: :data:`BYTE_LEVEL`, :data:`SENTENCEPIECE`,
    or None for a kind :class:`BPETokenizer` does not decode token by token. Told by the decoder, which undoes it."""
    decoders = _decoders(tok)
    types = {d.get("type") for d in decoders}
    if "ByteLevel" in types:
        return BYTE_LEVEL
    spaces = any(d.get("type") == "Replace" and d.get("pattern") == {"String": SPACE} for d in decoders)
    return SENTENCEPIECE if spaces or types & {"Metaspace", "ByteFallback"} else None


def _decoders(tok) -> list[dict]:
    """``tok``'s decoder and the decoders a ``Sequence`` of them holds, as their JSON."""
    found, todo = [], [json.loads(tok.to_str()).get("decoder") or {}]
    while todo:
        found.append(todo.pop())
        todo += found[-1].get("decoders") or []
    return [d for d in found if d]


def _decoder_names(tok) -> str:
    return ", ".join(sorted({str(d.get("type")) for d in _decoders(tok)})) or "none"


def _byte_level(tok):
    """GPT-2's byte-level pre-tokenizer and decoder on a ``tokenizers.Tokenizer``."""
    tokenizers = import_tokenizers()
    tok.pre_tokenizer = tokenizers.pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = tokenizers.decoders.ByteLevel()
    return tok


def import_tokenizers():
    try:
        import tokenizers
    except ImportError as e:
        raise ImportError("the BPE tokenizer needs the 'tokenizers' package: pip install 'selfattn[train]'") from e
    return tokenizers


def bytes_to_unicode() -> dict[int, str]:
    """GPT-2's map from the 256 byte values to printable characters (the ByteLevel alphabet)."""
    keep = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    shifted = [b for b in range(256) if b not in keep]
    return {**{b: chr(b) for b in keep}, **{b: chr(256 + i) for i, b in enumerate(shifted)}}
