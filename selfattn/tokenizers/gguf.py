"""The tokenizer a GGUF file describes in its metadata, as ``transformers`` builds it from there.

``tokenizer.ggml.model`` ``gpt2`` is a byte-level BPE: the vocabulary ``tokenizer.ggml.tokens``
(id = position), the merges ``tokenizer.ggml.merges`` (``"a b"`` each), GPT-2's byte-level
pre-tokenizer; the tokens of ``tokenizer.ggml.token_type`` 3 (control: ``<|im_start|>``) are
special, matched whole in text. ``tokenizer.ggml.add_bos_token`` puts the bos token before a prompt.
Another ``tokenizer.ggml.model`` (``llama``'s SentencePiece scores, say) is refused naming it.
"""
from __future__ import annotations

from selfattn.tokenizers.bpe import BPETokenizer, import_tokenizers

CONTROL = 3  # llama.cpp's token type of control tokens (bos, eos, <|im_start|>)
MODELS = ("gpt2",)  # the tokenizer.ggml.model values read


def from_metadata(metadata) -> BPETokenizer:
    """The tokenizer of a GGUF file's :class:`~selfattn.formats.gguf.Metadata`; a ValueError
    naming the file and field when it has none this library reads."""
    where = metadata.path
    model = metadata.value("tokenizer.ggml.model", str)
    if model not in MODELS:
        raise ValueError(f"{where}: tokenizer.ggml.model {model!r} is not supported; this version reads "
                         f"{', '.join(MODELS)} (byte-level BPE) tokenizers")
    tokens = metadata.value("tokenizer.ggml.tokens", list)
    merges = metadata.value("tokenizer.ggml.merges", list)
    kinds = metadata.value("tokenizer.ggml.token_type", list, [0] * len(tokens))
    if len(kinds) != len(tokens) or len(set(tokens)) != len(tokens):
        raise ValueError(f"{where}: tokenizer.ggml.token_type has {len(kinds)} entries for {len(tokens)} tokens "
                         f"({len(set(tokens))} distinct)")
    pairs = [tuple(m.split(" ")) for m in merges]
    bad = next((m for m, pair in zip(merges, pairs) if len(pair) != 2), None)
    if bad is not None:
        raise ValueError(f"{where}: tokenizer.ggml.merges holds {bad!r}, not two pieces separated by a space")
    tokenizers = import_tokenizers()
    tok = tokenizers.Tokenizer(tokenizers.models.BPE({t: i for i, t in enumerate(tokens)}, pairs))
    tok.pre_tokenizer = tokenizers.pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=False,
                                                            use_regex=True)
    tok.decoder = tokenizers.decoders.ByteLevel()
    tok.add_special_tokens([tokenizers.AddedToken(t, special=True, normalized=False)
                            for t, kind in zip(tokens, kinds) if kind == CONTROL])
    bos = metadata.value("tokenizer.ggml.bos_token_id", int, None)
    if metadata.value("tokenizer.ggml.add_bos_token", bool, False) and bos is not None:
        tok.post_processor = tokenizers.processors.TemplateProcessing(
            single=f"{tokens[bos]} $A", pair=f"{tokens[bos]} $A $B", special_tokens=[(tokens[bos], bos)])
    return BPETokenizer(tok, str(where))
