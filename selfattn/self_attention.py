"""Causal multi-head self-attention: the functional core and the ``SelfAttention`` module.

Shape legend, used on every reshape in this package:
    B batch, T query positions, S key positions (S = T without a cache, S > T with one),
    H query heads, Hkv key/value heads (H a multiple of Hkv), D head dim, C = H * D width,
    V vocabulary size. (A ``head_dim`` set apart from the width makes H * D differ from C;
    such lines write H·D.)

``attention(q, k, v, ...)`` validates a request, builds its :class:`~selfattn.masks.Mask`
and hands it to one backend of :mod:`selfattn.backends`. ``SelfAttention`` is the seed
document's module (fused qkv projection, heads, scaled scores, causal softmax, output
projection) with the options real models use, each one keyword and off by default.
"""
from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

import torch
from torch import Tensor, nn

from selfattn import backends
from selfattn._util import validate as _validate
from selfattn.kv_cache import KVCache, RollingKVCache
from selfattn.masks import Mask
from selfattn.norms import Norm
from selfattn.rope import check_scaling, rope_tables, rotate
from selfattn.rope import rope_angles as rope_angles_of
from selfattn.scores import Scores, alibi_slopes, check_score_mod
from selfattn.taps import Tap, normed, scoped, site

if TYPE_CHECKING:  # the core never imports the distributed layer; a shard is handed in
    from selfattn.distributed import SequenceShard


def attention(q: Tensor, k: Tensor, v: Tensor, *, causal: bool = True, window: int | None = None,
              key_padding_mask: Tensor | None = None, doc_ids: Tensor | None = None,
              dropout_p: float = 0.0, scale: float | None = None, backend: str = "auto",
              return_weights: bool = False, mask_mod: Callable | None = None, score_mod: Callable | None = None,
              alibi_slopes: Tensor | None = None, softcap: float | None = None, sinks: Tensor | None = None,
              sink_tokens: int | None = None, prefix_len: int | Tensor | None = None,
              tap: Callable | None = None) -> Tensor | tuple[Tensor, Tensor]:
    """Scaled dot-product attention of ``q`` over ``k``, ``v``, computed by one backend.

    Args:
        q: the queries ``(B, H, T, D)``, the last T of the S key positions.
        k, v: the keys and values ``(B, Hkv, S, D)``, H a multiple of Hkv (grouped-query attention).
        causal, window, key_padding_mask, doc_ids, sink_tokens, prefix_len, mask_mod: which keys a
            query sees (:mod:`selfattn.masks`; ``mask_mod`` a function of yours).
        alibi_slopes, softcap, score_mod, sinks: what happens to the scores before the softmax
            (:mod:`selfattn.scores`; ``score_mod`` a function of yours, ``sinks`` learned).
        dropout_p: dropout on the weights. scale: the scores' scale, default ``D ** -0.5``.
        backend: ``"auto"``, ``"math"``, ``"sdpa"``, ``"tiled"``, ``"flex"`` or ``"triton"``.
        return_weights: return the weights too (the math backend only).
        tap: ``tap(name, tensor) -> tensor`` (:mod:`selfattn.taps`) is shown the scores
            ``hook_attn_scores`` (masked pairs at -inf) and the weights ``hook_pattern`` ``(B, H, T, S)``,
            computed by the math backend; returned unchanged, the output is still the chosen backend's,
            bitwise; replaced, the math backend goes on from them.

    Returns:
        the output ``(B, H, T, D)``; with ``return_weights=True``, ``(output, weights)``, the
        weights ``(B, H, T, S)``.
    """
    _validate.qkv(q, k, v)
    B, H, T, S = q.shape[0], q.shape[1], q.shape[2], k.shape[2]
    causal = _validate.flag("causal", causal)
    window = _validate.window(window, causal)
    mask = Mask(causal=causal, window=window,
                key_padding_mask=_validate.per_key("key_padding_mask", key_padding_mask, B, S, bool, q.device),
                doc_ids=_validate.per_key("doc_ids", doc_ids, B, S, int, q.device),
                sink_tokens=_validate.sink_tokens(sink_tokens, window),
                prefix_len=_validate.prefix_len(prefix_len, B, S, causal, window, q.device),
                mask_mod=_validate.function("mask_mod", mask_mod), n_head=H,
                batch_rows=None if mask_mod is None else torch.arange(B, device=q.device))
    scores = Scores(alibi_slopes=_validate.per_head("alibi_slopes", alibi_slopes, H, q.device),
                    softcap=None if softcap is None else _validate.positive_number("softcap", softcap),
                    score_mod=_validate.function("score_mod", score_mod),
                    sinks=_validate.per_head("sinks", sinks, H, q.device))
    if score_mod is not None:
        check_score_mod(score_mod, q.dtype, q.device)
    dropout_p = _validate.probability("dropout_p", dropout_p)
    scale = q.shape[-1] ** -0.5 if scale is None else _validate.positive_number("scale", scale)
    name = backends.resolve(backend, q=q, k=k, v=v, mask=mask, dropout_p=dropout_p, return_weights=return_weights,
                            scores=scores)
    impl = backends.load(name)
    if return_weights and not impl.RETURNS_WEIGHTS:
        raise ValueError(f"return_weights=True needs backend 'math' (or 'auto', which picks it); "
                         f"{backend!r} cannot return the weights")
    why = impl.unsupported(q, k, v, mask, dropout_p, scores)
    if why:
        raise ValueError(f"backend {name!r} cannot serve this request: {why}")
    if T == 0 or B == 0:
        empty = q * 0  # nothing to attend: an empty (B, H, T, D), still on the autograd graph
        return (empty, q.new_zeros(B, H, T, S)) if return_weights else empty
    if tap is not None:
        replaced = []

        def watch(where: str, t: Tensor) -> Tensor:
            shown = tap(where, t)
            replaced.append(shown is not t)
            return shown
        out, weights = backends.load("math").run_with_weights(q, k, v, mask, scale=scale, dropout_p=dropout_p,
                                                              scores=scores, tap=watch)
        if any(replaced) or name == "math" or dropout_p > 0.0:
            return (out, weights) if return_weights else out
    if return_weights:
        return impl.run_with_weights(q, k, v, mask, scale=scale, dropout_p=dropout_p, scores=scores)
    return impl.run(q, k, v, mask, scale=scale, dropout_p=dropout_p, scores=scores)


class SelfAttention(nn.Module):
    """Causal multi-head self-attention, ``(B, T, C) -> (B, T, C)``.

    With the defaults this is exactly the seed's module: ``qkv = Linear(C, 3C, bias=False)``,
    ``proj = Linear(C, C, bias=False)``, H heads of D = C/H channels, scores scaled by
    ``D ** -0.5``, a causal mask that keeps the diagonal, softmax, output projection:
    4·C² parameters, the same ``state_dict`` keys and the same random draws at construction.

    Options (each off by default, allocating nothing when off):
        n_kv_head: grouped-query attention with Hkv key/value heads (MQA at 1). The fused
            projection shrinks to ``Linear(C, C + 2·Hkv·D)``: ``2·C² + 2·C·Hkv·D`` parameters.
        head_dim: D set on its own (Gemma, Qwen3): ``qkv = Linear(C, (H + 2·Hkv)·D)``,
            ``proj = Linear(H·D, C)``; None = C / H.
        bias: biases on both projections (GPT-2 has them).
        qkv_bias: biases on the q/k/v projection alone (Qwen2: True with ``bias=False``);
            None = as ``bias``.
        dropout: on the attention weights and on the output, in training mode only.
        scale: the scores' scale, default ``D ** -0.5`` (Gemma: ``query_pre_attn_scalar ** -0.5``).
        rope, rope_base: rotary position embeddings on q and k.
        rope_scaling: a context-extension rule for RoPE (:mod:`selfattn.rope`: linear, llama3,
            yarn, longrope), a dict in ``transformers``' form.
        rope_dims: rotate only the first ``rope_dims`` channels of each head (partial rotary).
        qk_norm: a :class:`~selfattn.norms.Norm` applied to q and k before RoPE, each with its
            own weight: over each head's D channels (``qk_norm_over="head"``: Qwen3, Gemma 3) or
            over the whole projection, H·D and Hkv·D (``"projection"``: OLMo 2).
        window: sliding window, each query sees its ``window`` most recent keys (itself included).
        sink_tokens: with a window, the first n positions stay visible to every query (StreamingLLM).
        alibi: ALiBi biases with the paper's slopes for ``n_head`` heads (:func:`~selfattn.scores.alibi_slopes`).
        softcap: scores soft-capped to ``softcap · tanh(score / softcap)`` (Gemma 2).
        sinks: one learned sink logit per head in every softmax's denominator (gpt-oss): a
            parameter ``sinks`` ``(H,)``, initialised to zero.
        mask_mod, score_mod: functions of your own (see :func:`attention`).
        backend: ``"auto"``, ``"math"``, ``"sdpa"``, ``"tiled"``, ``"flex"`` or ``"triton"``.
    """

    def __init__(self, n_embd: int, n_head: int, *, n_kv_head: int | None = None, head_dim: int | None = None,
                 bias: bool = False, qkv_bias: bool | None = None, dropout: float = 0.0, scale: float | None = None,
                 rope: bool = False, rope_base: float = 10000.0, rope_scaling: dict | None = None,
                 rope_dims: int | None = None, qk_norm: Norm | None = None, qk_norm_over: str = "head",
                 window: int | None = None, sink_tokens: int | None = None, alibi: bool = False,
                 softcap: float | None = None, sinks: bool = False, mask_mod: Callable | None = None,
                 score_mod: Callable | None = None, backend: str = "auto"):
        super().__init__()
        self.n_head = n_head
        self.n_kv_head, self.head_dim = _validate.heads(n_embd, n_head, n_kv_head, head_dim)
        self.rope_dims = self.head_dim if rope_dims is None else _validate.positive_int("rope_dims", rope_dims)
        if rope and (self.rope_dims % 2 or self.rope_dims > self.head_dim):
            raise ValueError(f"rope needs an even number of rotated channels up to head_dim={self.head_dim}, got "
                             f"{self.rope_dims} (n_embd={n_embd}, n_head={n_head}, rope_dims={rope_dims})")
        qkv_bias = bias if qkv_bias is None else _validate.flag("qkv_bias", qkv_bias)
        self.dropout = _validate.probability("dropout", dropout)
        self.scale = None if scale is None else _validate.positive_number("scale", scale)
        self.rope, self.rope_base = bool(rope), _validate.positive_number("rope_base", rope_base, above=1.0)
        self.rope_scaling = check_scaling(rope_scaling, self.rope_dims)
        self.window = _validate.window(window)
        self.sink_tokens = _validate.sink_tokens(sink_tokens, self.window)
        self.alibi = bool(alibi)
        self.softcap = None if softcap is None else _validate.positive_number("softcap", softcap)
        self.mask_mod = _validate.function("mask_mod", mask_mod)
        self.score_mod = _validate.function("score_mod", score_mod)
        backends.resolve(backend)  # an unknown name fails here, not at the first forward
        self.backend = backend
        self.n_embd = n_embd
        self.qkv = nn.Linear(n_embd, (n_head + 2 * self.n_kv_head) * self.head_dim, bias=qkv_bias)
        self.proj = nn.Linear(n_head * self.head_dim, n_embd, bias=bias)
        self.sinks = nn.Parameter(torch.zeros(n_head)) if sinks else None  # zeros: no random draw
        self.q_norm = self.k_norm = None
        self.qk_norm_over = qk_norm_over
        if qk_norm is not None:
            if not isinstance(qk_norm, Norm):
                raise TypeError(f"qk_norm must be a selfattn.norms.Norm, got {type(qk_norm).__name__}")
            if qk_norm_over not in ("head", "projection"):
                raise ValueError(f"qk_norm_over must be 'head' or 'projection', got {qk_norm_over!r}")
            per_head = qk_norm_over == "head"
            self.q_norm = qk_norm(self.head_dim if per_head else n_head * self.head_dim)
            self.k_norm = qk_norm(self.head_dim if per_head else self.n_kv_head * self.head_dim)

    def forward(self, x: Tensor, *, key_padding_mask: Tensor | None = None, doc_ids: Tensor | None = None,
                prefix_len: int | Tensor | None = None, positions: Tensor | None = None,
                cache: KVCache | RollingKVCache | None = None, return_weights: bool = False,
                shard: SequenceShard | None = None, rope_angles: dict | None = None,
                tap: Tap | None = None) -> Tensor | tuple[Tensor, Tensor]:
        """``x`` (B, T, C) -> (B, T, C); with ``return_weights`` also the weights (B, H, T, S).

        key_padding_mask, doc_ids: ``(B, S)`` over every key position (cached ones included).
        prefix_len: prefix-LM, an int or ``(B,)``: the first P positions attend to each other.
        positions: RoPE positions, ``(T,)`` or ``(B, T)``; default ``cache.length + arange(T)``.
        cache: a :class:`~selfattn.kv_cache.KVCache` (the queries attend over everything cached
            so far) or a :class:`~selfattn.kv_cache.RollingKVCache` (the window's keys only).
        shard: x is this rank's part of sequences split across processes (a
            :class:`~selfattn.distributed.SequenceShard`): RoPE takes the tokens' global
            positions and attention is ring attention over the whole sequence.
        rope_angles: a dict shared by the layers of one forward over the same ``positions``: each
            RoPE rule's tables (:func:`~selfattn.rope.rope_tables`) are computed by the first layer
            that needs them and reused by the others (a decode step would otherwise compute them
            once per layer).
        tap: TransformerLens's sites of the attention (:mod:`selfattn.taps`): ``hook_q``, ``hook_k``,
            ``hook_v`` ``(B, T, H or Hkv, D)``, the q/k norms' sites, ``hook_rot_q``, ``hook_rot_k``,
            ``hook_attn_scores`` and ``hook_pattern`` ``(B, H, T, S)`` (when asked), ``hook_z``
            ``(B, T, H, D)``, ``hook_result`` ``(B, T, H, C)`` (when asked).
        """
        _validate.embeddings("SelfAttention", x, self.n_embd)
        B, T, _ = x.shape
        H_D, Hkv_D = self.n_head * self.head_dim, self.n_kv_head * self.head_dim
        q, k, v = self.qkv(x).split([H_D, Hkv_D, Hkv_D], dim=2)  # (B, T, H·D), (B, T, Hkv·D) x2
        if tap is not None:  # (B, T, H or Hkv, D) each
            q, k, v = (tap(name, t.unflatten(2, (-1, self.head_dim))).flatten(2)
                       for name, t in (("hook_q", q), ("hook_k", k), ("hook_v", v)))
        if self.q_norm is not None and self.qk_norm_over == "projection":
            q, k = self._qk_normed(q, k, tap)
        q = q.view(B, T, self.n_head, self.head_dim).transpose(1, 2)  # (B, H, T, D)
        k = k.view(B, T, self.n_kv_head, self.head_dim).transpose(1, 2)  # (B, Hkv, T, D)
        v = v.view(B, T, self.n_kv_head, self.head_dim).transpose(1, 2)  # (B, Hkv, T, D)
        if self.q_norm is not None and self.qk_norm_over == "head":
            q, k = self._qk_normed(q, k, tap)
        if shard is not None:
            self._check_shard(cache, return_weights, prefix_len)
        if self.rope:
            if positions is None and shard is not None:
                positions = shard.positions(x.device)  # (T,) global positions of this rank's tokens
            elif positions is None:
                past = cache.length if cache is not None else 0
                positions = torch.arange(past, past + T, device=x.device)  # (T,)
            work = torch.promote_types(q.dtype, torch.float32)  # what the rotation runs in
            rule = (self.rope_dims, self.rope_base, repr(self.rope_scaling), work)
            tables = None if rope_angles is None else rope_angles.get(rule)
            if tables is None:
                tables = rope_tables(*rope_angles_of(positions, self.rope_dims, self.rope_base,
                                                     scaling=self.rope_scaling), work)  # (1 or B, 1, T, R) x2
                if rope_angles is not None:
                    rope_angles[rule] = tables
            q, k = rotate(q, *tables), rotate(k, *tables)
            if tap is not None:  # (B, T, H or Hkv, D)
                q, k = (tap(name, t.transpose(1, 2)).transpose(1, 2)
                        for name, t in (("hook_rot_q", q), ("hook_rot_k", k)))
        if cache is not None:
            k, v = cache.append(k, v)  # (B, Hkv, S, D): the cached keys the queries need, and the T new ones
            if isinstance(cache, RollingKVCache):  # per-position masks follow the positions the keys hold
                live = cache.positions()
                key_padding_mask = None if key_padding_mask is None else key_padding_mask[:, live]
                doc_ids = None if doc_ids is None else doc_ids[:, live]
        if shard is not None:
            out = shard.attention(q, k, v, window=self.window, key_padding_mask=key_padding_mask, doc_ids=doc_ids,
                                  backend=self.backend)
        else:
            out = attention(q, k, v, window=self.window, key_padding_mask=key_padding_mask, doc_ids=doc_ids,
                            dropout_p=self.dropout if self.training else 0.0, scale=self.scale, backend=self.backend,
                            return_weights=return_weights, sink_tokens=self.sink_tokens, prefix_len=prefix_len,
                            alibi_slopes=alibi_slopes(self.n_head).to(x.device) if self.alibi else None,
                            softcap=self.softcap, sinks=self.sinks, mask_mod=self.mask_mod, score_mod=self.score_mod,
                            tap=tap if tap is not None and (tap.asks("hook_attn_scores") or tap.asks("hook_pattern"))
                            else None)
        y, weights = out if return_weights else (out, None)
        y = site(tap, "hook_z", y.transpose(1, 2))  # (B, T, H, D)
        if tap is not None and tap.asks("hook_result"):
            y = self._written(y, tap)
        else:
            y = self.proj(y.contiguous().view(B, T, H_D))  # (B, T, H·D) -> (B, T, C)
        if self.training and self.dropout > 0.0:
            y = nn.functional.dropout(y, self.dropout)
        return (y, weights) if return_weights else y

    def head_writes(self, z: Tensor) -> Tensor:
        """What each head writes: ``z`` ``(B, T, H, D)`` through its slice of the output projection,
        ``(B, T, H, C)`` (a LoRA adapter's delta included); summed over H, plus the bias, it is the output."""
        weight = self.proj.weight
        if hasattr(self.proj, "delta_weight"):  # selfattn.lora.LoRALinear
            weight = weight + self.proj.delta_weight().to(weight.dtype)
        return torch.einsum("bthd,chd->bthc", z, weight.view(-1, self.n_head, self.head_dim).to(z.dtype))

    def _written(self, z: Tensor, tap: Tap) -> Tensor:
        """The output projection of ``z`` ``(B, T, H, D)``, with each head's write shown as ``hook_result``:
        returned unchanged, the projection's own product goes on, bitwise; replaced, its sum over heads."""
        result = self.head_writes(z)  # (B, T, H, C)
        shown = tap("hook_result", result)
        if shown is result:
            return self.proj(z.reshape(*z.shape[:2], -1))  # (B, T, C)
        return shown.sum(2) + (0 if self.proj.bias is None else self.proj.bias)

    def _qk_normed(self, q: Tensor, k: Tensor, tap: Tap | None) -> tuple[Tensor, Tensor]:
        """q and k through their norms, with TransformerLens's q_norm, k_norm, hook_q_normed and hook_k_normed."""
        return (site(tap, "hook_q_normed", normed(self.q_norm, q, scoped(tap, "q_norm."))),
                site(tap, "hook_k_normed", normed(self.k_norm, k, scoped(tap, "k_norm."))))

    def _check_shard(self, cache, return_weights: bool, prefix_len) -> None:
        """What ring attention serves: causal attention with a window, padding and documents."""
        refused = [name for name, on in (
            ("cache", cache is not None), ("return_weights", return_weights), ("prefix_len", prefix_len is not None),
            ("sink_tokens", self.sink_tokens is not None), ("alibi", self.alibi), ("softcap", self.softcap is not None),
            ("scale", self.scale is not None),
            ("sinks", self.sinks is not None), ("mask_mod", self.mask_mod is not None),
            ("score_mod", self.score_mod is not None), ("dropout", self.training and self.dropout > 0.0)) if on]
        if refused:
            raise ValueError(f"ring attention (shard=) serves causal attention with a window, padding and documents; "
                             f"not {', '.join(refused)}")

    def extra_repr(self) -> str:
        opts = [f"n_head={self.n_head}", f"head_dim={self.head_dim}"]
        if self.n_kv_head != self.n_head:
            opts.append(f"n_kv_head={self.n_kv_head}")
        opts += [f"{name}={getattr(self, name)!r}" for name, off in
                 (("dropout", 0.0), ("scale", None), ("rope", False), ("window", None), ("sink_tokens", None),
                  ("alibi", False), ("softcap", None), ("backend", "auto")) if getattr(self, name) != off]
        if self.rope and self.rope_dims != self.head_dim:
            opts.append(f"rope_dims={self.rope_dims}")
        if self.rope and self.rope_scaling is not None:
            opts.append(f"rope_scaling={self.rope_scaling['rope_type']!r}")
        opts += [name for name in ("sinks", "mask_mod", "score_mod") if getattr(self, name) is not None]
        return ", ".join(opts)

