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

Written (:func:`to_metadata`, the inverse, for :mod:`selfattn.formats.gguf_write`): a GGUF source's
``tokenizer.*`` fields copied as they are; else ours: the byte tokenizer as a ``gpt2`` BPE of the 256
bytes without merges (id = byte); a byte-level BPE as ``gpt2`` with its merges, its control tokens typed
so, and ``tokenizer.ggml.pre`` the llama.cpp pre-tokenizer that splits text as its pre-tokenizer does
(:data:`PRE_TOKENIZERS`; another is refused); a SentencePiece tokenizer as ``llama`` with its scores and
types. A vocabulary shorter than the model's is padded with ``[PADi]`` tokens of type unused, as
llama.cpp's converter pads. Either way ``add_bos_token`` and ``add_eos_token`` say what our tokenizer
puts around a prompt, and the bos, eos (a second one as the end-of-turn token) and chat template given
are written.
"""
from __future__ import annotations

import json

from selfattn.tokenizers.bpe import BYTE_LEVEL, BPETokenizer, bytes_to_unicode, import_tokenizers
from selfattn.tokenizers.byte import ByteTokenizer
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


_PROBE = "a"  # a text whose ids show what a tokenizer puts around a prompt
# Hugging Face's pre-tokenizer regexes that llama.cpp has an equal of (src/llama-vocab.cpp quotes them)
_LLAMA3 = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|"
           r"\s*[\r\n]+|\s+(?!\S)|\s+")
_QWEN2 = _LLAMA3.replace(r"\p{N}{1,3}", r"\p{N}")
# a tokenizer.json pre-tokenizer, as its steps (see _steps) -> llama.cpp's tokenizer.ggml.pre that splits alike
PRE_TOKENIZERS = {
    (("ByteLevel", True, False),): "gpt-2",
    (("Digits", True), ("ByteLevel", True, False)): "smollm",
    (("Split", _LLAMA3, "Isolated", False), ("ByteLevel", False, False)): "llama-bpe",
    (("Split", _QWEN2, "Isolated", False), ("ByteLevel", False, False)): "qwen2",
}
# the tokenizer fields of a GGUF source copied into the file (by gguf's names), when it has them
_COPIED = ("MODEL", "PRE", "LIST", "TOKEN_TYPE", "SCORES", "MERGES", "BOS_ID", "EOS_ID", "EOT_ID", "EOM_ID", "UNK_ID",
           "SEP_ID", "PAD_ID", "MASK_ID", "ADD_BOS", "ADD_EOS", "ADD_SEP", "ADD_PREFIX", "REMOVE_EXTRA_WS",
           "CHAT_TEMPLATE")


def to_metadata(tokenizer, vocab: int, *, bos: int | None = None, eos: tuple[int, ...] = (),
                chat_template: str | None = None, source=None, pre: str | None = None) -> dict:
    """The ``tokenizer.*`` fields (gguf's key -> value) of a GGUF file holding a model of ``vocab`` tokens:
    those of ``source`` (a GGUF file's :class:`~selfattn.formats.gguf.Metadata`) copied, else ``tokenizer``'s
    own; with what ``tokenizer`` puts around a prompt, and ``bos``, ``eos`` and ``chat_template`` when given
    (see the module docstring). ``pre``: the ``tokenizer.ggml.pre`` of the GGUF file the tokenizer came from
    (a run fine-tuned from one keeps it), written for a byte-level BPE instead of the one its pre-tokenizer
    maps to (a tokenizer read from GGUF splits as GPT-2, whatever the file's pre). ValueError for a tokenizer
    llama.cpp would split otherwise. Needs ``gguf``."""
    fields = _copied(source) if source is not None else _fields(tokenizer, vocab, pre)
    return fields | _around(tokenizer) | _special(bos, eos, chat_template)


def _fields(tokenizer, vocab: int, carried: str | None = None) -> dict:
    """The ``tokenizer.*`` fields of ``tokenizer`` for a model of ``vocab`` tokens (see the module docstring);
    ``carried``: the pre-tokenizer name of the GGUF file it came from, written as it is."""
    import gguf

    K, T = gguf.Keys.Tokenizer, gguf.TokenType
    if tokenizer.vocab_size > vocab:
        raise ValueError(f"the tokenizer has {tokenizer.vocab_size} tokens but the model only vocab_size={vocab}")
    pad = vocab - tokenizer.vocab_size
    if isinstance(tokenizer, SentencePieceTokenizer):
        spec = tokenizer.spec()
        return {K.MODEL: "llama", K.LIST: spec["tokens"] + _pads(tokenizer.vocab_size, vocab),
                K.SCORES: [float(s) for s in spec["scores"]] + [-1000.0] * pad,
                K.TOKEN_TYPE: spec["types"] + [int(T.UNUSED)] * pad, K.ADD_PREFIX: spec["add_space_prefix"]}
    if isinstance(tokenizer, ByteTokenizer):
        chars = bytes_to_unicode()
        tokens, kinds, merges, pre = [chars[b] for b in range(256)], [int(T.NORMAL)] * 256, [], "gpt-2"
    elif isinstance(tokenizer, BPETokenizer) and tokenizer.scheme == BYTE_LEVEL:
        spec = json.loads(tokenizer.tok.to_str())
        pre = carried or PRE_TOKENIZERS.get(_steps(spec.get("pre_tokenizer")))
        if pre is None:
            raise ValueError(f"the tokenizer's pre-tokenizer {json.dumps(spec.get('pre_tokenizer'))} splits text as "
                             f"none of llama.cpp's known ones does ({', '.join(PRE_TOKENIZERS.values())}), so "
                             f"llama.cpp would tokenize otherwise")
        by_id = {i: piece for piece, i in tokenizer.tok.get_vocab(with_added_tokens=True).items()}
        added = tokenizer.tok.get_added_tokens_decoder()
        tokens = [by_id.get(i, f"[PAD{i}]") for i in range(tokenizer.vocab_size)]
        kinds = [int((T.CONTROL if added[i].special else T.USER_DEFINED) if i in added else
                     T.NORMAL if i in by_id else T.UNUSED) for i in range(tokenizer.vocab_size)]
        merges = [m if isinstance(m, str) else " ".join(m) for m in spec["model"].get("merges", [])]
    else:
        raise ValueError(f"a {tokenizer.__class__.__name__} of SentencePiece-style pieces (a Llama 2 tokenizer.json) "
                         f"is not written to GGUF: llama.cpp reads such a vocabulary with scores")
    return {K.MODEL: "gpt2", K.PRE: pre, K.LIST: tokens + _pads(len(tokens), vocab),
            K.TOKEN_TYPE: kinds + [int(T.UNUSED)] * pad, K.MERGES: merges}


def _pads(start: int, end: int) -> list[str]:
    return [f"[PAD{i}]" for i in range(start, end)]


def _steps(pre: dict | None) -> tuple:
    """A tokenizer.json pre-tokenizer as the steps that say how it splits text (a key of :data:`PRE_TOKENIZERS`)."""
    steps = (pre or {}).get("pretokenizers", [pre]) if (pre or {}).get("type") == "Sequence" else [pre]
    out = []
    for s in steps:
        s = s or {}
        kind = s.get("type")
        out.append((kind, s.get("use_regex", True), s.get("add_prefix_space", True)) if kind == "ByteLevel" else
                   (kind, s.get("individual_digits", False)) if kind == "Digits" else
                   (kind, (s.get("pattern") or {}).get("Regex"), s.get("behavior"), s.get("invert", False))
                   if kind == "Split" else (kind,))
    return tuple(out)


def _around(tokenizer) -> dict:
    """``add_bos_token`` and ``add_eos_token``: whether ``tokenizer`` puts a token before and after a prompt."""
    import gguf

    plain, marked = tokenizer.encode(_PROBE), tokenizer.encode(_PROBE, special=True)
    K = gguf.Keys.Tokenizer
    return {K.ADD_BOS: marked[:1] != plain[:1], K.ADD_EOS: marked[-1:] != plain[-1:]}


def _special(bos: int | None, eos: tuple[int, ...], chat_template: str | None) -> dict:
    """The fields of the bos, the eos (a second one as the end-of-turn token) and the chat template given."""
    import gguf

    K = gguf.Keys.Tokenizer
    given = {K.BOS_ID: bos, K.EOS_ID: eos[0] if eos else None, K.EOT_ID: eos[1] if len(eos) > 1 else None,
             K.CHAT_TEMPLATE: chat_template}
    return {key: value for key, value in given.items() if value is not None}


def _copied(metadata) -> dict:
    """The tokenizer fields of a GGUF file's ``metadata`` (those of :data:`_COPIED` it has), as values."""
    import gguf

    keys = [getattr(gguf.Keys.Tokenizer, name) for name in _COPIED]
    return {key: metadata.value(key) for key in keys if key in metadata}
