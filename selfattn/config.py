"""The decoder as data: :class:`GPTConfig`, every choice of a block and of the model, and its validation.

One config describes every family (:mod:`selfattn.families` fill it from a ``config.json``); the model
(:mod:`selfattn.model`) builds what it says and never branches on a family's name. Each field carries its
help text as metadata (``dataclasses.fields(GPTConfig)[i].metadata["help"]``), which the commands show.
"""
from __future__ import annotations

from dataclasses import dataclass

from selfattn import backends, norms
from selfattn._util import validate as _validate
from selfattn._util.fields import described
from selfattn.norms import Norm
from selfattn.rope import check_scaling

POSITIONS = ("learned", "rope", "none")
NORM_POSITIONS = ("pre", "sandwich", "post")
MLP_KINDS = ("gelu", "swiglu", "geglu", "moe")  # the feed-forward blocks of selfattn.model


@dataclass
class GPTConfig:
    vocab_size: int = described(256, 'V, tokens 0..V-1')
    block_size: int = described(256, 'the longest sequence (prompt + cache) the model accepts')
    n_layer: int = described(4, 'number of transformer blocks')
    n_head: int = described(4, 'H query heads, head_dim D = n_embd / n_head')
    n_embd: int = described(128, 'C, the residual stream width')
    n_kv_head: int | None = described(None, 'Hkv key/value heads (GQA; 1 = MQA); None = n_head')
    head_dim: int | None = described(None, 'D set apart from the width (H·D need not be C); None = n_embd / n_head')
    bias: bool = described(False, 'biases in every Linear and LayerNorm (GPT-2: True), but where overridden below')
    qkv_bias: bool | None = described(None, 'biases on the q/k/v projection (Qwen2: True with bias=False); None = bias')
    proj_bias: bool | None = described(None,
                                    "bias on the attention's output projection (Llama's attention_bias); None = bias")
    dropout: float = described(0.0, 'on embeddings, attention weights and residual branches, training only')
    pos: str = described("learned",
                      '"learned" absolute position embeddings (GPT-2), "rope" (rotary), or "none" (e.g. with alibi)')
    rope_base: float = described(10000.0, 'RoPE frequency base, used with pos="rope" (transformers\' rope_theta)')
    rope_scaling: dict | None = described(None,
                                       'a RoPE context-extension rule (selfattn.rope: linear, llama3, yarn, longrope)')
    rope_dims: int | None = described(None,
                                   'RoPE rotates the first rope_dims channels of each head (partial rotary); '
                                   'None = all')
    window: int | None = described(None, 'sliding-window attention: each token sees its `window` most recent tokens')
    window_layers: list | None = described(None,
                                        'with a window: one bool per layer, True = that layer slides; None = all do')
    window_rope_base: float | None = described(None,
                                            "sliding layers' RoPE base, without rope_scaling (Gemma 3); None = same")
    sink_tokens: int | None = described(None,
                                     'with a window: the first n tokens stay visible to every token (StreamingLLM)')
    alibi: bool = described(False, 'ALiBi distance biases with the paper\'s slopes (BLOOM, MPT; with pos="none")')
    softcap: float | None = described(None, 'attention scores soft-capped to softcap * tanh(score / softcap) (Gemma 2)')
    sinks: bool = described(False, "one learned sink logit per head in every softmax's denominator (gpt-oss)")
    attn_scale: float | None = described(None, "the attention scores' scale; None = head_dim ** -0.5")
    qk_norm: str | None = described(None,
                                 'a norm on q and k before RoPE: "head" (over D: Qwen3, Gemma 3), '
                                 '"projection" (OLMo 2)')
    backend: str = described("auto", 'attention backend: "auto", "math", "sdpa", "tiled", "flex", "triton"')
    mlp: bool = described(True, 'False = attention-only transformer: blocks without MLP and ln_2')
    mlp_kind: str = described("gelu",
                           '"gelu" (GPT-2), "swiglu" (Llama), "geglu" (Gemma): down(act(gate(x)) * up(x)); "moe"')
    intermediate_size: int | None = described(None, "the MLP's hidden width (each expert's); None = 4 * n_embd")
    n_experts: int | None = described(None, 'mlp_kind="moe": the number of experts')
    experts_per_token: int = described(2, 'mlp_kind="moe": the top k experts each token is routed to')
    expert_clamp: float = described(7.0, 'mlp_kind="moe": the experts\' SwiGLU clamps gate and up to this (gpt-oss)')
    norm: str = described("layernorm",
                       'every norm: "layernorm" (GPT-2) or "rmsnorm" (Llama; in float32, a weight, no bias)')
    layer_norm_eps: float = described(1e-5, 'the epsilon of every norm, LayerNorm or RMSNorm (GPT-2: 1e-5)')
    norm_offset: float = described(0.0,
                                'RMSNorm scales by norm_offset + weight (Gemma: 1.0, the weight stored as w of 1 + w)')
    norm_weight_in_float32: bool = described(False,
                                             "RMSNorm's weight multiplies in float32, then casts (Gemma, OLMo 2)")
    norm_position: str = described("pre",
                                '"pre": x + f(norm(x)), "sandwich": x + norm(f(norm(x))), "post": x + norm(f(x))')
    embedding_norm: bool = described(False, 'a norm right after the token embedding (BLOOM)')
    embedding_scale: float | None = described(None,
                                           'token embeddings multiplied by this, in their dtype (Gemma: sqrt(n_embd))')
    gelu_approximate: str = described("tanh", 'GELU in the MLP: "tanh" (GPT-2\'s "gelu_new") or "none" (exact erf)')
    tie_embeddings: bool = described(True,
                                     'the LM head is the token embedding (GPT-2); False: a (V, C) matrix of its own')
    logit_softcap: float | None = described(None, 'final logits soft-capped to c * tanh(logits / c) (Gemma 2)')

    def __post_init__(self):
        _validate.positive_ints(vocab_size=self.vocab_size, block_size=self.block_size, n_layer=self.n_layer,
                                n_head=self.n_head, n_embd=self.n_embd)
        for name, allowed in (("pos", POSITIONS), ("mlp_kind", MLP_KINDS), ("norm", norms.KINDS),
                              ("gelu_approximate", ("tanh", "none")), ("norm_position", NORM_POSITIONS),
                              ("qk_norm", (None, "head", "projection"))):
            if getattr(self, name) not in allowed:
                raise ValueError(f"{name} must be one of {', '.join(map(repr, allowed))}, got {getattr(self, name)!r}")
        _validate.positive_number("layer_norm_eps", self.layer_norm_eps)
        if self.intermediate_size is not None:
            _validate.positive_int("intermediate_size", self.intermediate_size)
        for name in ("qkv_bias", "proj_bias"):
            if getattr(self, name) is not None:
                _validate.flag(name, getattr(self, name))
        for name in ("tie_embeddings", "norm_weight_in_float32", "embedding_norm"):
            _validate.flag(name, getattr(self, name))
        for name in ("embedding_scale", "logit_softcap", "attn_scale", "window_rope_base"):
            if getattr(self, name) is not None:
                _validate.positive_number(name, getattr(self, name))
        self.norm_spec()  # raises on a norm_offset of a LayerNorm
        if self.mlp_kind == "moe":
            _validate.positive_ints(n_experts=self.n_experts, experts_per_token=self.experts_per_token)
            if self.experts_per_token > self.n_experts:
                raise ValueError(f"experts_per_token={self.experts_per_token} exceeds n_experts={self.n_experts}")
            _validate.positive_number("expert_clamp", self.expert_clamp)
        if self.window_layers is not None:
            if self.window is None:
                raise ValueError("window_layers says which layers slide over the window, but window is None")
            if not isinstance(self.window_layers, list) or len(self.window_layers) != self.n_layer or \
                    not all(isinstance(w, bool) for w in self.window_layers):
                raise ValueError(f"window_layers must be a list of n_layer={self.n_layer} bools, got "
                                 f"{self.window_layers!r}")
        if self.rope_dims is not None:
            _validate.positive_int("rope_dims", self.rope_dims)
        check_scaling(self.rope_scaling, self.rope_dims or self.head_dim or self.n_embd // self.n_head)
        if self.alibi and self.sink_tokens:
            raise ValueError("alibi with sink_tokens is not supported: the rolling cache keeps the sinks next to the "
                             "window, so their index distance is not their position distance that ALiBi needs")
        backends.resolve(self.backend)  # raises on an unknown name; head sizes are checked by SelfAttention

    def norm_spec(self) -> Norm:
        """How every norm of this model is made (:class:`~selfattn.norms.Norm`)."""
        return Norm(self.norm, self.layer_norm_eps, bias=self.bias, offset=self.norm_offset,
                    weight_in_float32=self.norm_weight_in_float32)

    def layer_window(self, i: int) -> int | None:
        """The window layer ``i`` slides over, None when it sees every earlier token."""
        return self.window if self.window_layers is None or self.window_layers[i] else None

    def layer_rope(self, i: int) -> tuple[float, dict | None]:
        """RoPE base and scaling rule of layer ``i``."""
        if self.window_rope_base is not None and self.layer_window(i) is not None:
            return self.window_rope_base, None
        return self.rope_base, self.rope_scaling
