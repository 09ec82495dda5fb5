"""The tokenizer a GGUF file describes in its metadata, as llama.cpp reads it.

The vocabulary is ``tokenizer.ggml.tokens`` (id = position), typed by ``tokenizer.ggml.token_type``
(llama.cpp's types; none: all normal). By ``tokenizer.ggml.model``:

- ``gpt2``: a :class:`~selfattn.tokenizers.bpe.BPETokenizer`, byte-level BPE with the merges
  ``tokenizer.ggml.merges`` (``"a b"`` each) and GPT-2's byte-level pre-tokenizer (Llama 3, Qwen2,
  SmolLM), as ``transformers`` builds it; the control tokens (type 3: ``<|im_start|>``) are special,
  matched whole in text; ``tokenizer.ggml.add_bos_token`` (default false) puts the bos before a prompt;
- ``llama``: a :class:`~selfattn.tokenizers.sentencepiece.SentencePieceTokenizer`, llama.cpp's SPM
  tokenizer (Llama 2, Mistral, Gemma) of the tokens and ``tokenizer.ggml.scores``, with llama.cpp's
  defaults: ``tokenizer.ggml.add_space_prefix`` true, ``add_bos_token`` true, ``add_eos_token`` false.

Another ``tokenizer.ggml.model`` is refused naming it.
"""
from __future__ import annotations

from selfattn.tokenizers.bpe import BPETokenizer, import_tokenizers
from selfattn.tokenizers.sentencepiece import CONTROL, NORMAL, SentencePieceTokenizer

MODELS = ("gpt2", "llama")  # the tokenizer.ggml.model values read


def from_metadata(metadata) -> BPETokenizer | SentencePieceTokenizer:
    """The tokenizer of a GGUF file's :class:`~selfattn.formats.gguf.Metadata`; a ValueError
    naming the file and field when it has none this library reads."""
    where = metadata.path
    model = metadata.value("tokenizer.ggml.model", str)
    if model not in MODELS:
        raise ValueError(f"{where}: tokenizer.ggml.model {model!r} is not supported; this version reads "
                         f"gpt2 (byte-level BPE) and llama (SentencePiece) tokenizers")
    tokens = metadata.value("tokenizer.ggml.tokens", list)
    kinds = metadata.value("tokenizer.ggml.token_type", list, [NORMAL] * len(tokens))
    if len(kinds) != len(tokens):
        raise ValueError(f"{where}: tokenizer.ggml.token_type has {len(kinds)} entries for {len(tokens)} tokens")
    if model == "llama":
        return _sentencepiece(metadata, tokens, kinds)
    tok = _byte_level(metadata, tokens)
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


def _sentencepiece(metadata, tokens: list[str], kinds: list[int]) -> SentencePieceTokenizer:
    """llama.cpp's SPM tokenizer of the vocabulary ``tokens`` and ``tokenizer.ggml.scores``."""
    scores = metadata.value("tokenizer.ggml.scores", list)
    if len(scores) != len(tokens):
        raise ValueError(f"{metadata.path}: tokenizer.ggml.scores has {len(scores)} entries for {len(tokens)} tokens")
    around = {name: _token(metadata, name, tokens) if metadata.value(f"tokenizer.ggml.add_{name}_token", bool, add)
              else None for name, add in (("bos", True), ("eos", False))}
    return SentencePieceTokenizer(tokens, scores, kinds, **around, where=str(metadata.path),
                                  add_space_prefix=metadata.value("tokenizer.ggml.add_space_prefix", bool, True))


def _token(metadata, name: str, tokens: list[str]) -> int | None:
    """The id of ``tokenizer.ggml.<name>_token_id``: None when absent, a ValueError outside the vocabulary."""
    i = metadata.value(f"tokenizer.ggml.{name}_token_id", int, None)
    if i is not None and not 0 <= i < len(tokens):
        raise ValueError(f"{metadata.path}: tokenizer.ggml.{name}_token_id {i} is outside the {len(tokens)} tokens")
    return i
