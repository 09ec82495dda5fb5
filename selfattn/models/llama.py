"""Llama, Mistral and Qwen2 (``model_type`` llama, mistral, qwen2): one mapping for three families.

The three are one decoder: RMSNorm before attention, before the MLP and at the end; rotate-half
RoPE of base ``rope_theta``; grouped-query attention (``num_key_value_heads``); a SwiGLU MLP of
``intermediate_size`` (``gate_proj``, ``up_proj``, ``down_proj``, SiLU); no position
embeddings; and one naming of the weights. They differ in data only, kept in the tables below:
where the biases are, which layers slide over a window (Mistral: every layer, by
``sliding_window``; Qwen2: the ``layer_types`` layers, with ``use_sliding_window``), and what
``transformers`` assumes for a key ``config.json`` leaves out.

Weights: ``q_proj``, ``k_proj``, ``v_proj`` stack (rows) into our fused ``qkv``, ``o_proj`` is
``proj``, the MLP keeps its names, the norms are ``ln_1``, ``ln_2``, ``ln_f``.
"""
from __future__ import annotations

import re

from selfattn import _validate
from selfattn.model import GPTConfig

MODEL_TYPES = ("llama", "mistral", "qwen2")

# what transformers' LlamaConfig, MistralConfig, Qwen2Config assume for a key that config.json leaves out
_COMMON = dict(num_key_value_heads=None, head_dim=None, hidden_act="silu", rms_norm_eps=1e-6,
               tie_word_embeddings=False, rope_theta=10000.0)
_DEFAULTS = {
    "llama": dict(_COMMON, max_position_embeddings=2048, attention_bias=False, mlp_bias=False),
    "mistral": dict(_COMMON, num_key_value_heads=8, max_position_embeddings=4096 * 32, sliding_window=4096),
    "qwen2": dict(_COMMON, num_key_value_heads=32, max_position_embeddings=32768, use_sliding_window=False,
                  sliding_window=4096, max_window_layers=28, layer_types=None),
}
# biases of (q/k/v, o_proj, the MLP): each fixed, or the config.json key that says
_BIASES = {"llama": ("attention_bias", "attention_bias", "mlp_bias"), "mistral": (False, False, False),
           "qwen2": (True, False, False)}
# whether layer i slides over the window, given config.json with the defaults filled in
_SLIDES = {
    "llama": lambda c, i: False,
    "mistral": lambda c, i: True,
    "qwen2": lambda c, i: c["use_sliding_window"] and (
        c["layer_types"][i] == "sliding_attention" if c["layer_types"] else i >= c["max_window_layers"]),
}
_REQUIRED = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads")
IGNORED = re.compile(r"model\.layers\.\d+\.self_attn\.rotary_emb\.inv_freq")  # a buffer older files kept
_OUTSIDE_LAYERS = {"wte.weight": "model.embed_tokens.weight", "ln_f.weight": "model.norm.weight",
                   "lm_head.weight": "lm_head.weight"}  # our name -> theirs
_LAYER = re.compile(r"blocks\.(\d+)\.(.+)")  # our names in block i; theirs are in model.layers.i
_IN_LAYER = {"ln_1.weight": "input_layernorm.weight", "ln_2.weight": "post_attention_layernorm.weight",
             "attn.proj.weight": "self_attn.o_proj.weight", "attn.proj.bias": "self_attn.o_proj.bias"}


def config(hf: dict, where: str) -> GPTConfig:
    """The decoder ``config.json`` (the dict ``hf``, read from ``where``) describes; a
    ValueError or TypeError naming ``where`` for what it cannot compute."""
    try:
        return _config(hf)
    except (TypeError, ValueError) as e:
        raise type(e)(f"{where}: {e}") from None


def _config(hf: dict) -> GPTConfig:
    model_type = hf["model_type"]
    absent = [key for key in _REQUIRED if key not in hf]
    if absent:
        raise ValueError(f"a {model_type} config.json needs {', '.join(absent)}")
    c = {**_DEFAULTS[model_type], **hf}
    if c["hidden_act"] not in ("silu", "swish"):  # one function, two names in transformers' ACT2FN
        raise ValueError(f"hidden_act {c['hidden_act']!r} is not supported; the SwiGLU MLP computes 'silu'")
    n_head, n_layer = c["num_attention_heads"], _validate.positive_int("num_hidden_layers", c["num_hidden_layers"])
    windows = {c["sliding_window"] if _SLIDES[model_type](c, i) else None for i in range(n_layer)}
    if len(windows) > 1:
        raise ValueError(f"some layers slide over a window of {c['sliding_window']} and others do not "
                         f"(layer_types, max_window_layers); selfattn's decoder has one window for every layer")
    qkv_bias, proj_bias, mlp_bias = (c[b] if isinstance(b, str) else b for b in _BIASES[model_type])
    return GPTConfig(vocab_size=c["vocab_size"], block_size=c["max_position_embeddings"], n_layer=n_layer,
                     n_head=n_head, n_embd=c["hidden_size"], n_kv_head=c["num_key_value_heads"] or n_head,
                     head_dim=c["head_dim"], bias=mlp_bias, qkv_bias=qkv_bias, proj_bias=proj_bias, pos="rope",
                     rope_base=_rope_theta(c), window=windows.pop(), mlp_kind="swiglu",
                     intermediate_size=c["intermediate_size"], norm="rmsnorm", layer_norm_eps=c["rms_norm_eps"],
                     tie_embeddings=c["tie_word_embeddings"])


def _rope_theta(c: dict) -> float:
    """The RoPE base of ``rope_type`` "default", the only one computed; any other is refused."""
    params = c.get("rope_scaling") or c.get("rope_parameters") or {}  # transformers reads them in this order
    if not isinstance(params, dict) or any(isinstance(v, dict) for v in params.values()):
        raise ValueError(f"RoPE parameters per layer type are not supported, got {params!r}")
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type != "default":
        raise ValueError(f"rope_type {rope_type!r} is not supported; selfattn computes RoPE of rope_type "
                         f"'default' only (no scaling)")
    return float(params.get("rope_theta", c["rope_theta"]))


def sources(key: str, config: GPTConfig) -> list[str]:
    """The folder's tensors that make our tensor ``key`` (several: stacked along dim 0)."""
    if key == "lm_head.weight" and config.tie_embeddings:
        key = "wte.weight"  # tied: the head is the embedding, which the folder stores once
    if key in _OUTSIDE_LAYERS:
        return [_OUTSIDE_LAYERS[key]]
    layer, name = _LAYER.fullmatch(key).groups()
    theirs = f"model.layers.{layer}."
    if name.startswith("attn.qkv."):
        return [f"{theirs}self_attn.{part}_proj.{name.rsplit('.', 1)[1]}" for part in "qkv"]
    return [theirs + (name if name.startswith("mlp.") else _IN_LAYER[name])]
