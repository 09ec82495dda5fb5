"""PyTorch's fused ``scaled_dot_product_attention``.

``is_causal=True`` is used only where it is exactly our rule (T == S, causal, nothing
else): PyTorch aligns its causal mask top-left, which is wrong once a cache makes T < S.
A request whose queries see every key (one decoded token) passes no mask; every other
passes the explicit boolean mask from :mod:`selfattn.masks`; ALiBi, a dense additive bias,
passes as a float mask. Other score rules (soft-capping, a score_mod, sinks) are not
expressible to SDPA and are refused.

On the CPU a decoded token (one query that sees every key) and a few plain causal queries at the end
of the keys (a speculative verification, :data:`FEW_QUERIES` at most), without a gradient or dropout,
attend in :func:`selfattn.kernels.matvec.attend` where that kernel builds for AVX2 or AVX-512
(:func:`selfattn.kernels.matvec.attends`): the cache streamed once, summed in float32, whatever
the dtype it is stored in. On SmolLM2's heads it beat SDPA in float32 and by far in bfloat16,
the cache in the CPU's caches or evicted from them, and a compiled SmolLM2 step that took it beat
one that took SDPA (``docs/benchmarks.md``, "Measurements the code cites").

Where it does not serve, a half-precision decoded token runs in float32 where that is faster, as
this process measures once per dtype, heads and power of 2 of keys (:func:`one_query_in_float32`):
on an EPYC without AMX one bfloat16 query of SmolLM2's heads over 128 and 512 keys attended faster
in float32 with the casts, over 16 and 2048 keys not, and an AMX Xeon's bfloat16 was fast (the
same section). The float32 result, rounded to the dtype, is the closer one to the exact attention.
A compiled decode step serves every number of keys with one graph, so it takes one choice,
measured before it compiles over :data:`COMPILED_KEYS` keys (:func:`decide_compiled`, which
:mod:`selfattn.generation.compiled` calls).
"""
from __future__ import annotations

import functools

import torch
import torch.nn.functional as F
from torch import Tensor

from selfattn._util import timing as _timing
from selfattn.backends._common import dense_mask, half
from selfattn.kernels import matvec
from selfattn.masks import Mask
from selfattn.scores import Scores

RETURNS_WEIGHTS = False


def available(device: torch.device) -> str | None:
    return None  # PyTorch's own kernel: wherever PyTorch runs


def unsupported(q: Tensor, k: Tensor, v: Tensor, mask: Mask, dropout_p: float,
                scores: Scores | None = None) -> str | None:
    if scores is not None and (scores.softcap is not None or scores.score_mod is not None or scores.sinks is not None):
        return ("SDPA takes a mask or an additive bias only: soft-capping, a score_mod and sinks are not expressible; "
                "use 'tiled' or 'math'")
    return None  # every mask as an explicit boolean mask, ALiBi as a float one


def run(q: Tensor, k: Tensor, v: Tensor, mask: Mask, *, scale: float, dropout_p: float = 0.0,
        scores: Scores | None = None) -> Tensor:
    T, S = q.shape[2], k.shape[2]
    alibi = scores is not None and scores.alibi_slopes is not None
    if not alibi and _attends_in_matvec(q, k, v, mask, dropout_p):
        return matvec.attend(q, k, v, scale)
    is_causal = False  # an `if`, not the condition itself: traced by torch.compile, T == S is a symbolic
    if mask.plain_causal and T > 1 and T == S and not alibi:  # bool, which SDPA's is_causal does not take
        is_causal = True
    attn_mask, empty = None, None
    if not is_causal and not mask.sees_every_key(T, S):  # a decoded token sees every key: no mask
        attn_mask, empty = dense_mask(mask, T, S, q.device)  # (B or 1, H or 1, T, S) bool
    elif T == 1 and not alibi and _attends_in_float32(q, k):
        return _sdpa(q.float(), k.float(), v.float(), scale, dropout_p).to(q.dtype)
    if alibi:
        j = torch.arange(S, device=q.device)
        bias = -scores.alibi_slopes.to(q.dtype)[:, None, None] * (j[S - T:, None] - j[None, :]).to(q.dtype)  # (H, T, S)
        attn_mask = bias[None] if attn_mask is None else bias[None].masked_fill(~attn_mask, float("-inf"))
    out = _sdpa(q, k, v, scale, dropout_p, attn_mask=attn_mask, is_causal=is_causal)  # (B, H, T, D)
    return out if empty is None else out.masked_fill(empty, 0.0)


def _attends_in_matvec(q: Tensor, k: Tensor, v: Tensor, mask: Mask, dropout_p: float) -> bool:
    """Whether a request attends in :func:`selfattn.kernels.matvec.attend`: a decoded token (one query
    that sees every key) or up to :data:`FEW_QUERIES` plain causal queries at the end of the keys (a
    speculative verification, a short prompt), on the CPU, in dtypes it reads, without dropout or a
    gradient, where the kernel serves (:func:`selfattn.kernels.matvec.attends`). A graph traced for a
    dynamic number of queries keeps SDPA for them: it would otherwise split at FEW_QUERIES into two."""
    T, S = q.shape[2], k.shape[2]
    fits = mask.sees_every_key(1, S) if T == 1 else isinstance(T, int) and T <= FEW_QUERIES and mask.plain_causal
    return (fits and q.device.type == "cpu" and dropout_p == 0.0 and k.dtype == v.dtype
            and q.dtype in matvec.ROW_DTYPES and k.dtype in matvec.ROW_DTYPES
            and not (torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad))
            and matvec.attends())


def _sdpa(q: Tensor, k: Tensor, v: Tensor, scale: float, dropout_p: float, *, attn_mask: Tensor | None = None,
          is_causal: bool = False) -> Tensor:
    return F.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask, dropout_p=dropout_p, is_causal=is_causal,
                                          scale=scale, enable_gqa=q.shape[1] != k.shape[1])


# the most queries the kernel takes: its time grows with the queries, SDPA's less; over 512 keys of SmolLM2's
# heads 4 queries beat SDPA with a mask, 6 about tied, 8 lost (docs/benchmarks.md, "Measurements the code cites")
FEW_QUERIES = 4
COMPILED_KEYS = 512  # the keys a compiled graph's choice is measured over: a prompt and an answer of some length
# (dtype, heads, kv_heads, head_dim) -> whether compiled graphs attend a decoded token of these heads in float32
COMPILED_IN_FLOAT32: dict[tuple[torch.dtype, int, int, int], bool] = {}


def _attends_in_float32(q: Tensor, k: Tensor) -> bool:
    """A half-precision query on a CPU that attends one query of these heads over about as many
    keys faster in float32 (measured once per such request, keys rounded up to a power of 2;
    traced by torch.compile, as :func:`decide_compiled` measured)."""
    if q.device.type != "cpu" or not half(q.dtype):
        return False
    if torch.compiler.is_compiling():
        return COMPILED_IN_FLOAT32.get((q.dtype, q.shape[1], k.shape[1], q.shape[3]), False)
    return one_query_in_float32(q.dtype, q.shape[1], k.shape[1], q.shape[3], 1 << (k.shape[2] - 1).bit_length())


def decide_compiled(dtype: torch.dtype, heads: int, kv_heads: int, head_dim: int, device: torch.device) -> None:
    """Measure, before a graph is compiled, whether its decoded tokens of these heads attend faster
    in float32 (over :data:`COMPILED_KEYS` keys); graphs traced afterwards follow it. Once per
    process for each; nothing to measure off the CPU, in float32, or where the kernel serves."""
    key = (dtype, heads, kv_heads, head_dim)
    cpu = torch.device(device).type == "cpu"
    if cpu and half(dtype) and key not in COMPILED_IN_FLOAT32 and not matvec.attends():
        COMPILED_IN_FLOAT32[key] = one_query_in_float32(dtype, heads, kv_heads, head_dim, COMPILED_KEYS)


@functools.cache
def one_query_in_float32(dtype: torch.dtype, heads: int, kv_heads: int, head_dim: int, keys: int,
                         reps: int = 15) -> bool:
    """Whether this CPU attends one ``dtype`` query of ``heads`` heads over ``keys`` keys of
    ``kv_heads`` faster in float32 (the casts included) than in ``dtype``: SDPA, the median of
    ``reps`` interleaved calls each after a warm-up (milliseconds over 512 keys)."""
    g = torch.Generator().manual_seed(0)  # the global generator stays the caller's
    q, k, v = (torch.randn(1, h, n, head_dim, dtype=dtype, generator=g)
               for h, n in ((heads, 1), (kv_heads, keys), (kv_heads, keys)))  # (B, H, T, D)
    scale = head_dim ** -0.5
    calls = {"half": lambda: _sdpa(q, k, v, scale, 0.0),
             "float32": lambda: _sdpa(q.float(), k.float(), v.float(), scale, 0.0).to(dtype)}
    with torch.inference_mode():
        median = _timing.medians_of(calls, reps)
    return median["float32"] < median["half"]
