"""gpt-oss (``model_type`` gpt_oss): attention with learned sinks, a mixture of experts.

RMSNorm before attention and the MLP, its weight multiplied in float32; q, k, v and o with
biases; one learned sink logit per head; every other layer slides over ``sliding_window`` (by
``layer_types``); YaRN-scaled RoPE; the MLP a mixture of ``num_local_experts`` clamped-SwiGLU
experts of which each token takes ``num_experts_per_tok`` (see :class:`~selfattn.model.MoE`,
which stores the experts as gpt-oss does); an untied head.

Weights: as Llama's attention and norms, plus ``self_attn.sinks`` -> ``attn.sinks``,
``mlp.router`` as is, ``mlp.experts.gate_up_proj`` (and ``_bias``) -> ``mlp.gate_up_proj``
(``mlp.gate_up_bias``), ``mlp.experts.down_proj`` (and ``_bias``) likewise.
"""
from __future__ import annotations

from selfattn import _validate
from selfattn.config import GPTConfig
from selfattn.families import _config, _names, llama

MODEL_TYPES = ("gpt_oss",)

_DEFAULTS = dict(num_key_value_heads=8, head_dim=64, hidden_act="silu", max_position_embeddings=131072,
                 rms_norm_eps=1e-5, tie_word_embeddings=False, attention_bias=True, sliding_window=128,
                 num_experts_per_tok=4, swiglu_limit=7.0, rope_theta=150000.0,
                 rope_parameters={"rope_type": "yarn", "factor": 32.0, "beta_fast": 32.0, "beta_slow": 1.0,
                                  "truncate": False, "original_max_position_embeddings": 4096})  # GptOssConfig's
LAYER = llama.LAYER
IN_LAYER = {**llama.IN_LAYER, "attn.sinks": "self_attn.sinks", "mlp.gate_up_proj": "mlp.experts.gate_up_proj",
            "mlp.gate_up_bias": "mlp.experts.gate_up_proj_bias", "mlp.down_proj": "mlp.experts.down_proj",
            "mlp.down_bias": "mlp.experts.down_proj_bias"}


@_config.naming_the_file
def config(hf: dict, blocks: int | None = None) -> GPTConfig:
    """gpt-oss's decoder that ``config.json`` (the dict ``hf``) describes; ``config(hf, where)`` names the file."""
    c = _config.filled(hf, _DEFAULTS, (*_config.SIZES, "num_local_experts"))
    n_layer = _config.layers(c, blocks)
    n_head, n_kv_head, head_dim = _config.heads(c, c["head_dim"])
    slides = _config.layer_types(c, n_layer, lambda i: (i + 1) % 2)
    return GPTConfig(vocab_size=c["vocab_size"], block_size=c["max_position_embeddings"], n_layer=n_layer,
                     n_head=n_head, n_embd=c["hidden_size"], n_kv_head=n_kv_head, head_dim=head_dim, bias=False,
                     qkv_bias=c["attention_bias"], proj_bias=c["attention_bias"], pos="rope",
                     **_config.rope(c, head_dim), **_config.windows(c, slides), sinks=True, mlp_kind="moe",
                     intermediate_size=c["intermediate_size"], n_experts=c["num_local_experts"],
                     experts_per_token=c["num_experts_per_tok"],
                     expert_clamp=_validate.positive_number("swiglu_limit", c["swiglu_limit"]), norm="rmsnorm",
                     layer_norm_eps=c["rms_norm_eps"], norm_weight_in_float32=True,
                     tie_embeddings=c["tie_word_embeddings"])


def sources(key: str, config: GPTConfig) -> list[str]:
    return _names.sources(key, config, outside=llama.OUTSIDE, layer=LAYER, in_layer=IN_LAYER)
