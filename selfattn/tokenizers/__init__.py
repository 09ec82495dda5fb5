"""Tokenizers: text to token ids and back, byte-exactly, and the chat templates that turn a
conversation into text.

- :mod:`~selfattn.tokenizers.byte`: ``ByteTokenizer``, the 256 byte values of UTF-8;
- :mod:`~selfattn.tokenizers.bpe`: ``BPETokenizer`` over a ``tokenizers.Tokenizer``: byte-level
  BPE (GPT-2, Llama 3, Qwen2, SmolLM) trained locally or read from a ``tokenizer.json``, and the
  SentencePiece-style pieces of Llama 2 and Mistral (``▁`` for a space, ``<0xNN>`` byte tokens);
- :mod:`~selfattn.tokenizers.sentencepiece`: ``SentencePieceTokenizer``, llama.cpp's SPM tokenizer
  (the ``llama`` tokenizer of GGUF files: Llama 2, Mistral, Gemma), id for id;
- :mod:`~selfattn.tokenizers.gguf`: the tokenizer a GGUF file describes in its metadata;
- :mod:`~selfattn.tokenizers.chat`: chat templates, rendered as ``transformers`` renders them.

Every tokenizer turns one token into its bytes (``token_bytes``), so text can be decoded token by
token as it is generated (:func:`selfattn.generation.text.text_pieces`), and describes itself as a
JSON-ready ``spec()`` that a checkpoint stores and :func:`from_spec` reads back.
"""
from __future__ import annotations

from selfattn.tokenizers.bpe import BPETokenizer
from selfattn.tokenizers.byte import ByteTokenizer
from selfattn.tokenizers.sentencepiece import SentencePieceTokenizer

__all__ = ["BPETokenizer", "ByteTokenizer", "SentencePieceTokenizer", "from_spec"]


def from_spec(spec: dict) -> ByteTokenizer | BPETokenizer | SentencePieceTokenizer:
    """The tokenizer a checkpoint describes (the inverse of ``.spec()``)."""
    kind = spec.get("kind")
    if kind == "byte":
        return ByteTokenizer()
    if kind == "bpe":
        return BPETokenizer.from_json(spec["json"])
    if kind == "sentencepiece":
        return SentencePieceTokenizer.from_spec(spec)
    raise ValueError(f"unknown tokenizer kind {kind!r}; expected 'byte', 'bpe' or 'sentencepiece'")
