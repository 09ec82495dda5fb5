"""Llama, Mistral, Qwen2 and Qwen3 (``model_type`` llama, mistral, qwen2, qwen3): one mapping.

The four are one decoder: RMSNorm before attention, before the MLP and at the end; rotate-half
RoPE of base ``rope_theta`` (with its scaling rule: linear, llama3, yarn, longrope); grouped-query
attention (``num_key_value_heads``); a SwiGLU MLP of ``intermediate_size``; no position
embeddings; and one naming of the weights. They differ in data only, kept in the tables below:
where the biases are, which layers slide over a window (Mistral: every layer, by
``sliding_window``; Qwen: the ``layer_types`` layers, with ``use_sliding_window``), q/k norms per
head (Qwen3), and what ``transformers`` assumes for a key ``config.json`` leaves out.

Weights: ``q_proj``, ``k_proj``, ``v_proj`` stack (rows) into our fused ``qkv``, ``o_proj`` is
``proj``, ``gate_proj`` and ``up_proj`` into ``gate_up_proj``, the norms are ``ln_1``, ``ln_2``,
``ln_f``.

GGUF (llama.cpp's architectures llama, which Mistral's converter writes too, qwen2 and qwen3, :data:`GGUF`):
the converter interleaves a Llama's q/k rows for llama.cpp's RoPE and writes Llama 3's RoPE rule as one factor
per frequency (``rope_freqs``). What llama.cpp cannot represent: a sliding window (its llama, qwen2 and qwen3
read none, so a Mistral or Qwen file attends to all of its context); Qwen3's ``attention_bias`` (its qwen3
has no ``o_proj`` bias); RoPE on part of a Llama's heads (its llama refuses it); YaRN's ``beta_fast``,
``beta_slow``, ``attention_factor`` and ``truncate`` (it computes 32, 1, its own factor and truncated ends).
"""
from __future__ import annotations

import re

from selfattn.config import GPTConfig
from selfattn.families import _config, _gguf, _names

MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3")

# what transformers' config classes assume for a key that config.json leaves out
_COMMON = dict(num_key_value_heads=None, head_dim=None, hidden_act="silu", rms_norm_eps=1e-6,
               tie_word_embeddings=False, rope_theta=10000.0)
_QWEN = dict(_COMMON, num_key_value_heads=32, max_position_embeddings=32768, use_sliding_window=False,
             sliding_window=4096, max_window_layers=28)
_DEFAULTS = {
    "llama": dict(_COMMON, max_position_embeddings=2048, attention_bias=False, mlp_bias=False),
    "mistral": dict(_COMMON, num_key_value_heads=8, max_position_embeddings=4096 * 32, sliding_window=4096),
    "qwen2": _QWEN,
    "qwen3": dict(_QWEN, num_key_value_heads=8, attention_bias=False, head_dim=128),
}
# biases of (q/k/v, o_proj, the MLP): each fixed, or the config.json key that says
_BIASES = {"llama": ("attention_bias", "attention_bias", "mlp_bias"), "mistral": (False, False, False),
           "qwen2": (True, False, False), "qwen3": ("attention_bias", "attention_bias", False)}
# whether layer i slides when config.json has no layer_types, given the filled-in config
_SLIDES = {
    "llama": lambda c, i: False,
    "mistral": lambda c, i: True,
    "qwen2": lambda c, i: i >= c["max_window_layers"],
    "qwen3": lambda c, i: i >= c["max_window_layers"],
}
LAYER = "model.layers.{i}."  # the folder's prefix of layer i
IGNORED = re.compile(r"model\.layers\.\d+\.self_attn\.rotary_emb\.inv_freq")  # a buffer older files kept
OUTSIDE = {"wte.weight": "model.embed_tokens.weight", "ln_f.weight": "model.norm.weight",
           "lm_head.weight": "lm_head.weight"}  # our name -> theirs, outside the layers
IN_LAYER = {"ln_1": "input_layernorm", "ln_2": "post_attention_layernorm",
            "attn.qkv": ["self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"], "attn.proj": "self_attn.o_proj",
            "attn.q_norm": "self_attn.q_norm", "attn.k_norm": "self_attn.k_norm",
            "mlp.gate_up_proj": ["mlp.gate_proj", "mlp.up_proj"]}  # in layer i; the rest keep their names


def _derive(arch: str, value, c: dict) -> None:
    """What llama.cpp's llama refuses: RoPE on part of each head (its ``load_hparams``)."""
    head_dim = c["head_dim"] or c["hidden_size"] // c["num_attention_heads"]
    rotated = value("rope.dimension_count", int, head_dim)
    if arch == "llama" and rotated != head_dim:
        raise _gguf.FieldError(f"rope.dimension_count is {rotated}, not the head size {head_dim}: RoPE on part of "
                               f"each head is not supported (llama.cpp's llama refuses it too)")


# llama.cpp's names (Mistral is its llama); its converter interleaves a Llama's q/k rows for its RoPE (not Qwen's)
GGUF = _gguf.Names({"llama": "llama", "qwen2": "qwen2", "qwen3": "qwen3"},
                   in_block={**_gguf.IN_BLOCK, "attn_q_norm": "self_attn.q_norm", "attn_k_norm": "self_attn.k_norm"},
                   interleaved=frozenset({"llama"}), derive=_derive)


@_config.naming_the_file
def config(hf: dict, blocks: int | None = None) -> GPTConfig:
    """The decoder ``config.json`` (the dict ``hf``, read from ``where``) describes; a
    ValueError or TypeError naming ``where`` for what it cannot compute."""
    model_type = hf["model_type"]
    c = _config.filled(hf, _DEFAULTS[model_type])
    _config.silu(c)
    n_layer = _config.layers(c, blocks)
    n_head, n_kv_head, head_dim = _config.heads(c, c["head_dim"])
    if model_type.startswith("qwen") and not c["use_sliding_window"]:
        c["sliding_window"] = None  # as transformers' Qwen configs do
    slides = _config.layer_types(c, n_layer, lambda i: _SLIDES[model_type](c, i))
    qkv_bias, proj_bias, mlp_bias = (c[b] if isinstance(b, str) else b for b in _BIASES[model_type])
    return GPTConfig(vocab_size=c["vocab_size"], block_size=c["max_position_embeddings"], n_layer=n_layer,
                     n_head=n_head, n_embd=c["hidden_size"], n_kv_head=n_kv_head,
                     head_dim=c["head_dim"], bias=mlp_bias, qkv_bias=qkv_bias, proj_bias=proj_bias, pos="rope",
                     **_config.rope(c, head_dim), **_config.windows(c, slides), mlp_kind="swiglu",
                     intermediate_size=c["intermediate_size"], norm="rmsnorm", layer_norm_eps=c["rms_norm_eps"],
                     qk_norm="head" if model_type == "qwen3" else None, tie_embeddings=c["tie_word_embeddings"])


def sources(key: str, config: GPTConfig) -> list[str]:
    """The folder's tensors that make our tensor ``key`` (several: stacked along dim 0)."""
    return _names.sources(key, config, outside=OUTSIDE, layer=LAYER, in_layer=IN_LAYER)


_CLASSES = {"llama": "Llama", "mistral": "Mistral", "qwen2": "Qwen2", "qwen3": "Qwen3"}


def arch(model_type: str, sizes: dict) -> dict:
    """The :class:`GPTConfig` fields of ``model_type``'s block (``sizes`` are the others')."""
    return dict(pos="rope", norm="rmsnorm", mlp_kind="swiglu", bias=False, qkv_bias=model_type == "qwen2",
                proj_bias=False, tie_embeddings=False, qk_norm="head" if model_type == "qwen3" else None)


def hf_config(config: GPTConfig, model_type: str) -> dict:
    """The ``config.json`` of ``model_type`` for ``config`` (whether it says all of ``config``
    is for the caller to check, by reading it back with :func:`config`)."""
    c = config
    hf = dict(architectures=[f"{_CLASSES[model_type]}ForCausalLM"], model_type=model_type,
              vocab_size=c.vocab_size, hidden_size=c.n_embd, intermediate_size=c.intermediate_size or 4 * c.n_embd,
              num_hidden_layers=c.n_layer, num_attention_heads=c.n_head, num_key_value_heads=c.n_kv_head or c.n_head,
              head_dim=c.head_dim or c.n_embd // c.n_head, hidden_act="silu", max_position_embeddings=c.block_size,
              rms_norm_eps=c.layer_norm_eps, tie_word_embeddings=c.tie_embeddings,
              rope_parameters={"rope_type": "default", **(c.rope_scaling or {}), "rope_theta": c.rope_base})
    if model_type == "llama":
        hf |= dict(attention_bias=bool(c.qkv_bias), mlp_bias=c.bias)
    if model_type == "qwen3":
        hf |= dict(attention_bias=bool(c.qkv_bias))
    slides = [c.layer_window(i) is not None for i in range(c.n_layer)]
    if model_type == "mistral":
        hf |= dict(sliding_window=c.window)
    elif model_type != "llama":
        hf |= dict(use_sliding_window=c.window is not None, sliding_window=c.window, max_window_layers=0,
                   layer_types=[("sliding_attention" if s else "full_attention") for s in slides])
    return hf
