"""GPT-2 (``model_type`` gpt2): learned positions, LayerNorms and biases everywhere, a GELU MLP of 4C, a tied head.

The default block of this library (``GPTConfig()`` with ``bias=True``). A GPT-2 folder is read through
``transformers`` (:mod:`selfattn.io.hf`), whose ``Conv1D`` stores a weight as ``(in, out)``; this mapping names
our tensors as GPT-2 does (``transformer.h.{i}.attn.c_attn``, ...) in ``nn.Linear``'s ``(out, in)``, the layout
llama.cpp's files hold: it serves the GGUF reader and writer, and LoRA adapters (peft's on GPT-2 are
``(r, in)`` and ``(out, r)`` whichever layout the weight has).

GGUF (llama.cpp's architecture gpt2, :data:`GGUF`): the converter transposes the ``Conv1D`` weights (``attn_qkv``
of q, k, v rows apart, as ours), writes the positions as ``position_embd`` and ``context_length`` as their
number, the MLP 4C wide. llama.cpp needs every bias (a model without them is written with zeros, the same
function) and computes GELU's tanh approximation (``gelu_new``) whatever the file says (:data:`GGUF`'s
``fixed``), so a model of the exact erf GELU is refused; its attention has one key/value head per query head.
"""
from __future__ import annotations

from selfattn._util import validate as _validate
from selfattn.config import GPTConfig
from selfattn.families import _config, _gguf, _names

MODEL_TYPES = ("gpt2",)

_GELU = {"gelu_new": "tanh", "gelu_pytorch_tanh": "tanh", "gelu": "none"}  # activation_function -> approximation
_DEFAULTS = dict(n_positions=1024, n_inner=None, activation_function="gelu_new", layer_norm_epsilon=1e-5,
                 tie_word_embeddings=True, num_key_value_heads=None, head_dim=None)  # transformers' GPT2Config
_ALIASES = {"n_embd": "hidden_size", "n_layer": "num_hidden_layers", "n_head": "num_attention_heads",
            "n_positions": "max_position_embeddings", "n_inner": "intermediate_size"}  # GPT-2's key -> generic
LAYER = "transformer.h.{i}."  # the folder's prefix of layer i
OUTSIDE = {"wte.weight": "transformer.wte.weight", "wpe.weight": "transformer.wpe.weight",
           "ln_f.weight": "transformer.ln_f.weight", "ln_f.bias": "transformer.ln_f.bias",
           "lm_head.weight": "lm_head.weight"}
IN_LAYER = {"attn.qkv": "attn.c_attn", "attn.proj": "attn.c_proj"}  # ln_1, ln_2, mlp.c_fc, mlp.c_proj: as ours
GGUF = _gguf.Names({"gpt2": "gpt2"},
                   fields=_gguf.LAYER_NORM_FIELDS,
                   outside={"token_embd.weight": "transformer.wte.weight",
                            "position_embd.weight": "transformer.wpe.weight",
                            "output_norm.weight": "transformer.ln_f.weight",
                            "output_norm.bias": "transformer.ln_f.bias",
                            "output.weight": "lm_head.weight"},
                   in_block={"attn_norm": "ln_1", "attn_qkv": "attn.c_attn", "attn_output": "attn.c_proj",
                             "ffn_norm": "ln_2", "ffn_up": "mlp.c_fc", "ffn_down": "mlp.c_proj"},
                   layer=LAYER, fixed={"activation_function": "gelu_new"})  # ggml_gelu: the tanh approximation


@_config.naming_the_file
def config(hf: dict, blocks: int | None = None) -> GPTConfig:
    """GPT-2's decoder that ``config.json`` (the dict ``hf``, GPT-2's keys or ``transformers``' generic ones,
    as a GGUF file's are read) describes; ``config(hf, where)`` names the file."""
    hf = {**hf, **{ours: hf[generic] for ours, generic in _ALIASES.items() if hf.get(generic) is not None}}
    c = _config.filled(hf, _DEFAULTS, ("vocab_size", "n_embd", "n_layer", "n_head"))
    if c["activation_function"] not in _GELU:
        raise ValueError(f"activation_function {c['activation_function']!r} is not supported; GPT-2's MLP computes "
                         f"one of {', '.join(map(repr, _GELU))}")
    n_layer = _config.layers(c, blocks, "n_layer")
    n_head, n_kv_head, head_dim = _config.heads({**c, "hidden_size": c["n_embd"]}, None, "n_head")
    if n_kv_head != n_head or c["head_dim"] not in (None, head_dim):
        raise ValueError(f"num_key_value_heads {n_kv_head} and head_dim {c['head_dim']} are not supported: GPT-2's "
                         f"attention has one key/value head per query head ({n_head}) of n_embd / n_head ({head_dim})")
    if c["n_inner"] not in (None, 4 * c["n_embd"]):
        raise ValueError(f"n_inner {c['n_inner']} is not supported: GPT-2's MLP is 4 * n_embd = {4 * c['n_embd']} wide")
    block_size = _validate.positive_int("n_positions", c["n_positions"])
    return GPTConfig(vocab_size=c["vocab_size"], block_size=block_size, n_layer=n_layer, n_head=n_head,
                     n_embd=c["n_embd"], bias=True, pos="learned", mlp_kind="gelu",
                     gelu_approximate=_GELU[c["activation_function"]], norm="layernorm",
                     layer_norm_eps=c["layer_norm_epsilon"], tie_embeddings=c["tie_word_embeddings"])


def sources(key: str, config: GPTConfig) -> list[str]:
    return _names.sources(key, config, outside=OUTSIDE, layer=LAYER, in_layer=IN_LAYER)


def hf_config(config: GPTConfig, model_type: str) -> dict:
    """The ``config.json`` of GPT-2 for ``config``, its sizes under the generic names that the GGUF fields are
    read from (read it back with :func:`config` to know whether it says all of ``config``)."""
    c = config
    return dict(architectures=["GPT2LMHeadModel"], model_type=model_type, vocab_size=c.vocab_size,
                hidden_size=c.n_embd, num_hidden_layers=c.n_layer, num_attention_heads=c.n_head,
                max_position_embeddings=c.block_size, intermediate_size=c.intermediate_size or 4 * c.n_embd,
                activation_function="gelu_new" if c.gelu_approximate == "tanh" else "gelu",
                layer_norm_epsilon=c.layer_norm_eps, tie_word_embeddings=c.tie_embeddings)
