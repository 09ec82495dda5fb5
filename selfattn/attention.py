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

import numbers

import torch
from torch import Tensor, nn

from selfattn import backends
from selfattn.checks import positive_int
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
    _check_qkv(q, k, v)
    T, S = q.shape[2], k.shape[2]
    mask = Mask(causal=bool(causal), window=_check_window(window, causal),
                key_padding_mask=_check_per_token("key_padding_mask", key_padding_mask, q, S, bool),
                doc_ids=_check_per_token("doc_ids", doc_ids, q, S, int))
    if not isinstance(dropout_p, numbers.Real) or not 0.0 <= dropout_p < 1.0:
        raise ValueError(f"dropout_p must be in [0, 1), got {dropout_p!r}")
    if scale is None:
        scale = q.shape[-1] ** -0.5
    elif not isinstance(scale, numbers.Real) or scale <= 0:
        raise ValueError(f"scale must be a positive number, got {scale!r}")
    name = choose_backend(backend, return_weights)
    impl = backends.load(name)
    if return_weights:
        if name != "math":
            raise ValueError(f"return_weights=True needs backend 'math' (or 'auto'), got {backend!r}")
        return impl.run_with_weights(q, k, v, mask, scale=scale, dropout_p=dropout_p)
    why = getattr(impl, "unsupported", lambda *a: None)(q, k, v, mask, dropout_p)
    if why:
        raise ValueError(f"backend {name!r} cannot serve this request: {why}")
    if T == 0 or q.shape[0] == 0:
        return q * 0  # nothing to attend: an empty (B, H, T, D), still on the autograd graph
    return impl.run(q, k, v, mask, scale=float(scale), dropout_p=float(dropout_p))


def choose_backend(backend: str, return_weights: bool = False) -> str:
    """Resolve ``"auto"``: the math backend when weights are asked for, else PyTorch's fused
    kernel. ``selfattn bench attention`` measured it the fastest within noise in float32 at
    every T; for bfloat16 rows of 512 keys or fewer on CPU the plain formula is faster."""
    if backend == "auto":
        return "math" if return_weights else "sdpa"
    if backend not in backends.NAMES:
        raise ValueError(f"unknown attention backend {backend!r}; choose one of {('auto',) + backends.NAMES}")
    return backend


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
        positive_int("n_embd", n_embd)
        positive_int("n_head", n_head)
        if n_embd % n_head:
            raise ValueError(f"n_embd={n_embd} is not divisible by n_head={n_head}")
        n_kv_head = n_head if n_kv_head is None else n_kv_head
        positive_int("n_kv_head", n_kv_head)
        if n_head % n_kv_head:
            raise ValueError(f"n_head={n_head} is not a multiple of n_kv_head={n_kv_head}")
        if not isinstance(dropout, numbers.Real) or not 0.0 <= dropout < 1.0:
            raise ValueError(f"dropout must be in [0, 1), got {dropout!r}")
        head_dim = n_embd // n_head
        if rope and head_dim % 2:
            raise ValueError(f"rope needs an even head_dim, got n_embd={n_embd} / n_head={n_head} = {head_dim}")
        if not isinstance(rope_base, numbers.Real) or rope_base <= 1:
            raise ValueError(f"rope_base must be a number > 1, got {rope_base!r}")
        choose_backend(backend)
        self.n_head, self.n_kv_head, self.head_dim = n_head, n_kv_head, head_dim
        self.window = _check_window(window, True)
        self.dropout, self.rope, self.rope_base, self.backend = float(dropout), bool(rope), float(rope_base), backend
        self.qkv = nn.Linear(n_embd, n_embd + 2 * n_kv_head * head_dim, bias=bias)
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
        if not isinstance(x, Tensor):
            raise TypeError(f"SelfAttention expects a tensor, got {type(x).__name__}")
        if x.dim() != 3:
            raise ValueError(f"SelfAttention expects input of shape (B, T, C={C}), got {tuple(x.shape)}")
        if x.shape[-1] != C:
            raise ValueError(f"SelfAttention(n_embd={C}) got input with last dim {x.shape[-1]} (shape {tuple(x.shape)})")
        if not x.is_floating_point():
            raise TypeError(f"SelfAttention expects a floating-point input, got dtype {x.dtype}")
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


def _check_window(window, causal) -> int | None:
    if window is None:
        return None
    positive_int("window", window)
    if not causal:
        raise ValueError(f"window={window} needs causal=True (a window is i - W < j <= i)")
    return window


def _check_qkv(q: Tensor, k: Tensor, v: Tensor) -> None:
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, Tensor):
            raise TypeError(f"{name} must be a tensor, got {type(t).__name__}")
        if t.dim() != 4:
            raise ValueError(f"{name} must be 4-D ({'(B, H, T, D)' if name == 'q' else '(B, Hkv, S, D)'}), "
                             f"got shape {tuple(t.shape)}")
        if not t.is_floating_point():
            raise TypeError(f"{name} must be floating point, got dtype {t.dtype}")
    if not q.dtype == k.dtype == v.dtype:
        raise TypeError(f"q, k, v must share a dtype, got {q.dtype}, {k.dtype}, {v.dtype}")
    if not q.device == k.device == v.device:
        raise ValueError(f"q, k, v must be on one device, got {q.device}, {k.device}, {v.device}")
    if k.shape != v.shape or k.shape[0] != q.shape[0] or k.shape[3] != q.shape[3]:
        raise ValueError(f"expected q (B, H, T, D) and k, v (B, Hkv, S, D), got q {tuple(q.shape)}, "
                         f"k {tuple(k.shape)}, v {tuple(v.shape)}")
    H, Hkv = q.shape[1], k.shape[1]
    if Hkv == 0 or H % Hkv:
        raise ValueError(f"query heads H={H} must be a multiple of key/value heads Hkv={Hkv}")
    if q.shape[2] > k.shape[2]:
        raise ValueError(f"T={q.shape[2]} queries but only S={k.shape[2]} keys: queries are the last T "
                         f"of the S key positions, so T <= S")


def _check_per_token(name: str, t: Tensor | None, q: Tensor, S: int, kind: type) -> Tensor | None:
    if t is None:
        return None
    if not isinstance(t, Tensor):
        raise TypeError(f"{name} must be a tensor, got {type(t).__name__}")
    if kind is bool and t.dtype != torch.bool:
        raise TypeError(f"{name} must be a bool tensor (True = real token), got dtype {t.dtype}")
    if kind is int and (t.is_floating_point() or t.is_complex() or t.dtype == torch.bool):
        raise TypeError(f"{name} must be an integer tensor, got dtype {t.dtype}")
    if t.shape != (q.shape[0], S):
        raise ValueError(f"{name} must have shape (B={q.shape[0]}, S={S}), got {tuple(t.shape)}")
    return t.to(q.device)
