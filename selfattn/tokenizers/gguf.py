"""The tokenizer a GGUF file describes in its metadata, as ``transformers`` builds it from there.

The vocabulary is ``tokenizer.ggml.tokens`` (id = position); the tokens of
``tokenizer.ggml.token_type`` 3 (control: ``<s>``, ``<|im_start|>``) are special, matched whole in
text; ``tokenizer.ggml.add_bos_token`` puts the bos token before a prompt. By ``tokenizer.ggml.model``:

- ``gpt2``: a byte-level BPE, the merges ``tokenizer.ggml.merges`` (``"a b"`` each), GPT-2's
  byte-level pre-tokenizer (Llama 3, Qwen2, SmolLM);
- ``llama``: SentencePiece's BPE (Llama 2, Mistral): ``▁`` for a space (one put first unless
  ``tokenizer.ggml.add_space_prefix`` is false), ``<0xNN>`` tokens for bytes the vocabulary lacks,
  and merges made from ``tokenizer.ggml.scores`` as ``transformers`` makes them: every split of a
  token into two tokens, ranked by the token's score.

Another ``tokenizer.ggml.model`` is refused naming it.
"""
from __future__ import annotations

from selfattn.tokenizers.bpe import BPETokenizer, import_tokenizers

CONTROL = 3  # llama.cpp's token type of control tokens (bos, eos, <|im_start|>)
MODELS = ("gpt2", "llama")  # the tokenizer.ggml.model values read


def from_metadata(metadata) -> BPETokenizer:
    """The tokenizer of a GGUF file's :class:`~selfattn.io.formats.gguf.Metadata`; a ValueError
    naming the file and field when it has none this library reads."""
    where = metadata.path
    model = metadata.value("tokenizer.ggml.model", str)
    if model not in MODELS:
        raise ValueError(f"{where}: tokenizer.ggml.model {model!r} is not supported; this version reads "
                         f"gpt2 (byte-level BPE) and llama (SentencePiece) tokenizers")
    tokens = metadata.value("tokenizer.ggml.tokens", list)
    kinds = metadata.value("tokenizer.ggml.token_type", list, [0] * len(tokens))
    if len(kinds) != len(tokens):
        raise ValueError(f"{where}: tokenizer.ggml.token_type has {len(kinds)} entries for {len(tokens)} tokens")
    tok = _byte_level(metadata, tokens) if model == "gpt2" else _sentencepiece(metadata, tokens)
    tokenizers = import_tokenizers()
    tok.add_special_tokens([tokenizers.AddedToken(t, special=True, normalized=False)
                            for t, kind in zip(tokens, kinds) if kind == CONTROL])
    bos = _token(metadata, "bos", tokens)
    if metadata.value("tokenizer.ggml.add_bos_token", bool, False) and bos is not None:
        tok.post_processor = tokenizers.processors.TemplateProcessing(
            single=f"{tokens[bos]} $A", pair=f"{tokens[bos]} $A $B", special_tokens=[(tokens[bos], bos)])
    return BPETokenizer(tok, str(where))


def _byte_level(metadata, tokens: list[str]):
    """GPT-2's byte-level BPE of the vocabulary ``tokens`` and ``tokenizer.ggml.merges``."""
    tokenizers = import_tokenizers()
    merges = metadata.value("tokenizer.ggml.merges", list)
    pairs = [tuple(m.split(" ")) for m in merges]
    bad = next((m for m, pair in zip(merges, pairs) if len(pair) != 2), None)
    if bad is not None:
        raise ValueError(f"{metadata.path}: tokenizer.ggml.merges holds {bad!r}, not two pieces separated by a space")
    tok = tokenizers.Tokenizer(tokenizers.models.BPE({t: i for i, t in enumerate(tokens)}, pairs))
    tok.pre_tokenizer = tokenizers.pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=False,
                                                            use_regex=True)
    tok.decoder = tokenizers.decoders.ByteLevel()
    return tok


def _sentencepiece(metadata, tokens: list[str]):
    """SentencePiece's BPE of the vocabulary ``tokens``, its merges made from ``tokenizer.ggml.scores``."""
    tokenizers = import_tokenizers()
    from tokenizers import decoders, normalizers

    scores = metadata.value("tokenizer.ggml.scores", list)
    if len(scores) != len(tokens):
        raise ValueError(f"{metadata.path}: tokenizer.ggml.scores has {len(scores)} entries for {len(tokens)} tokens")
    unk = _token(metadata, "unknown", tokens)
    tok = tokenizers.Tokenizer(tokenizers.models.BPE(
        {t: i for i, t in enumerate(tokens)}, _merges(tokens, scores), fuse_unk=True, byte_fallback=True,
        unk_token=None if unk is None else tokens[unk]))
    prefix = metadata.value("tokenizer.ggml.add_space_prefix", bool, True)
    first = [normalizers.Prepend("\u2581")] if prefix else []  # the space put before the text, and taken off
    tok.normalizer = normalizers.Sequence([*first, normalizers.Replace(" ", "\u2581")])
    strip = [decoders.Strip(" ", 1, 0)] if prefix else []
    tok.decoder = decoders.Sequence([decoders.ByteFallback(), decoders.Fuse(), decoders.Replace("\u2581", " "), *strip])
    return tok


def _merges(tokens: list[str], scores: list[float]) -> list[tuple[str, str]]:
    """The merges of a vocabulary that has scores and no merges, as ``transformers`` makes them:
    every split of each token into two tokens (the split of higher-scoring halves first), all of
    them ranked by the score of the token they make (a stable sort)."""
    score = {t: s for t, s in zip(tokens, scores)}
    merges = []
    for piece, rank in score.items():
        splits = [(piece[:i], piece[i:], rank) for i in range(1, len(piece))
                  if piece[:i] in score and piece[i:] in score]
        merges += sorted(splits, key=lambda m: (score[m[0]], score[m[1]]), reverse=True)
    return [(left, right) for left, right, _ in sorted(merges, key=lambda m: m[2], reverse=True)]


def _token(metadata, name: str, tokens: list[str]) -> int | None:
    """The id of ``tokenizer.ggml.<name>_token_id``: None when absent, a ValueError outside the vocabulary."""
    i = metadata.value(f"tokenizer.ggml.{name}_token_id", int, None)
    if i is not None and not 0 <= i < len(tokens):
        raise ValueError(f"{metadata.path}: tokenizer.ggml.{name}_token_id {i} is outside the {len(tokens)} tokens")
    return i
