"""Small GGUF files written as llama.cpp's converter writes them, for the loader's tests: a tiny
random Llama from transformers, its q/k rows interleaved for llama.cpp's RoPE, each tensor in the
type asked for, and a byte-level BPE tokenizer with its chat template in the metadata."""
import json
import re
import struct

import gguf
import numpy as np
import torch
import transformers

from selfattn.tokenizers import BPETokenizer

TEXT = "the cat sat on the mat. the dog sat on the log, 42 times!\n" * 20
SIZES = dict(hidden_size=64, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=128, rms_norm_eps=1e-5, tie_word_embeddings=True,
             bos_token_id=None,
             eos_token_id=None, attn_implementation="eager")
SPECIALS = ["<|im_start|>", "<|im_end|>"]  # control tokens, the last ids of the vocabulary
TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
            "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
_OURS_TO_GGUF = [  # transformers' name pattern -> llama.cpp's
    (r"model\.embed_tokens\.weight", "token_embd.weight"), (r"model\.norm\.weight", "output_norm.weight"),
    (r"lm_head\.weight", "output.weight"), (r"model\.layers\.(\d+)\.input_layernorm\.", r"blk.\1.attn_norm."),
    (r"model\.layers\.(\d+)\.post_attention_layernorm\.", r"blk.\1.ffn_norm."),
    (r"model\.layers\.(\d+)\.self_attn\.([qkv])_proj\.", r"blk.\1.attn_\2."),
    (r"model\.layers\.(\d+)\.self_attn\.o_proj\.", r"blk.\1.attn_output."),
    (r"model\.layers\.(\d+)\.mlp\.(gate|up|down)_proj\.", r"blk.\1.ffn_\2."),
]


def tokenizer() -> tuple[list[str], list[str], list[int]]:
    """(tokens, merges, token types) of a byte-level BPE trained on TEXT, the specials last."""
    bpe = BPETokenizer.train(TEXT, vocab_size=300)
    model = json.loads(bpe.tok.to_str())["model"]
    tokens = sorted(model["vocab"], key=model["vocab"].get) + SPECIALS
    merges = [m if isinstance(m, str) else " ".join(m) for m in model["merges"]]
    return tokens, merges, [1] * (len(tokens) - len(SPECIALS)) + [3] * len(SPECIALS)


def random_llama(vocab_size: int, prefix: str = "Llama", **overrides):
    """transformers' Llama (or another family of the same names: ``prefix`` "Qwen2") in eval mode,
    every weight scrambled so a misplaced row shows."""
    config = getattr(transformers, f"{prefix}Config")(vocab_size=vocab_size, **{**SIZES, **overrides})
    torch.manual_seed(0)
    hf = getattr(transformers, f"{prefix}ForCausalLM")(config).eval()
    with torch.no_grad():
        for name, p in hf.named_parameters():
            p.copy_(torch.randn_like(p) * 0.1 + 1.0 if "norm" in name else torch.randn_like(p) * 0.2)
    return hf


def interleave(w: np.ndarray, heads: int) -> np.ndarray:
    """llama.cpp's converter's permutation of q/k rows (its ``LlamaModel.permute``)."""
    return w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def gguf_name(name: str) -> str:
    for pattern, theirs in _OURS_TO_GGUF:
        if re.match(pattern, name):
            return re.sub(pattern, theirs, name)
    raise AssertionError(f"no GGUF name for {name}")


def write(path, hf, *, types=None, arch="llama", metadata=None, tensors=None, drop=(), sentencepiece=None):
    """Write ``hf`` (a transformers Llama) as llama.cpp would, to ``path``: ``types`` maps a GGUF
    name pattern to the tensor's type (default F32); ``metadata`` adds or replaces fields
    ({key: (value, GGUFValueType)}); ``tensors`` replaces or adds tensors by GGUF name (numpy
    arrays or (raw bytes, type)); ``drop``: GGUF names left out; ``sentencepiece``: (tokens, scores,
    types) of a ``llama`` tokenizer (bos 1, eos 2) written instead of the byte-level BPE."""
    c, (tokens, merges, kinds) = hf.config, tokenizer()
    w = gguf.GGUFWriter(str(path), arch)
    w.add_block_count(c.num_hidden_layers)
    w.add_context_length(c.max_position_embeddings)
    w.add_embedding_length(c.hidden_size)
    w.add_feed_forward_length(c.intermediate_size)
    w.add_head_count(c.num_attention_heads)
    w.add_head_count_kv(c.num_key_value_heads)
    w.add_layer_norm_rms_eps(c.rms_norm_eps)
    w.add_rope_freq_base(c.rope_parameters["rope_theta"])
    w.add_rope_dimension_count(c.hidden_size // c.num_attention_heads)
    w.add_vocab_size(c.vocab_size)
    if sentencepiece is None:
        w.add_tokenizer_model("gpt2")
        w.add_token_merges(merges)
    else:
        tokens, scores, kinds = sentencepiece
        w.add_tokenizer_model("llama")
        w.add_token_scores(scores)
        w.add_unk_token_id(0)
    w.add_token_list(tokens)
    w.add_token_types(kinds)
    bos, eos = (len(tokens) - 2, len(tokens) - 1) if sentencepiece is None else (1, 2)
    w.add_bos_token_id(bos)
    w.add_eos_token_id(eos)
    w.add_chat_template(TEMPLATE)
    for key, (value, kind) in (metadata or {}).items():
        w.add_key_value(key, value, kind)
    arrays = {}
    for name, t in hf.state_dict().items():
        if name == "lm_head.weight" and c.tie_word_embeddings:
            continue
        a = t.float().numpy()
        if arch == "llama" and (".q_proj." in name or ".k_proj." in name):
            a = interleave(a, c.num_attention_heads if ".q_proj." in name else c.num_key_value_heads)
        arrays[gguf_name(name)] = a
    arrays |= tensors or {}
    for name, a in arrays.items():
        if name in drop:
            continue
        if isinstance(a, tuple):  # raw bytes of a type numpy cannot quantise to
            w.add_tensor(name, a[0], raw_dtype=a[1])
            continue
        qtype = next((q for pattern, q in (types or {}).items() if re.fullmatch(pattern, name)),
                     gguf.GGMLQuantizationType.F32)
        w.add_tensor(name, gguf.quants.quantize(a, qtype) if a.dtype == np.float32 else a, raw_dtype=qtype
                     if a.dtype == np.float32 else None)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def random_blocks(rows: int, cols: int, qtype) -> tuple[np.ndarray, object]:
    """Random bytes as ``rows`` x ``cols`` values of a K-quant (Q4_K or Q6_K), their fp16 scales sane."""
    block, size = gguf.GGML_QUANT_SIZES[qtype]
    raw = np.random.default_rng(0).integers(0, 256, (rows, cols // block, size), dtype=np.uint8)
    scales = np.full((rows, cols // block), 0.01, np.float16).view(np.uint8).reshape(rows, cols // block, 2)
    if qtype == gguf.GGMLQuantizationType.Q6_K:
        raw[..., -2:] = scales  # d, last
    else:
        raw[..., 0:2], raw[..., 2:4] = scales, scales  # d and dmin, first
    return raw.reshape(rows, -1), qtype


def field_offset(path, key: str) -> int:
    """Where the value of metadata field ``key`` starts in the GGUF file at ``path`` (an array's: the
    type of its entries, a uint32, then its length, a uint64); ``GGUF.tensor_count`` and
    ``GGUF.kv_count`` are the header's uint64s."""
    field = gguf.GGUFReader(path).fields[key]
    return field.offset + (0 if key.startswith("GGUF.") else 8 + len(key.encode()) + 4)


def tensor_offset(path, name: str, part: str) -> int:
    """Where tensor ``name``'s description in the GGUF file at ``path`` has its ``part``: "shape" (its
    first, innermost dimension, a uint64) or "type" (a uint32)."""
    t = next(t for t in gguf.GGUFReader(path).tensors if t.name == name)
    shape = t.field.offset + 8 + len(name.encode()) + 4
    return shape if part == "shape" else shape + 8 * len(t.shape)


def overwrite(path, offset: int, fmt: str, value):
    """``path``, its bytes at ``offset`` overwritten with ``value`` packed little-endian as ``struct``'s ``fmt``."""
    with open(path, "r+b") as f:
        f.seek(offset)
        f.write(struct.pack("<" + fmt, value))
    return path
