"""OLMo 2 (``model_type`` olmo2): a post-norm decoder with q/k norms over the whole projection.

Each sublayer's output is normed before it joins the residual stream, ``x + norm(attn(x))`` and
``x + norm(mlp(x))``, with no norm before it; q and k are each RMS-normed over all their heads
(H·D and Hkv·D channels) before RoPE; every RMSNorm multiplies its weight in float32 before
the cast back; a SwiGLU MLP; an untied head.

Weights: as Llama's, with ``post_attention_layernorm`` -> ``post_ln_1`` and
``post_feedforward_layernorm`` -> ``post_ln_2``.

GGUF (llama.cpp's architecture olmo2, :data:`GGUF`): the tensors as they are, the norms named
``post_attention_norm`` and ``post_ffw_norm``. A sliding window (an OLMo 3 file, which llama.cpp's olmo2
reads too) is refused: this family has none.
"""
from __future__ import annotations

from selfattn.config import GPTConfig
from selfattn.families import _config, _gguf, _names, llama

MODEL_TYPES = ("olmo2",)

_DEFAULTS = dict(num_key_value_heads=None, hidden_act="silu", max_position_embeddings=2048, rms_norm_eps=1e-5,
                 tie_word_embeddings=False, attention_bias=False, rope_theta=10000.0)  # transformers' Olmo2Config
LAYER = llama.LAYER
IN_LAYER = {**llama.IN_LAYER, "post_ln_1": "post_attention_layernorm", "post_ln_2": "post_feedforward_layernorm"}


def _derive(arch: str, value, c: dict) -> None:
    """Refuse what llama.cpp's olmo2 reads beyond OLMo 2: a sliding window (OLMo 3's)."""
    window = value("attention.sliding_window", int, None)
    if window:
        raise _gguf.FieldError(f"attention.sliding_window is {window}: OLMo 3's sliding layers are not supported")


GGUF = _gguf.Names({"olmo2": "olmo2"},
                   in_block={"attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
                             "attn_output": "self_attn.o_proj", "attn_q_norm": "self_attn.q_norm",
                             "attn_k_norm": "self_attn.k_norm", "post_attention_norm": "post_attention_layernorm",
                             "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj",
                             "post_ffw_norm": "post_feedforward_layernorm"},
                   derive=_derive)


@_config.naming_the_file
def config(hf: dict, blocks: int | None = None) -> GPTConfig:
    """OLMo 2's decoder that ``config.json`` (the dict ``hf``) describes; ``config(hf, where)`` names the file."""
    c = _config.filled(hf, _DEFAULTS)
    _config.silu(c)
    n_layer = _config.layers(c, blocks)
    n_head, n_kv_head, head_dim = _config.heads(c, None)  # OLMo 2's head is hidden_size / H
    return GPTConfig(vocab_size=c["vocab_size"], block_size=c["max_position_embeddings"], n_layer=n_layer,
                     n_head=n_head, n_embd=c["hidden_size"], n_kv_head=n_kv_head, bias=False,
                     qkv_bias=c["attention_bias"], proj_bias=c["attention_bias"], pos="rope",
                     **_config.rope(c, head_dim), qk_norm="projection", mlp_kind="swiglu",
                     intermediate_size=c["intermediate_size"], norm="rmsnorm", layer_norm_eps=c["rms_norm_eps"],
                     norm_weight_in_float32=True, norm_position="post", tie_embeddings=c["tie_word_embeddings"])


def sources(key: str, config: GPTConfig) -> list[str]:
    return _names.sources(key, config, outside=llama.OUTSIDE, layer=LAYER, in_layer=IN_LAYER)


def arch(model_type: str, sizes: dict) -> dict:
    """The :class:`GPTConfig` fields of OLMo 2's block (``sizes`` are the others')."""
    return dict(pos="rope", norm="rmsnorm", norm_weight_in_float32=True, norm_position="post", qk_norm="projection",
                mlp_kind="swiglu", bias=False, qkv_bias=False, proj_bias=False, tie_embeddings=False)


def hf_config(config: GPTConfig, model_type: str) -> dict:
    """The ``config.json`` of OLMo 2 for ``config`` (read it back with :func:`config` to know
    whether it says all of ``config``)."""
    c = config
    return dict(architectures=["Olmo2ForCausalLM"], model_type=model_type, vocab_size=c.vocab_size,
                hidden_size=c.n_embd, intermediate_size=c.intermediate_size or 4 * c.n_embd,
                num_hidden_layers=c.n_layer, num_attention_heads=c.n_head, num_key_value_heads=c.n_kv_head or c.n_head,
                hidden_act="silu", max_position_embeddings=c.block_size, rms_norm_eps=c.layer_norm_eps,
                tie_word_embeddings=c.tie_embeddings, attention_bias=bool(c.qkv_bias),
                rope_parameters={"rope_type": "default", **(c.rope_scaling or {}), "rope_theta": c.rope_base})
