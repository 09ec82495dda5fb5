"""A SentencePiece-style BPE tokenizer (Llama 2's and Mistral's kind), trained here on a small text."""
import json

import tokenizers
from tokenizers import decoders, normalizers, pre_tokenizers, processors

CORPUS = "the cat sat on the mat. the dog sat on the log. hello world, hello there!\n" * 30
TEXTS = ["the cat sat", "hello  world,\n\nthe dog", "emoji 🎉 and ünï 42", " leading space"]
SPECIALS = ["<unk>", "<s>", "</s>"]


def sentencepiece(kind: str):
    """A SentencePiece-style BPE as transformers writes Llama 2's (``legacy``: a normalizer that
    prepends and replaces spaces, a decoder that replaces, falls back to bytes, fuses and strips) or
    newer Mistral's (``metaspace``): byte-fallback tokens <0x00>..<0xFF> in the vocabulary."""
    trainer = tokenizers.trainers.BpeTrainer(vocab_size=120, special_tokens=SPECIALS, show_progress=False)
    base = tokenizers.Tokenizer(tokenizers.models.BPE(unk_token="<unk>"))
    base.pre_tokenizer = pre_tokenizers.Metaspace()
    base.train_from_iterator([CORPUS], trainer)
    model = json.loads(base.to_str())["model"]
    vocab = dict(model["vocab"]) | {f"<0x{b:02X}>": len(model["vocab"]) + b for b in range(256)}
    tok = tokenizers.Tokenizer(tokenizers.models.BPE(vocab, [tuple(m) for m in model["merges"]], unk_token="<unk>",
                                                     byte_fallback=True, fuse_unk=True))
    tok.add_special_tokens(SPECIALS)
    if kind == "legacy":
        tok.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
        tok.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(),
                                         decoders.Strip(" ", 1, 0)])
    else:
        tok.pre_tokenizer = pre_tokenizers.Metaspace(prepend_scheme="first", split=False)
        tok.decoder = decoders.Sequence([decoders.Metaspace(prepend_scheme="first", split=False),
                                         decoders.ByteFallback(), decoders.Fuse()])
    tok.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 1)])
    return tok
