"""BLOOM (``model_type`` bloom): ALiBi instead of positions, LayerNorms with biases everywhere.

A LayerNorm right after the token embedding (``word_embeddings_layernorm``), LayerNorm before
attention and the MLP, biases on every projection, no position embeddings: ALiBi biases of the
paper's slopes per head; a GELU MLP of 4C (BLOOM's tanh approximation); a tied head.

Weights: the fused ``query_key_value`` interleaves q, k and v per head (rows ``(H, 3, D)``), which
:func:`arrange` reorders into our ``(3, H, D)``; ``dense`` is ``proj``, ``dense_h_to_4h`` and
``dense_4h_to_h`` are ``c_fc`` and ``c_proj``.

GGUF (llama.cpp's architecture bloom, :data:`GGUF`): the converter regroups ``query_key_value``'s rows as q, k,
v apart (``attn_qkv``), put back per head when read (and regrouped so when written); llama.cpp's ALiBi has
the same slopes (its maximum bias 8, fixed), its MLP is ``feed_forward_length`` wide (4C as the converter
writes it).

:func:`hf_config` says a model as BLOOM's ``config.json`` (for the GGUF writer, :mod:`selfattn.families.writing`),
with the sizes under ``transformers``' generic names beside (``num_hidden_layers``, ``intermediate_size``,
``max_position_embeddings``: what the GGUF fields are read from); its context is :data:`BLOCK_SIZE`, as every
BLOOM's read here.
"""
from __future__ import annotations

from torch import Tensor

from selfattn.config import GPTConfig
from selfattn.families import _config, _gguf, _names

MODEL_TYPES = ("bloom",)

BLOCK_SIZE = 2048  # BLOOM's training length; ALiBi itself sets no limit
_DEFAULTS = dict(layer_norm_epsilon=1e-5, apply_residual_connection_post_layernorm=False,
                 tie_word_embeddings=True)  # what transformers' BloomConfig assumes
OUTSIDE = {"wte.weight": "transformer.word_embeddings.weight",
           "ln_emb.weight": "transformer.word_embeddings_layernorm.weight",
           "ln_emb.bias": "transformer.word_embeddings_layernorm.bias", "ln_f.weight": "transformer.ln_f.weight",
           "ln_f.bias": "transformer.ln_f.bias", "lm_head.weight": "lm_head.weight"}
LAYER = "transformer.h.{i}."  # the folder's prefix of layer i
GGUF = _gguf.Names({"bloom": "bloom"},
                   fields=_gguf.LAYER_NORM_FIELDS,
                   outside={"token_embd.weight": "transformer.word_embeddings.weight",
                            "token_embd_norm.weight": "transformer.word_embeddings_layernorm.weight",
                            "token_embd_norm.bias": "transformer.word_embeddings_layernorm.bias",
                            "output_norm.weight": "transformer.ln_f.weight",
                            "output_norm.bias": "transformer.ln_f.bias", "output.weight": "lm_head.weight"},
                   in_block={"attn_norm": "input_layernorm", "attn_qkv": "self_attention.query_key_value",
                             "attn_output": "self_attention.dense", "ffn_norm": "post_attention_layernorm",
                             "ffn_up": "mlp.dense_h_to_4h", "ffn_down": "mlp.dense_4h_to_h"},
                   layer="transformer.h.{i}.", by_head=frozenset({"attn_qkv"}))
IN_LAYER = {"ln_1": "input_layernorm", "ln_2": "post_attention_layernorm", "attn.qkv": "self_attention.query_key_value",
            "attn.proj": "self_attention.dense", "mlp.c_fc": "mlp.dense_h_to_4h", "mlp.c_proj": "mlp.dense_4h_to_h"}


@_config.naming_the_file
def config(hf: dict, blocks: int | None = None) -> GPTConfig:
    """BLOOM's decoder that ``config.json`` (the dict ``hf``) describes; ``config(hf, where)`` names the file."""
    hf = {"n_layer": hf.get("num_hidden_layers"), "n_head": hf.get("num_attention_heads"), **hf}  # either name
    c = _config.filled(hf, _DEFAULTS, ("vocab_size", "hidden_size", "n_layer", "n_head"))
    if c["apply_residual_connection_post_layernorm"]:
        raise ValueError("apply_residual_connection_post_layernorm is not supported: the residual stream carries "
                         "each block's input, not its normed input")
    n_layer = _config.layers(c, blocks, "n_layer")
    n_head, _, _ = _config.heads(c, None, "n_head")
    return GPTConfig(vocab_size=c["vocab_size"], block_size=BLOCK_SIZE, n_layer=n_layer, n_head=n_head,
                     n_embd=c["hidden_size"], bias=True, pos="none",
                     alibi=True, mlp_kind="gelu", gelu_approximate="tanh", norm="layernorm",
                     layer_norm_eps=c["layer_norm_epsilon"], embedding_norm=True,
                     tie_embeddings=c["tie_word_embeddings"])


def sources(key: str, config: GPTConfig) -> list[str]:
    return _names.sources(key, config, outside=OUTSIDE, layer=LAYER, in_layer=IN_LAYER)


def arrange(key: str, tensor: Tensor, config: GPTConfig) -> Tensor:
    """Our fused qkv rows ``(3, H, D)`` from BLOOM's per-head ``(H, 3, D)``; other tensors as they are."""
    if not key.endswith(("attn.qkv.weight", "attn.qkv.bias")):
        return tensor
    H = config.n_head
    per_head = tensor.unflatten(0, (H, 3, -1))  # (H, 3, D[, C])
    return per_head.transpose(0, 1).flatten(0, 2)  # (3·H·D[, C]) with q, k, v apart


def hf_config(config: GPTConfig, model_type: str) -> dict:
    """The ``config.json`` of BLOOM for ``config`` (read it back with :func:`config` to know whether it
    says all of ``config``)."""
    c = config
    return dict(architectures=["BloomForCausalLM"], model_type=model_type, vocab_size=c.vocab_size,
                hidden_size=c.n_embd, num_hidden_layers=c.n_layer, num_attention_heads=c.n_head,
                intermediate_size=4 * c.n_embd, max_position_embeddings=c.block_size,
                layer_norm_epsilon=c.layer_norm_eps, apply_residual_connection_post_layernorm=False,
                tie_word_embeddings=c.tie_embeddings)
