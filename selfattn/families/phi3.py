"""Phi-3 (``model_type`` phi3): Llama's decoder with fused projections and LongRoPE.

RMSNorm before attention and the MLP; q, k, v stored fused as ``qkv_proj`` (our layout already)
and gate and up as ``gate_up_proj`` (gate's rows first, ours too); RoPE on the first
``partial_rotary_factor`` of each head, scaled by ``longrope`` (short factors up to
``original_max_position_embeddings``, long ones beyond) in the long-context models; a sliding
window over every layer when ``sliding_window`` is set; an untied head.

GGUF (llama.cpp's architecture phi3, :data:`GGUF`): the fused projections keep their layout (``attn_qkv``,
``ffn_up`` of gate then up); the converter writes the rotated channels (``rope.dimension_count``), LongRoPE's
factors as two tensors (``rope_factors_long``, ``rope_factors_short``) with ``rope.scaling.attn_factor`` and
``rope.scaling.original_context_length``. What llama.cpp cannot represent: the sliding window (its phi3 reads
``attention.sliding_window`` and turns it off: :data:`GGUF`'s ``fixed``); it takes the long factors when its
context is longer than the original, where ``transformers`` (and this library) looks at the sequence, so a
LongRoPE model is read but not written.

:func:`hf_config` says a model as Phi-3's ``config.json`` (for the GGUF writer, :mod:`selfattn.families.writing`).
"""
from __future__ import annotations

from selfattn.config import GPTConfig
from selfattn.families import _config, _gguf, _names, llama

MODEL_TYPES = ("phi3",)

_DEFAULTS = dict(num_key_value_heads=None, hidden_act="silu", max_position_embeddings=4096,
                 original_max_position_embeddings=4096, rms_norm_eps=1e-5, tie_word_embeddings=False,
                 rope_theta=10000.0, sliding_window=None)  # what transformers' Phi3Config assumes
LAYER = llama.LAYER
IN_LAYER = {**llama.IN_LAYER, "attn.qkv": "self_attn.qkv_proj", "mlp.gate_up_proj": "mlp.gate_up_proj"}


def _derive(arch: str, value, c: dict) -> None:
    """llama.cpp's phi3: LongRoPE's original length (its own key)."""
    c["original_max_position_embeddings"] = value("rope.scaling.original_context_length", int,
                                                  c["max_position_embeddings"])


GGUF = _gguf.Names({"phi3": "phi3"}, in_block={"attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm",
                                               "attn_qkv": "self_attn.qkv_proj", "attn_output": "self_attn.o_proj",
                                               "ffn_up": "mlp.gate_up_proj", "ffn_down": "mlp.down_proj"},
                   fixed={"sliding_window": None}, derive=_derive)  # its phi3 turns any window off


@_config.naming_the_file
def config(hf: dict, blocks: int | None = None) -> GPTConfig:
    """Phi-3's decoder that ``config.json`` (the dict ``hf``) describes; ``config(hf, where)`` names the file."""
    c = _config.filled(hf, _DEFAULTS)
    _config.silu(c)
    key = "rope_scaling" if c.get("rope_scaling") else "rope_parameters"
    params = c.get(key)
    if isinstance(params, dict) and params.get("rope_type", params.get("type")) in ("su", "yarn"):
        c[key] = {**params, "rope_type": "longrope"}  # older names of longrope, as transformers reads them
    n_layer = _config.layers(c, blocks)
    n_head, n_kv_head, head_dim = _config.heads(c, None)  # Phi-3's head is hidden_size / H
    return GPTConfig(vocab_size=c["vocab_size"], block_size=c["max_position_embeddings"], n_layer=n_layer,
                     n_head=n_head, n_embd=c["hidden_size"], n_kv_head=n_kv_head, bias=False,
                     pos="rope", **_config.rope(c, head_dim),
                     **_config.windows(c, [True] * n_layer), mlp_kind="swiglu",
                     intermediate_size=c["intermediate_size"], norm="rmsnorm", layer_norm_eps=c["rms_norm_eps"],
                     tie_embeddings=c["tie_word_embeddings"])


def sources(key: str, config: GPTConfig) -> list[str]:
    return _names.sources(key, config, outside=llama.OUTSIDE, layer=LAYER, in_layer=IN_LAYER)


def hf_config(config: GPTConfig, model_type: str) -> dict:
    """The ``config.json`` of Phi-3 for ``config`` (read it back with :func:`config` to know whether it
    says all of ``config``)."""
    c = config
    head_dim = c.n_embd // c.n_head
    scaling = c.rope_scaling or {}
    return dict(architectures=["Phi3ForCausalLM"], model_type=model_type, vocab_size=c.vocab_size,
                hidden_size=c.n_embd, intermediate_size=c.intermediate_size or 4 * c.n_embd,
                num_hidden_layers=c.n_layer, num_attention_heads=c.n_head, num_key_value_heads=c.n_kv_head or c.n_head,
                hidden_act="silu", max_position_embeddings=c.block_size,
                original_max_position_embeddings=scaling.get("original_max_position_embeddings", c.block_size),
                rms_norm_eps=c.layer_norm_eps, tie_word_embeddings=c.tie_embeddings, sliding_window=c.window,
                partial_rotary_factor=(c.rope_dims or head_dim) / head_dim,
                rope_parameters={"rope_type": "default", **scaling, "rope_theta": c.rope_base})
