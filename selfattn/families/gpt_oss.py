"""gpt-oss (``model_type`` gpt_oss): attention with learned sinks, a mixture of experts.

RMSNorm before attention and the MLP, its weight multiplied in float32; q, k, v and o with
biases; one learned sink logit per head; every other layer slides over ``sliding_window`` (by
``layer_types``); YaRN-scaled RoPE; the MLP a mixture of ``num_local_experts`` clamped-SwiGLU
experts of which each token takes ``num_experts_per_tok`` (see :class:`~selfattn.model.MoE`,
which stores the experts as gpt-oss does); an untied head.

Weights: as Llama's attention and norms, plus ``self_attn.sinks`` -> ``attn.sinks``,
``mlp.router`` as is, ``mlp.experts.gate_up_proj`` (and ``_bias``) -> ``mlp.gate_up_proj``
(``mlp.gate_up_bias``), ``mlp.experts.down_proj`` (and ``_bias``) likewise.

GGUF (llama.cpp's architecture gpt-oss, :data:`GGUF`): the converter stores the experts' matrices transposed
and splits ``gate_up_proj`` (and its bias) into its even entries (``ffn_gate_exps``) and odd ones
(``ffn_up_exps``), read back alternated (and so split when written); the sinks are ``attn_sinks``, the router
``ffn_gate_inp``. llama.cpp fixes what the file does not say: every other layer slides (unless
``attention.sliding_window_pattern`` says); whatever the file says, the clamp of the experts' SwiGLU (7: its
``swiglu_oai`` constants, with the sigmoid's slope 1.702, as :class:`~selfattn.model.MoE`'s) and biases on q, k,
v and o (:data:`GGUF`'s ``fixed``: a model with others is not written); the router's softmax over the top k, as
ours. What it cannot represent: another ``swiglu_limit``, and YaRN's ``truncate`` false (gpt-oss's own:
llama.cpp rounds the ramp's ends outward), nor ``beta_fast`` and ``beta_slow`` other than 32 and 1, nor a model
without a sliding layer (``attention.sliding_window`` is required: it asserts a layer that slides).

:func:`hf_config` says a model as gpt-oss's ``config.json`` (for the GGUF writer, :mod:`selfattn.families.writing`).
"""
from __future__ import annotations

from selfattn._util import validate as _validate
from selfattn.config import GPTConfig
from selfattn.families import _config, _gguf, _names, llama

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


def _derive(arch: str, value, c: dict) -> None:
    """What llama.cpp's gpt-oss derives rather than reads (see the module docstring)."""
    _gguf.sliding(value, c, 2, _gguf.REQUIRED)
    local = value("rope.freq_base_swa", float, c["rope_theta"])
    if local != c["rope_theta"]:
        raise _gguf.FieldError(f"rope.freq_base_swa is {local:g}, not rope.freq_base {c['rope_theta']:g}: the sliding "
                               f"layers' own RoPE base is not supported")


GGUF = _gguf.Names({"gpt-oss": "gpt_oss"},
                   fields={**_gguf.RMS_FIELDS, "intermediate_size": ("expert_feed_forward_length", int, _gguf.REQUIRED),
                           "num_local_experts": ("expert_count", int, _gguf.REQUIRED),
                           "num_experts_per_tok": ("expert_used_count", int, _gguf.REQUIRED),
                           # llama.cpp's gpt-oss needs a sliding layer (GGML_ASSERT(hparams.is_swa_any()))
                           "sliding_window": ("attention.sliding_window", int, _gguf.REQUIRED)},
                   in_block={"attn_norm": "input_layernorm", "post_attention_norm": "post_attention_layernorm",
                             "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
                             "attn_output": "self_attn.o_proj", "attn_sinks.weight": "self_attn.sinks",
                             "ffn_gate_inp": "mlp.router", "ffn_down_exps.weight": "mlp.experts.down_proj",
                             "ffn_down_exps.bias": "mlp.experts.down_proj_bias"},
                   transposed=frozenset({"ffn_gate_exps.weight", "ffn_up_exps.weight", "ffn_down_exps.weight"}),
                   alternated={"mlp.experts.gate_up_proj": ("ffn_gate_exps.weight", "ffn_up_exps.weight"),
                               "mlp.experts.gate_up_proj_bias": ("ffn_gate_exps.bias", "ffn_up_exps.bias")},
                   fixed={"swiglu_limit": 7.0, "attention_bias": True},  # llama.cpp's swiglu_oai; its q, k, v, o biases
                   derive=_derive)


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


def hf_config(config: GPTConfig, model_type: str) -> dict:
    """The ``config.json`` of gpt-oss for ``config`` (read it back with :func:`config` to know whether it says
    all of ``config``)."""
    c = config
    slides = [c.layer_window(i) is not None for i in range(c.n_layer)]
    return dict(architectures=["GptOssForCausalLM"], model_type=model_type, vocab_size=c.vocab_size,
                hidden_size=c.n_embd, intermediate_size=c.intermediate_size or 4 * c.n_embd,
                num_hidden_layers=c.n_layer, num_attention_heads=c.n_head, num_key_value_heads=c.n_kv_head or c.n_head,
                head_dim=c.head_dim or c.n_embd // c.n_head, hidden_act="silu", max_position_embeddings=c.block_size,
                rms_norm_eps=c.layer_norm_eps, tie_word_embeddings=c.tie_embeddings,
                attention_bias=bool(c.qkv_bias), sliding_window=c.window,
                layer_types=[("sliding_attention" if s else "full_attention") for s in slides],
                num_local_experts=c.n_experts, num_experts_per_tok=c.experts_per_token, swiglu_limit=c.expert_clamp,
                rope_parameters={"rope_type": "default", **(c.rope_scaling or {}), "rope_theta": c.rope_base})
