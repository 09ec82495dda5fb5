"""Causal multi-head self-attention: the functional core and the ``SelfAttention`` module.

Shape legend, used on every reshape in this package:
    B batch, T query positions, S key positions (S = T without a cache, S > T with one),
    H query heads, Hkv key/value heads (H a multiple of Hkv), D head dim, C = H * D width,
    V vocabulary size.

``attention(q, k, v, ...)`` validates a request, builds its :class:`~selfattn.masks.Mask`
and hands it to one backend of :mod:`selfattn.backends`. ``SelfAttention`` is the seed
document's module (fused qkv projection, heads, scaled scores, causal softmax, output
projection) with the options real models use, each one keyword and off by default.
"""
from __future__ import annotations

import torch
from torch import Tensor, nn

from selfattn import _validate, backends
from selfattn.kv_cache import KVCache
from selfattn.masks import Mask
from selfattn.rope import apply_rope, rope_angles


def attention(q: Tensor, k: Tensor, v: Tensor, *, causal: bool = True, window: int | None = None,
              key_padding_mask: Tensor | None = None, doc_ids: Tensor | None = None,
              dropout_p: float = 0.0, scale: float | None = None, backend: str = "auto",
              return_weights: bool = False) -> Tensor | tuple[Tensor, Tensor]:
    """Scaled dot-product attention of q ``(B, H, T, D)`` over k, v ``(B, Hkv, S, D)``.

    The queries are the last T of the S key positions (see :mod:`selfattn.masks` for the
    masking rules). ``scale`` defaults to ``D ** -0.5``. ``backend`` is one of ``"auto"``,
    ``"math"``, ``"sdpa"``, ``"tiled"``, ``"triton"``. Returns the output ``(B, H, T, D)``,
    and with ``return_weights=True`` also the weights ``(B, H, T, S)`` (math backend only).
    """
    _validate.qkv(q, k, v)
    B, T, S = q.shape[0], q.shape[2], k.shape[2]
    mask = Mask(causal=bool(causal), window=_validate.window(window, causal),
                key_padding_mask=_validate.per_key("key_padding_mask", key_padding_mask, B, S, bool, q.device),
                doc_ids=_validate.per_key("doc_ids", doc_ids, B, S, int, q.device))
    dropout_p = _validate.probability("dropout_p", dropout_p)
    scale = q.shape[-1] ** -0.5 if scale is None else _validate.positive_number("scale", scale)
    name = backends.resolve(backend, q=q, k=k, v=v, mask=mask, dropout_p=dropout_p, return_weights=return_weights)
    impl = backends.load(name)
    if return_weights and not impl.RETURNS_WEIGHTS:
        raise ValueError(f"return_weights=True needs backend 'math' (or 'auto', which picks it); "
                         f"{backend!r} cannot return the weights")
    why = impl.unsupported(q, k, v, mask, dropout_p)
    if why:
        raise ValueError(f"backend {name!r} cannot serve this request: {why}")
    if T == 0 or B == 0:
        empty = q * 0  # nothing to attend: an empty (B, H, T, D), still on the autograd graph
        return (empty, q.new_zeros(B, q.shape[1], T, S)) if return_weights else empty
    if return_weights:
        return impl.run_with_weights(q, k, v, mask, scale=scale, dropout_p=dropout_p)
    return impl.run(q, k, v, mask, scale=scale, dropout_p=dropout_p)


class SelfAttention(nn.Module):
    """Causal multi-head self-attention, ``(B, T, C) -> (B, T, C)``.

    With the defaults this is exactly the seed's module: ``qkv = Linear(C, 3C, bias=False)``,
    ``proj = Linear(C, C, bias=False)``, H heads of D = C/H channels, scores scaled by
    ``D ** -0.5``, a causal mask that keeps the diagonal, softmax, output projection:
    4·C² parameters, the same ``state_dict`` keys and the same random draws at construction.

    Options (each off by default, allocating nothing when off):
        n_kv_head: grouped-query attention with Hkv key/value heads (MQA at 1). The fused
            projection shrinks to ``Linear(C, C + 2·Hkv·D)``: ``2·C² + 2·C·Hkv·D`` parameters.
        bias: biases on both projections (GPT-2 has them).
        dropout: on the attention weights and on the output, in training mode only.
        rope, rope_base: rotary position embeddings on q and k.
        window: sliding window, each query sees its ``window`` most recent keys (itself included).
        backend: ``"auto"``, ``"math"``, ``"sdpa"``, ``"tiled"`` or ``"triton"``.
    """

    def __init__(self, n_embd: int, n_head: int, *, n_kv_head: int | None = None, bias: bool = False,
                 dropout: float = 0.0, rope: bool = False, rope_base: float = 10000.0,
                 window: int | None = None, backend: str = "auto"):
        super().__init__()
        self.n_head = n_head
        self.n_kv_head, self.head_dim = _validate.heads(n_embd, n_head, n_kv_head)
        if rope and self.head_dim % 2:
            raise ValueError(f"rope needs an even head_dim, got n_embd={n_embd} / n_head={n_head} = {self.head_dim}")
        self.dropout = _validate.probability("dropout", dropout)
        self.rope, self.rope_base = bool(rope), _validate.positive_number("rope_base", rope_base, above=1.0)
        self.window = _validate.window(window)
        backends.resolve(backend)  # an unknown name fails here, not at the first forward
        self.backend = backend
        self.qkv = nn.Linear(n_embd, n_embd + 2 * self.n_kv_head * self.head_dim, bias=bias)
        self.proj = nn.Linear(n_embd, n_embd, bias=bias)

    def forward(self, x: Tensor, *, key_padding_mask: Tensor | None = None, doc_ids: Tensor | None = None,
                positions: Tensor | None = None, cache: KVCache | None = None,
                return_weights: bool = False) -> Tensor | tuple[Tensor, Tensor]:
        """``x`` (B, T, C) -> (B, T, C); with ``return_weights`` also the weights (B, H, T, S).

        key_padding_mask, doc_ids: ``(B, S)`` over every key position (cached ones included).
        positions: RoPE positions, ``(T,)`` or ``(B, T)``; default ``cache.length + arange(T)``.
        cache: a :class:`~selfattn.kv_cache.KVCache`; the new keys and values are appended
        and the queries attend over everything cached so far.
        """
        C = self.n_head * self.head_dim
        _validate.embeddings("SelfAttention", x, C)
        B, T, _ = x.shape
        Hkv_D = self.n_kv_head * self.head_dim
        q, k, v = self.qkv(x).split([C, Hkv_D, Hkv_D], dim=2)  # (B, T, C), (B, T, Hkv·D) x2
        q = q.view(B, T, self.n_head, self.head_dim).transpose(1, 2)  # (B, H, T, D)
        k = k.view(B, T, self.n_kv_head, self.head_dim).transpose(1, 2)  # (B, Hkv, T, D)
        v = v.view(B, T, self.n_kv_head, self.head_dim).transpose(1, 2)  # (B, Hkv, T, D)
        if self.rope:
            if positions is None:
                past = cache.length if cache is not None else 0
                positions = torch.arange(past, past + T, device=x.device)  # (T,)
            cos, sin = rope_angles(positions, self.head_dim, self.rope_base)  # (1 or B, 1, T, D/2)
            q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        if cache is not None:
            k, v = cache.append(k, v)  # (B, Hkv, S, D) with S = cached + T
        out = attention(q, k, v, window=self.window, key_padding_mask=key_padding_mask, doc_ids=doc_ids,
                        dropout_p=self.dropout if self.training else 0.0, backend=self.backend,
                        return_weights=return_weights)
        y, weights = out if return_weights else (out, None)
        y = y.transpose(1, 2).contiguous().view(B, T, C)  # (B, T, H, D) -> (B, T, C)
        y = self.proj(y)
        if self.training and self.dropout > 0.0:
            y = nn.functional.dropout(y, self.dropout)
        return (y, weights) if return_weights else y

    def extra_repr(self) -> str:
        opts = [f"n_head={self.n_head}", f"head_dim={self.head_dim}"]
        if self.n_kv_head != self.n_head:
            opts.append(f"n_kv_head={self.n_kv_head}")
        opts += [f"{name}={getattr(self, name)!r}" for name, off in
                 (("dropout", 0.0), ("rope", False), ("window", None), ("backend", "auto"))
                 if getattr(self, name) != off]
        return ", ".join(opts)

