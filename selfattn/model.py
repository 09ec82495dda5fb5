"""The transformer built on :class:`~selfattn.self_attention.SelfAttention`: GPT with a KV cache.

The seed's "stack it with a feed-forward block and residuals and you have a transformer":
token embedding (+ learned positions, or RoPE inside attention), ``n_layer`` pre-norm
blocks ``x + attn(ln_1(x))``, ``x + mlp(ln_2(x))``, a final norm, and an LM head tied
to the token embedding. With ``bias=True`` and learned positions it is GPT-2, weight for
weight (see :mod:`selfattn.io.hf`).

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
The defaults are GPT-2's shape; the families of :mod:`selfattn.families` set the rest.

Padding. Batches of prompts of different lengths are left-padded and described by an
``attention_mask`` ``(B, S)`` (1 = real token) over every position, cached ones included.
Positions count real tokens only (``cumsum(mask) - 1``, 0 on padding), padding keys are
never attended to, so a padded row computes exactly what the prompt would alone.

Packed documents. ``doc_ids`` ``(B, T)`` (non-decreasing along a row) packs several documents
into one row: positions restart at each, and no token attends to another document's, so each
computes exactly what it would alone.

Training. With ``targets`` the forward returns the loss alone, computed a chunk of positions at a
time (:mod:`selfattn.loss`: the whole ``(B, T, V)`` logits are never held); ``checkpointing = True``
makes the blocks recompute their activations in the backward instead of keeping them.

Context parallelism. ``forward(idx, targets, shard=shard)`` runs the model on one rank's part
of sequences split across processes (a :class:`~selfattn.distributed.SequenceShard`): the
tokens get their global positions and every attention layer is ring attention over the whole
sequence; the loss is the mean over this rank's positions.

Caches. :meth:`GPT.new_cache` preallocates one :class:`~selfattn.kv_cache.KVCache` per
layer (a :class:`~selfattn.kv_cache.RollingKVCache` of ``window`` slots for each sliding-window
layer); a forward with ``cache=`` runs only the new tokens and appends their keys and values.

The public API beyond ``forward``: :meth:`GPT.hidden` (the stack on checked inputs, any range of
blocks), :meth:`GPT.logits` (the head) and the checks ``check_idx``, ``check_attention_mask`` and
``check_cache``. Generation (:mod:`selfattn.generation`: ``generate``, compiled and kernel steps,
speculative decoding, int8) sits above the model and uses only these.

Taps. ``model.tap`` (None by default) is the one generic hook point: when set, the forward hands it the
tensor at each named site (TransformerLens's names: ``hook_embed``, ``blocks.3.attn.hook_z``, ...) and goes
on with what it returns (:mod:`selfattn.taps`); :mod:`selfattn.interp` builds hooks, caches and attribution
on it. Unset, the forward is its own code, untouched.
"""
from __future__ import annotations

import math
from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch
from torch import Tensor, nn
from torch.utils.checkpoint import checkpoint

from selfattn._util import validate as _validate
from selfattn.config import MLP_KINDS, GPTConfig
from selfattn.kv_cache import KVCache, RollingKVCache
from selfattn.loss import head_cross_entropy
from selfattn.self_attention import SelfAttention
from selfattn.taps import Tap, normed, scoped, site

if TYPE_CHECKING:  # the core never imports the distributed layer; a shard is handed in
    from selfattn.distributed import SequenceShard


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

    def forward(self, x: Tensor, tap: Tap | None = None) -> Tensor:
        pre = site(tap, "hook_pre", self.c_fc(x))  # (B, T, I)
        return self.dropout(self.c_proj(site(tap, "hook_post", self.gelu(pre))))  # (B, T, C)


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

    def forward(self, x: Tensor, tap: Tap | None = None) -> Tensor:
        gate, up = self.gate_up_proj(x).chunk(2, dim=-1)  # (B, T, I) each
        gate, up = site(tap, "hook_pre", gate), site(tap, "hook_pre_linear", up)
        return self.dropout(self.down_proj(site(tap, "hook_post", self.act(gate) * up)))  # (B, T, C)


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

    def forward(self, x: Tensor, tap: Tap | None = None) -> Tensor:
        B, T, C = x.shape
        tokens = x.reshape(B * T, C)  # (N, C)
        logits = self.router(tokens) if tap is None else tap("hook_router_logits", self.router(tokens))  # (N, E)
        top, experts = logits.topk(self.top_k, dim=-1)  # (N, k) logits and expert ids
        weights = top.softmax(dim=-1)  # (N, k)
        if tap is not None:  # the routing as TransformerLens shows it: (N, E) weights, 0 off the top k; (N, k) ids
            routed = tap("hook_expert_weights", weights.new_zeros(B * T, self.router.out_features).scatter(
                1, experts, weights))
            experts = tap("hook_expert_indices", experts)
            weights = routed.gather(1, experts)  # (N, k) each token's weights at its (maybe re-routed) experts
        out = torch.zeros_like(tokens)  # (N, C)
        for e in experts.unique().tolist():
            weight = (weights * (experts == e)).sum(dim=-1, keepdim=True)  # (N, 1) expert e's weight, 0 if not routed
            gate_up = tokens @ self.gate_up_proj[e] + self.gate_up_bias[e]  # (N, 2I)
            gate, up = gate_up[:, ::2].clamp(max=self.clamp), gate_up[:, 1::2].clamp(-self.clamp, self.clamp)
            y = ((up + 1) * gate * torch.sigmoid(gate * self.ALPHA)) @ self.down_proj[e] + self.down_bias[e]  # (N, C)
            out += (y * weight).to(out.dtype)
        return self.dropout(out.view(B, T, C))


_MLPS = {"gelu": MLP, "swiglu": GatedMLP, "geglu": GatedMLP, "moe": MoE}  # config.mlp_kind -> the feed-forward block
assert tuple(_MLPS) == MLP_KINDS


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

    def forward(self, x: Tensor, *, key_padding_mask: Tensor | None = None, doc_ids: Tensor | None = None,
                positions: Tensor | None = None, cache: KVCache | None = None, prefix_len: int | Tensor | None = None,
                shard: SequenceShard | None = None, rope_angles: dict | None = None, tap: Tap | None = None) -> Tensor:
        x = site(tap, "hook_resid_pre", x)
        y = self.attn(normed(self.ln_1, x, scoped(tap, "ln1.")), key_padding_mask=key_padding_mask, doc_ids=doc_ids,
                      positions=positions, cache=cache, prefix_len=prefix_len, shard=shard, rope_angles=rope_angles,
                      tap=scoped(tap, "attn."))
        x = x + site(tap, "hook_attn_out", normed(self.post_ln_1, y, scoped(tap, "ln1_post.")))
        if self.mlp is not None:
            x = site(tap, "hook_resid_mid", x)
            y = self.mlp(normed(self.ln_2, x, scoped(tap, "ln2.")), tap=scoped(tap, "mlp."))
            x = x + site(tap, "hook_mlp_out", normed(self.post_ln_2, y, scoped(tap, "ln2_post.")))
        return site(tap, "hook_resid_post", x)


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
        self.checkpointing = False  # True: blocks recompute their activations in the backward (less memory)
        self.tap: Tap | None = None  # called at every named site of a forward when set (selfattn.taps, .interp)
        self._init_weights()

    @torch.no_grad()
    def _init_weights(self) -> None:
        """GPT-2: every weight N(0, 0.02), biases 0, norms 1 and 0, and the two residual
        projections of each block N(0, 0.02 / sqrt(2 * n_layer)), since 2 * n_layer branches add up.
        Nothing on the meta device, whose tensors hold no values (a loader's sizes-only model)."""
        if self.wte.weight.is_meta:
            return
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
                doc_ids: Tensor | None = None, cache: Sequence[KVCache] | None = None,
                prefix_len: int | Tensor | None = None, shard: SequenceShard | None = None
                ) -> tuple[Tensor | None, Tensor | None]:
        """``(logits, None)``: logits ``(B, T, V)`` for token ids ``idx`` ``(B, T)``; or, with
        ``targets`` ``(B, T)``, ``(None, loss)``: the mean cross-entropy (positions with -100 ignored),
        computed a chunk of positions at a time (:mod:`selfattn.loss`), so that the whole logits are
        never held (for them, call without targets).

        attention_mask: ``(B, S)`` bool or 0/1 ints over every position, cached ones
            included (S = cached + T); 0 marks padding. Pass it on every call of a sequence.
        cache: from :meth:`new_cache`; the T tokens continue the cached ones.
        doc_ids: ``(B, T)`` integers, non-decreasing along each row: packed documents. Each
            document's positions start at 0 and no token attends to another document's.
        prefix_len: prefix-LM, an int or ``(B,)``: the first P positions attend bidirectionally.
        shard: idx (and targets) are this rank's part ``shard.split(...)`` of longer sequences
            (see the module docstring); no attention_mask, doc_ids, cache or prefix_len with it.
        """
        self.check_idx(idx)
        B, T = idx.shape
        if shard is not None:
            self.check_shard(shard, T, attention_mask=attention_mask, doc_ids=doc_ids, cache=cache,
                             prefix_len=prefix_len)
        if doc_ids is not None:
            self.check_doc_ids(doc_ids, B, T, idx.device, attention_mask=attention_mask, cache=cache,
                               prefix_len=prefix_len)
            if self.config.sink_tokens:
                raise ValueError("sink_tokens are the first positions of a row, not of each packed document: "
                                 "train this model on unpacked rows")
        past = self.check_cache(cache, B, T if shard is None else shard.length)
        mask = None if attention_mask is None else self.check_attention_mask(attention_mask, B, past + T, idx.device)
        if mask is not None and self.config.sink_tokens and not bool(mask.all()):
            raise ValueError("sink_tokens are the first positions of the sequence, and left padding would make them "
                             "padding: run padded prompts separately, or pad on the right")
        if targets is not None and not (isinstance(targets, Tensor) and targets.shape == idx.shape
                                        and _validate.is_integer(targets)):
            raise ValueError(f"targets must be an integer tensor shaped like idx {tuple(idx.shape)}, got "
                             f"{tuple(targets.shape) if isinstance(targets, Tensor) else type(targets).__name__}")
        h = self.hidden(idx, mask, cache, past, prefix_len, shard, doc_ids=doc_ids)  # (B, T, C)
        if targets is None:
            return self.logits(h), None  # (B, T, V)
        # a head quantized by selfattn.generation.quantize_int8 gives the weight its products use
        weight = self.lm_head.weight if isinstance(self.lm_head, nn.Linear) else self.lm_head.dequantized()
        return None, head_cross_entropy(h.flatten(0, 1), weight, targets.flatten(),
                                        softcap=self.config.logit_softcap)  # (B·T, C) against (B·T,)

    def hidden(self, idx: Tensor | None, mask: Tensor | None, cache: Sequence[KVCache] | None, past: int,
               prefix_len: int | Tensor | None = None, shard: SequenceShard | None = None, *,
               doc_ids: Tensor | None = None, start: int = 0, stop: int | None = None, x: Tensor | None = None
               ) -> Tensor:
        """The final hidden states ``(B, T, C)`` after ``ln_f``, what :meth:`forward` runs after its
        checks: ``idx`` checked by :meth:`check_idx`, ``mask`` ``(B, past + T)`` bool from
        :meth:`check_attention_mask` or None, ``past`` the cached positions (:meth:`check_cache`),
        ``doc_ids`` from :meth:`check_doc_ids`. Nothing is checked here: a decode step calls it as it is.

        A range of the stack: blocks ``start .. stop - 1`` only, from ``x`` ``(B, T, C)``, the
        residual stream entering block ``start`` (then ``idx`` is not read); a stack stopped short
        of the top returns its residual stream, before ``ln_f`` (self-speculation's drafts)."""
        T, device = (idx if x is None else x).shape[1], (idx if x is None else x).device
        if shard is not None:
            positions = shard.positions(device)  # (T,) this rank's tokens' places in the whole sequence
        elif doc_ids is not None:
            at = torch.arange(T, device=device).expand_as(doc_ids)  # (B, T)
            starts = torch.where(doc_ids != doc_ids.roll(1, dims=1), at, 0)  # (B, T) t where a document starts, else 0
            positions = at - starts.cummax(dim=1).values  # (B, T) places within each token's document
        elif mask is None:
            positions = torch.arange(past, past + T, device=device)  # (T,)
        else:
            positions = (mask.cumsum(dim=-1)[:, -T:] - 1).clamp(min=0)  # (B, T) real tokens before, 0 on padding
        if x is None:
            x = self.wte(idx)  # (B, T, C)
            if self.config.embedding_scale is not None:
                x = x * torch.tensor(self.config.embedding_scale, dtype=x.dtype)  # the scale rounded to x's dtype
            if self.ln_emb is None:
                x = site(self.tap, "hook_embed", x)
            if self.wpe is not None:
                x = x + site(self.tap, "hook_pos_embed", self.wpe(positions).expand_as(x))  # (B, T, C)
            if self.ln_emb is not None:  # TransformerLens's hook_embed is then the norm's output (BLOOM)
                x = site(self.tap, "hook_embed", normed(self.ln_emb, x, scoped(self.tap, "embed_ln.")))
            x = self.drop(x)
        rope_positions = positions if self.wpe is None else None
        angles = {}  # each RoPE rule's cos and sin at these positions, computed once for all layers
        stop = len(self.blocks) if stop is None else stop
        recompute = self.checkpointing and torch.is_grad_enabled()
        for i in range(start, stop):
            kw = dict(key_padding_mask=mask, doc_ids=doc_ids, positions=rope_positions,
                      cache=None if cache is None else cache[i], prefix_len=prefix_len, shard=shard, rope_angles=angles,
                      tap=scoped(self.tap, f"blocks.{i}."))
            x = checkpoint(self.blocks[i], x, use_reentrant=False, **kw) if recompute else self.blocks[i](x, **kw)
        return normed(self.ln_f, x, scoped(self.tap, "ln_final.")) if stop == len(self.blocks) else x

    def logits(self, h: Tensor) -> Tensor:
        """The LM head on hidden states ``h`` (..., C): logits (..., V), soft-capped if configured."""
        logits = self.lm_head(h)
        cap = self.config.logit_softcap
        return logits if cap is None else torch.tanh(logits / cap) * cap

    def check_idx(self, idx) -> None:
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
    def check_shard(shard, T: int, **alone) -> None:
        if not hasattr(shard, "positions") or not hasattr(shard, "attention"):
            raise TypeError(f"shard must be a selfattn.distributed.SequenceShard, got {type(shard).__name__}")
        if T * shard.world != shard.length:
            raise ValueError(f"idx holds {T} positions, but a shard of {shard.length} positions over {shard.world} "
                             f"ranks holds {shard.length // shard.world}: pass shard.split(idx)")
        given = [name for name, value in alone.items() if value is not None]
        if given:
            raise ValueError(f"{', '.join(given)} cannot be combined with shard= (context parallelism)")

    @staticmethod
    def check_doc_ids(doc_ids, B: int, T: int, device, **alone) -> None:
        """Packed documents: ``(B, T)`` integers on ``device``, non-decreasing along each row (each
        document one run of positions), and none of ``alone`` (a cache, an attention mask) given."""
        if not isinstance(doc_ids, Tensor) or not _validate.is_integer(doc_ids):
            raise TypeError(f"doc_ids must be an integer tensor, got "
                            f"{doc_ids.dtype if isinstance(doc_ids, Tensor) else type(doc_ids).__name__}")
        if doc_ids.shape != (B, T) or doc_ids.device != device:
            raise ValueError(f"doc_ids must have shape (B={B}, T={T}) on {device} like idx, got "
                             f"{tuple(doc_ids.shape)} on {doc_ids.device}")
        if bool((doc_ids[:, 1:] < doc_ids[:, :-1]).any()):
            raise ValueError("doc_ids must be non-decreasing along each row: every document one run of positions")
        given = [name for name, value in alone.items() if value is not None]
        if given:
            raise ValueError(f"doc_ids (packed documents) cannot be combined with {', '.join(given)}: pad a row with "
                             f"a document of its own")

    def check_cache(self, cache, B: int, T: int) -> int:
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
    def check_attention_mask(mask, B: int, S: int, device) -> Tensor:
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

