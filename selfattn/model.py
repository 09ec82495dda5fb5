"""The transformer built on :class:`~selfattn.attention.SelfAttention`: GPT with a KV cache.

The seed's "stack it with a feed-forward block and residuals and you have a transformer":
token embedding (+ learned positions, or RoPE inside attention), ``n_layer`` pre-norm
blocks ``x + attn(ln_1(x))``, ``x + mlp(ln_2(x))``, a final norm, and an LM head tied
to the token embedding. With ``bias=True`` and learned positions it is GPT-2, weight for
weight (see :mod:`selfattn.hf`).

One decoder for every family. A block is described by data, never by a family's name:
- norms (:mod:`selfattn.norms`): LayerNorm or RMSNorm, its epsilon, offset and rounding; where
  they stand (``norm_position``): before each sublayer (``"pre"``: GPT-2, Llama), before and
  after (``"sandwich"``: Gemma 2 and 3), or after it only (``"post"``: OLMo 2,
  ``x + norm(attn(x))``); one after the embedding (``embedding_norm``: BLOOM);
- the MLP: GELU (GPT-2, BLOOM), gated SwiGLU or GeGLU of ``intermediate_size`` (Llama, Gemma),
  or a mixture of experts (gpt-oss: a router with a bias, softmax over the top k, clamped
  SwiGLU experts with biases);
- attention: ``head_dim``, where the biases are, q/k norms (per head or over the projection),
  the scale, soft-capping, learned sinks, ALiBi; which layers slide over a ``window``
  (``window_layers``) and the RoPE of those layers (``window_rope_base``); RoPE scaling and
  partial rotary;
- embeddings scaled (``embedding_scale``: Gemma's sqrt(C)), the head tied or not, and final
  logits soft-capped (``logit_softcap``).
The defaults are GPT-2's shape; the families of :mod:`selfattn.models` set the rest.

Padding. Batches of prompts of different lengths are left-padded and described by an
``attention_mask`` ``(B, S)`` (1 = real token) over every position, cached ones included.
Positions count real tokens only (``cumsum(mask) - 1``, 0 on padding), padding keys are
never attended to, so a padded row computes exactly what the prompt would alone.

Context parallelism. ``forward(idx, targets, shard=shard)`` runs the model on one rank's part
of sequences split across processes (a :class:`~selfattn.distributed.SequenceShard`): the
tokens get their global positions and every attention layer is ring attention over the whole
sequence; the loss is the mean over this rank's positions.

Decoding. :meth:`GPT.new_cache` preallocates one :class:`~selfattn.kv_cache.KVCache` per
layer (a :class:`~selfattn.kv_cache.RollingKVCache` of ``window`` slots for each sliding-window
layer); a forward with ``cache=`` runs only the new tokens and appends their keys and values.
:meth:`GPT.generate` prefills the prompt once and then feeds one token per step, or with
``speculative=`` checks several drafted tokens per forward (:mod:`selfattn.speculative`).
"""
from __future__ import annotations

import math
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from selfattn import _validate, backends, decode_step, norms
from selfattn.attention import SelfAttention
from selfattn.decode_layout import decode_layout
from selfattn.kv_cache import KVCache, RollingKVCache
from selfattn.norms import Norm
from selfattn.rope import check_scaling
from selfattn.sampling import check_sampling, next_token
from selfattn.speculative import Speculative, resolve
from selfattn.speculative import decode as speculative_decode

if TYPE_CHECKING:  # the core never imports the distributed layer; a shard is handed in
    from selfattn.distributed import SequenceShard


@dataclass
class GPTConfig:
    vocab_size: int = 256  # V, tokens 0..V-1
    block_size: int = 256  # the longest sequence (prompt + cache) the model accepts
    n_layer: int = 4  # number of transformer blocks
    n_head: int = 4  # H query heads, head_dim D = n_embd / n_head
    n_embd: int = 128  # C, the residual stream width
    n_kv_head: int | None = None  # Hkv key/value heads (GQA; 1 = MQA); None = n_head
    head_dim: int | None = None  # D set apart from the width (H·D need not be C); None = n_embd / n_head
    bias: bool = False  # biases in every Linear and LayerNorm (GPT-2: True), but where overridden below
    qkv_bias: bool | None = None  # biases on the q/k/v projection (Qwen2: True with bias=False); None = bias
    proj_bias: bool | None = None  # bias on the attention's output projection (Llama's attention_bias); None = bias
    dropout: float = 0.0  # on embeddings, attention weights and residual branches, training only
    pos: str = "learned"  # "learned" absolute position embeddings (GPT-2), "rope" (rotary), or "none" (e.g. with alibi)
    rope_base: float = 10000.0  # RoPE frequency base, used with pos="rope" (transformers' rope_theta)
    rope_scaling: dict | None = None  # a RoPE context-extension rule (selfattn.rope: linear, llama3, yarn, longrope)
    rope_dims: int | None = None  # RoPE rotates the first rope_dims channels of each head (partial rotary); None = all
    window: int | None = None  # sliding-window attention: each token sees its `window` most recent tokens
    window_layers: list | None = None  # with a window: one bool per layer, True = that layer slides; None = all do
    window_rope_base: float | None = None  # sliding layers' RoPE base, without rope_scaling (Gemma 3); None = same
    sink_tokens: int | None = None  # with a window: the first n tokens stay visible to every token (StreamingLLM)
    alibi: bool = False  # ALiBi distance biases with the paper's slopes (BLOOM, MPT; with pos="none")
    softcap: float | None = None  # attention scores soft-capped to softcap * tanh(score / softcap) (Gemma 2)
    sinks: bool = False  # one learned sink logit per head in every softmax's denominator (gpt-oss)
    attn_scale: float | None = None  # the attention scores' scale; None = head_dim ** -0.5
    qk_norm: str | None = None  # a norm on q and k before RoPE: "head" (over D: Qwen3, Gemma 3), "projection" (OLMo 2)
    backend: str = "auto"  # attention backend: "auto", "math", "sdpa", "tiled", "flex", "triton"
    mlp: bool = True  # False = attention-only transformer: blocks without MLP and ln_2
    mlp_kind: str = "gelu"  # "gelu" (GPT-2), "swiglu" (Llama), "geglu" (Gemma): down(act(gate(x)) * up(x)); "moe"
    intermediate_size: int | None = None  # the MLP's hidden width (each expert's); None = 4 * n_embd
    n_experts: int | None = None  # mlp_kind="moe": the number of experts
    experts_per_token: int = 2  # mlp_kind="moe": the top k experts each token is routed to
    expert_clamp: float = 7.0  # mlp_kind="moe": the experts' SwiGLU clamps gate and up to this (gpt-oss)
    norm: str = "layernorm"  # every norm: "layernorm" (GPT-2) or "rmsnorm" (Llama; in float32, a weight, no bias)
    layer_norm_eps: float = 1e-5  # the epsilon of every norm, LayerNorm or RMSNorm (GPT-2: 1e-5)
    norm_offset: float = 0.0  # RMSNorm scales by norm_offset + weight (Gemma: 1.0, the weight stored as w of 1 + w)
    norm_weight_in_float32: bool = False  # RMSNorm's weight multiplies in float32, then casts (Gemma, OLMo 2)
    norm_position: str = "pre"  # "pre": x + f(norm(x)), "sandwich": x + norm(f(norm(x))), "post": x + norm(f(x))
    embedding_norm: bool = False  # a norm right after the token embedding (BLOOM)
    embedding_scale: float | None = None  # token embeddings multiplied by this, in their dtype (Gemma: sqrt(n_embd))
    gelu_approximate: str = "tanh"  # GELU in the MLP: "tanh" (GPT-2's "gelu_new") or "none" (exact erf)
    tie_embeddings: bool = True  # the LM head is the token embedding (GPT-2); False: a (V, C) matrix of its own
    logit_softcap: float | None = None  # final logits soft-capped to c * tanh(logits / c) (Gemma 2)

    def __post_init__(self):
        _validate.positive_ints(vocab_size=self.vocab_size, block_size=self.block_size, n_layer=self.n_layer,
                                n_head=self.n_head, n_embd=self.n_embd)
        for name, allowed in (("pos", _POSITIONS), ("mlp_kind", tuple(_MLPS)), ("norm", norms.KINDS),
                              ("gelu_approximate", ("tanh", "none")), ("norm_position", _NORM_POSITIONS),
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


_POSITIONS = ("learned", "rope", "none")
_NORM_POSITIONS = ("pre", "sandwich", "post")


class MLP(nn.Module):
    """The feed-forward block: ``Linear(C, I)``, GELU, ``Linear(I, C)``, dropout (I = 4C by default)."""

    def __init__(self, config: GPTConfig):
        super().__init__()
        width = config.intermediate_size or 4 * config.n_embd
        self.c_fc = nn.Linear(config.n_embd, width, bias=config.bias)
        self.gelu = nn.GELU(approximate=config.gelu_approximate)
        self.c_proj = nn.Linear(width, config.n_embd, bias=config.bias)
        self.dropout = nn.Dropout(config.dropout)

    @property
    def out_weight(self) -> Tensor:
        """The projection back into the residual stream."""
        return self.c_proj.weight

    def forward(self, x: Tensor) -> Tensor:
        return self.dropout(self.c_proj(self.gelu(self.c_fc(x))))  # (B, T, I) inside, (B, T, C) out


class GatedMLP(nn.Module):
    """The gated feed-forward block: ``down(act(gate(x)) * up(x))``, dropout; width I. SiLU
    makes it SwiGLU (Llama), GELU GeGLU (Gemma). gate and up are one ``Linear(C, 2I)``, gate's
    rows first: one matrix product instead of two."""

    def __init__(self, config: GPTConfig):
        super().__init__()
        width = config.intermediate_size or 4 * config.n_embd
        self.gate_up_proj = nn.Linear(config.n_embd, 2 * width, bias=config.bias)
        self.act = nn.SiLU() if config.mlp_kind == "swiglu" else nn.GELU(approximate=config.gelu_approximate)
        self.down_proj = nn.Linear(width, config.n_embd, bias=config.bias)
        self.dropout = nn.Dropout(config.dropout)

    @property
    def out_weight(self) -> Tensor:
        return self.down_proj.weight

    def forward(self, x: Tensor) -> Tensor:
        gate, up = self.gate_up_proj(x).chunk(2, dim=-1)  # (B, T, I) each
        return self.dropout(self.down_proj(self.act(gate) * up))  # (B, T, C)


class MoE(nn.Module):
    """A mixture of experts (gpt-oss): a router ``Linear(C, E)`` with a bias picks each token's
    top k experts, their logits softmaxed over the k; each expert is a clamped SwiGLU with
    biases, ``down((up + 1) · gate · sigmoid(1.702 · gate))``, gate clamped above and up on
    both sides at ``expert_clamp``; the token's output is the weighted sum of its k experts'.

    The experts' weights are stored (in, out), gate and up interleaved along the last dim
    (``gate_up_proj`` ``(E, C, 2I)``, gate at even columns), as gpt-oss ships them. A loop over
    the experts any token is routed to runs each on every token and adds its output where it was
    routed (weight zero elsewhere, which adds an exact 0.0): gathering the routed tokens alone
    would make the matrix product's shape, and so its rounding, depend on the other tokens'
    routing, and a token's output must never move when a later token changes. It costs up to
    ``E / k`` times the routed work on long prompts, nothing extra when decoding one token.
    """
    ALPHA = 1.702  # the sigmoid's slope in the experts' gate (gpt-oss)

    def __init__(self, config: GPTConfig):
        super().__init__()
        C, E, width = config.n_embd, config.n_experts, config.intermediate_size or 4 * config.n_embd
        self.top_k, self.clamp = config.experts_per_token, config.expert_clamp
        self.router = nn.Linear(C, E, bias=True)
        self.gate_up_proj = nn.Parameter(torch.empty(E, C, 2 * width))
        self.gate_up_bias = nn.Parameter(torch.zeros(E, 2 * width))
        self.down_proj = nn.Parameter(torch.empty(E, width, C))
        self.down_bias = nn.Parameter(torch.zeros(E, C))
        self.dropout = nn.Dropout(config.dropout)

    @property
    def out_weight(self) -> Tensor:
        return self.down_proj

    def forward(self, x: Tensor) -> Tensor:
        B, T, C = x.shape
        tokens = x.reshape(B * T, C)  # (N, C)
        top, experts = self.router(tokens).topk(self.top_k, dim=-1)  # (N, k) logits and expert ids
        weights = top.softmax(dim=-1)  # (N, k)
        out = torch.zeros_like(tokens)  # (N, C)
        for e in experts.unique().tolist():
            weight = (weights * (experts == e)).sum(dim=-1, keepdim=True)  # (N, 1) expert e's weight, 0 if not routed
            gate_up = tokens @ self.gate_up_proj[e] + self.gate_up_bias[e]  # (N, 2I)
            gate, up = gate_up[:, ::2].clamp(max=self.clamp), gate_up[:, 1::2].clamp(-self.clamp, self.clamp)
            y = ((up + 1) * gate * torch.sigmoid(gate * self.ALPHA)) @ self.down_proj[e] + self.down_bias[e]  # (N, C)
            out += (y * weight).to(out.dtype)
        return self.dropout(out.view(B, T, C))


_MLPS = {"gelu": MLP, "swiglu": GatedMLP, "geglu": GatedMLP, "moe": MoE}  # config.mlp_kind -> the feed-forward block


class Block(nn.Module):
    """One transformer block, ``x + post(attn(pre(x)))`` then ``x + post(mlp(pre(x)))``, where
    ``pre`` (``ln_1``, ``ln_2``) and ``post`` (``post_ln_1``, ``post_ln_2``) are norms or
    identities by ``config.norm_position`` (the second step is absent, with ``ln_2``, ``mlp``
    and ``post_ln_2`` None, when ``config.mlp`` is False). Layer ``i`` takes its window and
    RoPE from the config."""

    def __init__(self, config: GPTConfig, i: int):
        super().__init__()
        norm, where = config.norm_spec(), config.norm_position
        make_pre = (lambda: norm(config.n_embd)) if where in ("pre", "sandwich") else nn.Identity
        make_post = (lambda: norm(config.n_embd)) if where in ("sandwich", "post") else nn.Identity
        rope_base, rope_scaling = config.layer_rope(i)
        self.ln_1, self.post_ln_1 = make_pre(), make_post()
        self.attn = SelfAttention(config.n_embd, config.n_head, n_kv_head=config.n_kv_head, head_dim=config.head_dim,
                                  bias=config.bias if config.proj_bias is None else config.proj_bias,
                                  qkv_bias=config.bias if config.qkv_bias is None else config.qkv_bias,
                                  dropout=config.dropout, scale=config.attn_scale, rope=config.pos == "rope",
                                  rope_base=rope_base, rope_scaling=rope_scaling, rope_dims=config.rope_dims,
                                  qk_norm=norm if config.qk_norm else None, qk_norm_over=config.qk_norm or "head",
                                  window=config.layer_window(i), alibi=config.alibi,
                                  sink_tokens=config.sink_tokens if config.layer_window(i) is not None else None,
                                  softcap=config.softcap, sinks=config.sinks, backend=config.backend)
        self.ln_2 = self.mlp = self.post_ln_2 = None
        if config.mlp:
            self.ln_2, self.post_ln_2 = make_pre(), make_post()
            self.mlp = _MLPS[config.mlp_kind](config)

    def forward(self, x: Tensor, *, key_padding_mask: Tensor | None = None, positions: Tensor | None = None,
                cache: KVCache | None = None, prefix_len: int | Tensor | None = None,
                shard: SequenceShard | None = None, rope_angles: dict | None = None) -> Tensor:
        x = x + self.post_ln_1(self.attn(self.ln_1(x), key_padding_mask=key_padding_mask, positions=positions,
                                         cache=cache, prefix_len=prefix_len, shard=shard, rope_angles=rope_angles))
        if self.mlp is not None:
            x = x + self.post_ln_2(self.mlp(self.ln_2(x)))
        return x


class GPT(nn.Module):
    """A GPT language model, ``idx (B, T) -> logits (B, T, V)``; see the module docstring."""

    def __init__(self, config: GPTConfig):
        super().__init__()
        if not isinstance(config, GPTConfig):
            raise TypeError(f"GPT expects a GPTConfig, got {type(config).__name__}")
        self.config = config
        self.wte = nn.Embedding(config.vocab_size, config.n_embd)
        self.wpe = nn.Embedding(config.block_size, config.n_embd) if config.pos == "learned" else None
        self.ln_emb = config.norm_spec()(config.n_embd) if config.embedding_norm else None
        self.drop = nn.Dropout(config.dropout)
        self.blocks = nn.ModuleList(Block(config, i) for i in range(config.n_layer))
        self.ln_f = config.norm_spec()(config.n_embd)
        self.lm_head = nn.Linear(config.n_embd, config.vocab_size, bias=False)
        if config.tie_embeddings:
            self.lm_head.weight = self.wte.weight  # tied: one (V, C) matrix embeds and un-embeds
        self._compiled = None  # a decode_step.CompiledDecode, set by compile_decode
        self._init_weights()

    @torch.no_grad()
    def _init_weights(self) -> None:
        """GPT-2: every weight N(0, 0.02), biases 0, norms 1 and 0, and the two residual
        projections of each block N(0, 0.02 / sqrt(2 * n_layer)), since 2 * n_layer branches add up."""
        for module in self.modules():
            if isinstance(module, (nn.Linear, nn.Embedding)):
                nn.init.normal_(module.weight, mean=0.0, std=0.02)
            if isinstance(module, nn.Linear) and module.bias is not None:
                nn.init.zeros_(module.bias)
            if isinstance(module, MoE):
                nn.init.normal_(module.gate_up_proj, mean=0.0, std=0.02)
        residual_std = 0.02 / math.sqrt(2 * self.config.n_layer)
        for block in self.blocks:
            nn.init.normal_(block.attn.proj.weight, mean=0.0, std=residual_std)
            if block.mlp is not None:
                nn.init.normal_(block.mlp.out_weight, mean=0.0, std=residual_std)

    @classmethod
    def empty(cls, config: GPTConfig) -> GPT:
        """A model of ``config`` whose weights are allocated but not initialised, for a loader that
        fills every one of them (built on the meta device: no random numbers drawn, no time spent
        on an initialisation the loaded weights replace). A tied head stays tied."""
        with torch.device("meta"):
            model = cls(config)
        model.to_empty(device="cpu")
        if config.tie_embeddings:
            model.lm_head.weight = model.wte.weight  # to_empty gives each module a tensor of its own
        return model

    def num_params(self, non_embedding: bool = False) -> int:
        """Number of parameters (a tied embedding/head counted once). ``non_embedding``
        leaves out the position embeddings; the token embedding stays (tied, it is also the head)."""
        n = sum(p.numel() for p in self.parameters())
        if non_embedding and self.wpe is not None:
            n -= self.wpe.weight.numel()
        return n

    @torch.no_grad()
    def decode_layout(self, *, one_row: str | None = None, few_rows: str | None = None) -> GPT:
        """Store and multiply the weights as decoding reads them fastest; returns self.

        Shapes, values and ``state_dict`` are unchanged: every ``nn.Linear`` multiplies one row
        and a few rows by the product forms measured fastest here for its dtype (``torch.mv``,
        ``F.linear``, ``W·xᵀ`` or the C++ stream kernel; or the ones named by ``one_row``
        and ``few_rows``: see :mod:`selfattn.decode_layout`), the matrices stored in the memory
        order the one-row form reads.
        Meant for inference: it slows the token-embedding lookups of training.
        """
        return decode_layout(self, one_row=one_row, few_rows=few_rows)

    def compile_decode(self) -> GPT:
        """Let :meth:`generate` run each decoded token through one compiled step
        (:mod:`selfattn.decode_step`): the embedding, every block and the head in one
        ``torch.compile`` graph, which serves every later step and generation (for a pre-norm
        decoder on the CPU, Llama's or GPT-2's, one call of a C++ kernel instead:
        :mod:`selfattn.decode_kernel`); speculative decoding's drafts and verifications run through
        compiled graphs of their own. The first generation compiles them (seconds; tens of seconds
        for a 135M model). The same tokens as eager decoding in float32; in half precision the fused
        graph rounds less often, so a near-tie may break the other way. A ValueError for a model
        with a sliding-window layer. Returns the model."""
        self._compiled = decode_step.CompiledDecode(self)
        return self

    @property
    def max_positions(self) -> int | None:
        """The longest sequence the model can read: ``block_size`` with learned positions or any
        layer that sees every earlier token; None (no limit) when every layer slides over a window
        and there are no learned positions, which decodes with rolling caches."""
        every_layer_slides = all(block.attn.window is not None for block in self.blocks)
        return None if every_layer_slides and self.wpe is None else self.config.block_size

    def new_cache(self, batch_size: int, max_len: int | None = None, *,
                  rollback: int = 0) -> list[KVCache | RollingKVCache]:
        """One empty cache per layer for ``batch_size`` rows, in the model's dtype and device: a
        :class:`KVCache` of up to ``max_len`` positions (default and maximum ``block_size``), or
        for a sliding-window layer a :class:`RollingKVCache` of ``window`` (+ sink) slots, which
        takes any number of positions, and ``rollback`` more so that it can be truncated back
        that many positions (speculative decoding)."""
        _validate.positive_int("batch_size", batch_size)
        w, cfg = self.wte.weight, self.config
        max_len = cfg.block_size if max_len is None else _validate.positive_int("max_len", max_len)
        if max_len > cfg.block_size and self.max_positions is not None:
            raise ValueError(f"max_len={max_len} exceeds block_size={cfg.block_size}")
        return [KVCache(batch_size, block.attn.n_kv_head, max_len, block.attn.head_dim, dtype=w.dtype, device=w.device)
                if block.attn.window is None else
                RollingKVCache(batch_size, block.attn.n_kv_head, block.attn.window, block.attn.head_dim,
                               sink_tokens=block.attn.sink_tokens or 0, rollback=rollback, dtype=w.dtype,
                               device=w.device)
                for block in self.blocks]

    def forward(self, idx: Tensor, targets: Tensor | None = None, *, attention_mask: Tensor | None = None,
                cache: Sequence[KVCache] | None = None, prefix_len: int | Tensor | None = None,
                shard: SequenceShard | None = None) -> tuple[Tensor, Tensor | None]:
        """Logits ``(B, T, V)`` for token ids ``idx`` ``(B, T)``, and the mean cross-entropy
        against ``targets`` ``(B, T)`` (positions with -100 ignored) when given, else None.

        attention_mask: ``(B, S)`` bool or 0/1 ints over every position, cached ones
            included (S = cached + T); 0 marks padding. Pass it on every call of a sequence.
        cache: from :meth:`new_cache`; the T tokens continue the cached ones.
        prefix_len: prefix-LM, an int or ``(B,)``: the first P positions attend bidirectionally.
        shard: idx (and targets) are this rank's part ``shard.split(...)`` of longer sequences
            (see the module docstring); no attention_mask, cache or prefix_len with it.
        """
        self._check_idx(idx)
        B, T = idx.shape
        if shard is not None:
            self._check_shard(shard, T, attention_mask=attention_mask, cache=cache, prefix_len=prefix_len)
        past = self._check_cache(cache, B, T if shard is None else shard.length)
        mask = None if attention_mask is None else self._check_attention_mask(attention_mask, B, past + T, idx.device)
        if mask is not None and self.config.sink_tokens and not bool(mask.all()):
            raise ValueError("sink_tokens are the first positions of the sequence, and left padding would make them "
                             "padding: run padded prompts separately, or pad on the right")
        logits = self._logits(self._hidden(idx, mask, cache, past, prefix_len, shard))  # (B, T, V)
        if targets is None:
            return logits, None
        if not isinstance(targets, Tensor) or targets.shape != idx.shape or not _validate.is_integer(targets):
            raise ValueError(f"targets must be an integer tensor shaped like idx {tuple(idx.shape)}, got "
                             f"{tuple(targets.shape) if isinstance(targets, Tensor) else type(targets).__name__}")
        work = torch.promote_types(logits.dtype, torch.float32)  # half logits: the loss in float32
        loss = F.cross_entropy(logits.flatten(0, 1).to(work), targets.flatten(), ignore_index=-100)  # (B·T, V)
        return logits, loss

    def _hidden(self, idx: Tensor | None, mask: Tensor | None, cache: Sequence[KVCache] | None, past: int,
                prefix_len: int | Tensor | None = None, shard: SequenceShard | None = None, *, start: int = 0,
                stop: int | None = None, x: Tensor | None = None) -> Tensor:
        """The final hidden states ``(B, T, C)`` after ``ln_f``; inputs already validated.

        Speculative decoding runs part of the stack: blocks ``start .. stop - 1`` only, from
        ``x`` ``(B, T, C)``, the residual stream entering block ``start`` (then ``idx`` is not
        read), and a stack stopped short of the top returns its residual stream, before ``ln_f``."""
        T, device = (idx if x is None else x).shape[1], (idx if x is None else x).device
        if shard is not None:
            positions = shard.positions(device)  # (T,) this rank's tokens' places in the whole sequence
        elif mask is None:
            positions = torch.arange(past, past + T, device=device)  # (T,)
        else:
            positions = (mask.cumsum(dim=-1)[:, -T:] - 1).clamp(min=0)  # (B, T) real tokens before, 0 on padding
        if x is None:
            x = self.wte(idx)  # (B, T, C)
            if self.config.embedding_scale is not None:
                x = x * torch.tensor(self.config.embedding_scale, dtype=x.dtype)  # the scale rounded to x's dtype
            if self.wpe is not None:
                x = x + self.wpe(positions)  # (B, T, C) + (T, C) or (B, T, C)
            if self.ln_emb is not None:
                x = self.ln_emb(x)
            x = self.drop(x)
        rope_positions = positions if self.wpe is None else None
        angles = {}  # each RoPE rule's cos and sin at these positions, computed once for all layers
        stop = len(self.blocks) if stop is None else stop
        for i in range(start, stop):
            x = self.blocks[i](x, key_padding_mask=mask, positions=rope_positions,
                               cache=None if cache is None else cache[i], prefix_len=prefix_len, shard=shard,
                               rope_angles=angles)
        return self.ln_f(x) if stop == len(self.blocks) else x

    def _logits(self, h: Tensor) -> Tensor:
        """The LM head on hidden states ``h`` (..., C): logits (..., V), soft-capped if configured."""
        logits = self.lm_head(h)
        cap = self.config.logit_softcap
        return logits if cap is None else torch.tanh(logits / cap) * cap

    def generate(self, idx: Tensor, max_new_tokens: int, *, temperature: float = 1.0, top_k: int | None = None,
                 top_p: float | None = None, eos_token: int | None = None, generator: torch.Generator | None = None,
                 attention_mask: Tensor | None = None,
                 speculative: str | GPT | Speculative | None = None) -> Iterator[Tensor]:
        """Continue each prompt of ``idx`` ``(B, T)``: an iterator yielding one ``(B,)`` int64
        tensor of new tokens per step (streaming), at most ``max_new_tokens`` of them.

        temperature: 0 = greedy; otherwise logits / temperature, then ``top_k``, then
            ``top_p`` (see :mod:`selfattn.sampling`), drawn with ``generator``.
        eos_token: a row that produces it is finished and yields ``eos_token`` from then on;
            the iterator stops early once every row has finished.
        attention_mask: ``(B, T)`` for left-padded prompts (the last column must be real);
            each row then generates what its prompt would alone.
        speculative: lossless speculative decoding (:mod:`selfattn.speculative`): ``"lookup"``
            (prompt lookup), ``"self:N"`` (the first N blocks draft), a draft GPT of the same
            vocabulary, or a :class:`~selfattn.speculative.Speculative` (to set the draft length
            and read its ``stats``). Greedy, the same tokens as without it; sampling, the same
            distribution; the same stream, one token per row per step.

        Arguments are checked here, before the first step. Decoding runs under
        ``torch.inference_mode`` in the model's current train/eval mode (call ``model.eval()``
        first when dropout is on). The prompt plus all but the last new token must fit in
        ``block_size``, except for sliding-window models without learned positions
        (:attr:`max_positions` None), which decode through a rolling cache for as long as asked.
        """
        self._check_idx(idx)
        B, T = idx.shape
        _validate.count("max_new_tokens", max_new_tokens)
        check_sampling(temperature, top_k, top_p)
        if eos_token is not None and (not isinstance(eos_token, int) or not 0 <= eos_token < self.config.vocab_size):
            raise ValueError(f"eos_token must be a token id in [0, {self.config.vocab_size}), got {eos_token!r}")
        total = T + max_new_tokens - 1  # positions the model sees: the last new token is never fed back
        if self.max_positions is not None and total > self.max_positions:
            raise ValueError(f"prompt of {T} tokens + {max_new_tokens} new tokens needs {total} positions, "
                             f"more than block_size={self.config.block_size}")
        mask = None
        if attention_mask is not None:
            prompt_mask = self._check_attention_mask(attention_mask, B, T, idx.device)
            if not prompt_mask[:, -1].all():
                raise ValueError("generate needs left padding: the last prompt position of every row must be "
                                 "a real token (attention_mask[:, -1] == 1)")
            if not prompt_mask.all():  # without padding the mask would only cost time
                mask = torch.ones(B, max(total, T), dtype=torch.bool, device=idx.device)  # (B, S_max)
                mask[:, :T] = prompt_mask
        sample = dict(temperature=temperature, top_k=top_k, top_p=top_p, generator=generator)
        if speculative is not None:
            spec = resolve(speculative, self, max(total, T))
            return speculative_decode(self, spec, idx, max_new_tokens, mask, eos_token, sample)
        return self._decode(idx, max_new_tokens, mask, eos_token, sample)

    @torch.inference_mode()
    def _decode(self, idx: Tensor, max_new_tokens: int, mask: Tensor | None, eos_token: int | None,
                sample: dict) -> Iterator[Tensor]:
        """The generation loop over validated arguments; ``mask`` ``(B, S_max)`` or None."""
        if max_new_tokens == 0:
            return
        B, T = idx.shape
        step_logits = self._next_logits if self._compiled is None else self._compiled.step
        cache = self._decode_cache(B, T + max_new_tokens - 1)
        finished = None if eos_token is None else torch.zeros(B, dtype=torch.bool, device=idx.device)  # (B,)
        logits = self._next_logits(idx, None if mask is None else mask[:, :T], cache, 0)  # (B, V) prefill
        for step in range(max_new_tokens):
            tok = next_token(logits, **sample)  # (B,)
            if finished is not None:
                tok = tok.masked_fill(finished, eos_token)
                finished |= tok == eos_token
            yield tok
            if step == max_new_tokens - 1 or (finished is not None and bool(finished.all())):
                return
            S = T + step + 1  # positions after feeding this token
            logits = step_logits(tok[:, None], None if mask is None else mask[:, :S], cache, S - 1)  # (B, V)

    def _decode_cache(self, batch_size: int, fills: int, rollback: int = 0) -> list[KVCache | RollingKVCache]:
        """The caches of a generation whose last step caches ``fills`` positions; a compiled
        model's get a slot more, which its graphs never fill (see :mod:`selfattn.decode_step`)."""
        spare = int(self._compiled is not None and self.max_positions is not None and fills < self.max_positions)
        return self.new_cache(batch_size, fills + spare, rollback=rollback)

    def _next_logits(self, idx: Tensor, mask: Tensor | None, cache: Sequence[KVCache], past: int) -> Tensor:
        """Logits ``(B, V)`` of the token after ``idx`` ``(B, T)``, whose ``past`` positions are
        cached: the prefill, and with T = 1 a decode step (what :meth:`compile_decode` compiles)."""
        return self._logits(self._hidden(idx, mask, cache, past)[:, -1])

    def _check_idx(self, idx) -> None:
        if not isinstance(idx, Tensor):
            raise TypeError(f"idx must be a tensor of token ids, got {type(idx).__name__}")
        if idx.dim() != 2:
            raise ValueError(f"idx must have shape (B, T), got {tuple(idx.shape)}")
        if not _validate.is_integer(idx):
            raise TypeError(f"idx must be an integer tensor of token ids, got dtype {idx.dtype}")
        if idx.device != self.wte.weight.device:
            raise ValueError(f"idx is on {idx.device} but the model is on {self.wte.weight.device}")
        if idx.shape[1] == 0:
            raise ValueError(f"idx must hold at least one token per row, got shape {tuple(idx.shape)}")
        bad = (idx < 0) | (idx >= self.config.vocab_size)  # (B, T)
        if bad.any():
            raise ValueError(f"token ids must be in [0, vocab_size={self.config.vocab_size}), got "
                             f"{idx[bad].unique()[:8].tolist()}")

    @staticmethod
    def _check_shard(shard, T: int, **alone) -> None:
        if not hasattr(shard, "positions") or not hasattr(shard, "attention"):
            raise TypeError(f"shard must be a selfattn.distributed.SequenceShard, got {type(shard).__name__}")
        if T * shard.world != shard.length:
            raise ValueError(f"idx holds {T} positions, but a shard of {shard.length} positions over {shard.world} "
                             f"ranks holds {shard.length // shard.world}: pass shard.split(idx)")
        given = [name for name, value in alone.items() if value is not None]
        if given:
            raise ValueError(f"{', '.join(given)} cannot be combined with shard= (context parallelism)")

    def _check_cache(self, cache, B: int, T: int) -> int:
        """Validate ``cache`` against a batch of B rows and T new tokens; return the cached length."""
        past = 0
        if cache is not None:
            if not isinstance(cache, Sequence) or len(cache) != len(self.blocks) or \
                    not all(isinstance(c, (KVCache, RollingKVCache)) for c in cache):
                raise TypeError(f"cache must be the list of {len(self.blocks)} KVCache from model.new_cache(), "
                                f"got {type(cache).__name__}")
            head = cache[0]
            if head.k.shape[0] != B or head.k.dtype != self.wte.weight.dtype or head.k.device != self.wte.weight.device:
                raise ValueError(f"cache is for batch {head.k.shape[0]}, {head.k.dtype} on {head.k.device}; "
                                 f"this call has batch {B} and the model is {self.wte.weight.dtype} "
                                 f"on {self.wte.weight.device}")
            past = head.length
            limits = [c.max_len for c in cache if c.max_len is not None]  # rolling caches take any number
            if limits and past + T > min(limits):
                raise ValueError(f"cache overflow: {past} cached + {T} new tokens > max_len={min(limits)}; "
                                 f"use a larger cache or reset() it")
        if self.max_positions is not None and past + T > self.max_positions:
            raise ValueError(f"sequence of {past + T} tokens ({past} cached + {T} new) is longer than "
                             f"block_size={self.config.block_size}")
        return past

    @staticmethod
    def _check_attention_mask(mask, B: int, S: int, device) -> Tensor:
        """The mask as bool ``(B, S)`` on ``device``; S counts cached and new positions."""
        if not isinstance(mask, Tensor):
            raise TypeError(f"attention_mask must be a tensor, got {type(mask).__name__}")
        if mask.shape != (B, S):
            raise ValueError(f"attention_mask must have shape (B={B}, S={S}) covering cached and new tokens, "
                             f"got {tuple(mask.shape)}")
        if mask.is_floating_point() or mask.is_complex():
            raise TypeError(f"attention_mask must be bool or 0/1 integers, got dtype {mask.dtype}")
        if mask.dtype != torch.bool:
            if ((mask != 0) & (mask != 1)).any():
                raise ValueError(f"attention_mask must hold only 0 and 1, got values {mask.unique()[:8].tolist()}")
            mask = mask.bool()
        return mask.to(device)

