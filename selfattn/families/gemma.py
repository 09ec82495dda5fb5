"""Gemma 2 and Gemma 3 (``model_type`` gemma2, gemma3_text): one mapping for two families.

Both are a sandwich-norm decoder: RMSNorm before and after attention and the MLP, each scaling by
``1 + w`` in float32 (the weight is stored as ``w``); token embeddings scaled by sqrt(C) in their
dtype; a GeGLU MLP (``hidden_activation``); scores scaled by ``query_pre_attn_scalar ** -0.5``;
sliding-window layers by ``layer_types`` (Gemma 2: every other one; Gemma 3: five of six); a
tied head. Gemma 2 soft-caps the scores (``attn_logit_softcapping``) and the final logits
(``final_logit_softcapping``); Gemma 3 norms q and k per head before RoPE and gives the sliding
layers their own RoPE base (``rope_local_base_freq``, its ``sliding_attention`` parameters).

Weights: as Llama's, plus ``post_attention_layernorm`` -> ``post_ln_1``,
``pre_feedforward_layernorm`` -> ``ln_2``, ``post_feedforward_layernorm`` -> ``post_ln_2``.

GGUF (llama.cpp's architectures gemma2 and gemma3, :data:`GGUF`): its converter stores every norm weight
as ``1 + w``; the file does not say the sliding pattern (every 2nd layer slides, Gemma 3: five of six, unless
``attention.sliding_window_pattern`` says), the local RoPE base (Gemma 2: the global one, Gemma 3: 10000,
unless ``rope.freq_base_swa`` says), the attention scale (``head_dim ** -0.5``, the 27B models'
``(hidden_size / heads) ** -0.5``) nor the activation (GELU, tanh-approximated): llama.cpp's own rules
(``src/models/gemma2.cpp``, ``gemma3.cpp``) fill them in. So what llama.cpp cannot represent: another
``query_pre_attn_scalar``, another activation, and (the converter writing no pattern) ``layer_types`` other
than those rules'; Gemma 2's RoPE scaling applies to its sliding layers too, Gemma 3's to the global ones only.
"""
from __future__ import annotations

from selfattn._util import validate as _validate
from selfattn.config import GPTConfig
from selfattn.families import _config, _gguf, _names, llama

MODEL_TYPES = ("gemma2", "gemma3_text")

_COMMON = dict(num_key_value_heads=4, head_dim=256, hidden_activation="gelu_pytorch_tanh", rms_norm_eps=1e-6,
               tie_word_embeddings=True, attention_bias=False, query_pre_attn_scalar=256, sliding_window=4096,
               use_bidirectional_attention=False)
_DEFAULTS = {  # what transformers' Gemma2Config and Gemma3TextConfig assume
    "gemma2": dict(_COMMON, max_position_embeddings=8192, rope_theta=10000.0, final_logit_softcapping=30.0,
                   attn_logit_softcapping=50.0),
    "gemma3_text": dict(_COMMON, max_position_embeddings=131072, rope_theta=1e6, rope_local_base_freq=10000.0,
                        final_logit_softcapping=None, attn_logit_softcapping=None),
}
_SLIDES = {"gemma2": lambda c, i: (i + 1) % 2, "gemma3_text": lambda c, i: (i + 1) % c.get("sliding_window_pattern", 6)}
_GELU = {"gelu_pytorch_tanh": "tanh", "gelu": "none"}  # transformers' ACT2FN name -> GELU's approximate
LAYER = llama.LAYER
IN_LAYER = {**llama.IN_LAYER, "post_ln_1": "post_attention_layernorm", "ln_2": "pre_feedforward_layernorm",
            "post_ln_2": "post_feedforward_layernorm"}


def _derive(arch: str, value, c: dict) -> None:
    """The config fields llama.cpp's gemma2 and gemma3 derive rather than read (see the module docstring)."""
    gemma3 = arch == "gemma3"
    _gguf.sliding(value, c, 6 if gemma3 else 2, None if gemma3 else 4096)
    full = c["rope_parameters"]
    local = value("rope.freq_base_swa", float, 10000.0 if gemma3 else full["rope_theta"])
    if gemma3 or local != full["rope_theta"]:  # the sliding layers' own base, unscaled (Gemma 2's: scaled)
        if not gemma3 and full["rope_type"] != "default":
            raise _gguf.FieldError(f"rope.freq_base_swa {local:g} with rope.scaling.type {full['rope_type']!r} is not "
                                   f"supported: the sliding layers' RoPE may differ in its base only")
        sliding = {"rope_type": "default", "rope_theta": local}
        if "partial_rotary_factor" in full:
            sliding["partial_rotary_factor"] = full["partial_rotary_factor"]
        c["rope_parameters"] = {"full_attention": full, "sliding_attention": sliding}
    head_dim = c["head_dim"] or c["hidden_size"] // c["num_attention_heads"]
    big = c["num_hidden_layers"] == (62 if gemma3 else 46)  # the 27B models
    c["query_pre_attn_scalar"] = c["hidden_size"] // c["num_attention_heads"] if big else head_dim
    c["hidden_activation"] = "gelu_pytorch_tanh"
    final = value("final_logit_softcapping", float, None if gemma3 else 30.0)
    c["final_logit_softcapping"] = final or None  # 0: none
    if not gemma3:
        c["attn_logit_softcapping"] = value("attn_logit_softcapping", float, 50.0) or None


GGUF = _gguf.Names({"gemma2": "gemma2", "gemma3": "gemma3_text"},
                   in_block={**_gguf.IN_BLOCK, "post_attention_norm": "post_attention_layernorm",
                             "ffn_norm": "pre_feedforward_layernorm", "post_ffw_norm": "post_feedforward_layernorm",
                             "attn_q_norm": "self_attn.q_norm", "attn_k_norm": "self_attn.k_norm"},
                   norm_offset=1.0, derive=_derive)


@_config.naming_the_file
def config(hf: dict, blocks: int | None = None) -> GPTConfig:
    """The Gemma decoder that ``config.json`` (the dict ``hf``) describes; ``config(hf, where)`` names the file."""
    model_type = hf["model_type"]
    c = _config.filled(hf, _DEFAULTS[model_type])
    if c["hidden_activation"] not in _GELU:
        raise ValueError(f"hidden_activation {c['hidden_activation']!r} is not supported; the GeGLU MLP computes "
                         f"{', '.join(map(repr, _GELU))}")
    if c["use_bidirectional_attention"]:
        raise ValueError("use_bidirectional_attention is not supported: selfattn's decoder is causal")
    n_layer = _config.layers(c, blocks)
    n_head, n_kv_head, head_dim = _config.heads(c, c["head_dim"])
    slides = _config.layer_types(c, n_layer, lambda i: _SLIDES[model_type](c, i))
    rope = _config.rope(c, head_dim, default_theta=c["rope_theta"])
    if model_type == "gemma3_text" and "window_rope_base" not in rope:  # an older file: the local base on its own
        rope["window_rope_base"] = _validate.positive_number("rope_local_base_freq", c["rope_local_base_freq"])
    scalar = _validate.positive_number("query_pre_attn_scalar", c["query_pre_attn_scalar"])
    return GPTConfig(vocab_size=c["vocab_size"], block_size=c["max_position_embeddings"], n_layer=n_layer,
                     n_head=n_head, n_embd=c["hidden_size"], n_kv_head=n_kv_head, head_dim=head_dim, bias=False,
                     qkv_bias=c["attention_bias"], proj_bias=c["attention_bias"], pos="rope", **rope,
                     **_config.windows(c, slides), softcap=c["attn_logit_softcapping"], attn_scale=scalar ** -0.5,
                     qk_norm="head" if model_type == "gemma3_text" else None, mlp_kind="geglu",
                     intermediate_size=c["intermediate_size"],
                     gelu_approximate=_GELU[c["hidden_activation"]], norm="rmsnorm", layer_norm_eps=c["rms_norm_eps"],
                     norm_offset=1.0, norm_weight_in_float32=True, norm_position="sandwich",
                     embedding_scale=c["hidden_size"] ** 0.5, tie_embeddings=c["tie_word_embeddings"],
                     logit_softcap=c["final_logit_softcapping"])


def sources(key: str, config: GPTConfig) -> list[str]:
    return _names.sources(key, config, outside=llama.OUTSIDE, layer=LAYER, in_layer=IN_LAYER)


_CLASSES = {"gemma2": "Gemma2", "gemma3_text": "Gemma3"}


def arch(model_type: str, sizes: dict) -> dict:
    """The :class:`GPTConfig` fields of ``model_type``'s block (``sizes`` are the others')."""
    return dict(pos="rope", norm="rmsnorm", norm_offset=1.0, norm_weight_in_float32=True, norm_position="sandwich",
                mlp_kind="geglu", gelu_approximate="tanh", bias=False, qkv_bias=False, proj_bias=False,
                tie_embeddings=True, embedding_scale=sizes["n_embd"] ** 0.5, layer_norm_eps=1e-6,
                qk_norm="head" if model_type == "gemma3_text" else None)


def hf_config(config: GPTConfig, model_type: str) -> dict:
    """The ``config.json`` of ``model_type`` for ``config`` (read it back with :func:`config` to
    know whether it says all of ``config``)."""
    c, head_dim = config, config.head_dim or config.n_embd // config.n_head
    rope = {"rope_type": "default", **(c.rope_scaling or {}), "rope_theta": c.rope_base}
    if model_type == "gemma3_text":
        local = {"rope_type": "default", "rope_theta": c.window_rope_base or c.rope_base}
        rope = {"full_attention": rope, "sliding_attention": local}
    slides = [c.layer_window(i) is not None for i in range(c.n_layer)]
    return dict(architectures=[f"{_CLASSES[model_type]}ForCausalLM"], model_type=model_type,
                vocab_size=c.vocab_size, hidden_size=c.n_embd, intermediate_size=c.intermediate_size or 4 * c.n_embd,
                num_hidden_layers=c.n_layer, num_attention_heads=c.n_head, num_key_value_heads=c.n_kv_head or c.n_head,
                head_dim=head_dim, hidden_activation={v: k for k, v in _GELU.items()}[c.gelu_approximate],
                max_position_embeddings=c.block_size, rms_norm_eps=c.layer_norm_eps,
                tie_word_embeddings=c.tie_embeddings, attention_bias=bool(c.qkv_bias),
                query_pre_attn_scalar=round((c.attn_scale or head_dim ** -0.5) ** -2),
                sliding_window=c.window or c.block_size,  # no layer slides: transformers still asks for one
                layer_types=[("sliding_attention" if s else "full_attention") for s in slides],
                attn_logit_softcapping=c.softcap, final_logit_softcapping=c.logit_softcap, rope_parameters=rope)
