"""PyTorch's FlexAttention (``torch.nn.attention.flex_attention``), driven by the one Mask.

The request's :class:`~selfattn.masks.Mask` becomes both halves of a FlexAttention
``BlockMask``: the tile lists come from our own block map (:meth:`Mask.blocks` at
FlexAttention's 128 x 128 tiles, so the T x S mask is never evaluated), and the ``mask_mod``
that FlexAttention applies inside partial tiles is generated from the same rules:

    visible(b, q, k) = (k <= p if causal) and (k > p - W if window) and pad[b, k] and doc[b, p] == doc[b, k]

with ``p = q + S - T``, the query's position in key coordinates. Block masks are cached per
mask tensors and shape; ``flex_attention`` is compiled once (``torch.compile``, static shapes:
every new shape compiles again, seconds on a CPU) and reused.

What it serves: float32, float16 and bfloat16 (float64 only on a GPU), GQA, every mask rule
(a ``mask_mod`` included), every score rule but sinks (ALiBi, soft-capping and a ``score_mod``
become FlexAttention's ``score_mod``), rows that see nothing (zeros). No dropout, no sinks.
On a CPU this torch build compiles the forward only: a request that needs gradients there is
refused, with the reason, through :func:`unsupported`.
"""
from __future__ import annotations

import shutil
import weakref
from collections import OrderedDict

import torch
from torch import Tensor

from selfattn.masks import FULL, PARTIAL, BlockMap, Mask
from selfattn.scores import Scores

RETURNS_WEIGHTS = False
BLOCK = 128  # FlexAttention's tile: the block map is computed at this size
CPU_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
CACHE_SIZE = 16  # block masks kept (each a few index tensors)
RECOMPILE_LIMIT = 64  # shapes and mask kinds compiled before torch falls back to unfused (slow) FlexAttention

_compiled = None
_cache: OrderedDict = OrderedDict()


def available(device: torch.device) -> str | None:
    try:
        from torch.nn.attention import flex_attention  # noqa: F401
    except ImportError:
        return f"torch {torch.__version__} has no FlexAttention (torch.nn.attention.flex_attention)"
    if device.type == "cpu" and not (shutil.which("g++") or shutil.which("c++") or shutil.which("clang++")):
        return "FlexAttention on the CPU is compiled by torch.compile, which needs a C++ compiler (none on PATH)"
    return None


def unsupported(q: Tensor, k: Tensor, v: Tensor, mask: Mask, dropout_p: float,
                scores: Scores | None = None) -> str | None:
    if dropout_p > 0.0:
        return f"FlexAttention has no dropout (dropout_p={dropout_p}); use 'tiled' or 'sdpa'"
    if scores is not None and scores.sinks is not None:
        return "FlexAttention has no sink logits (a term of the softmax's denominator); use 'tiled' or 'math'"
    if q.device.type == "cpu":
        if q.dtype not in CPU_DTYPES:
            return f"FlexAttention on the CPU takes float32, float16 or bfloat16, not {q.dtype}"
        if torch.is_grad_enabled() and any(t.requires_grad for t in (q, k, v)):
            return (f"torch {torch.__version__} compiles FlexAttention's forward only on the CPU (no backward); "
                    f"use 'tiled' for training, or call under torch.no_grad()")
    return available(q.device)


def run(q: Tensor, k: Tensor, v: Tensor, mask: Mask, *, scale: float, dropout_p: float = 0.0,
        scores: Scores | None = None) -> Tensor:
    why = unsupported(q, k, v, mask, dropout_p, scores)
    if why:
        raise ValueError(f"backend 'flex' cannot serve this request: {why}")
    B, H, T, _ = q.shape
    S = k.shape[2]
    if not torch.is_grad_enabled():  # FlexAttention refuses inputs that require grad where it has no backward
        q, k, v = q.detach(), k.detach(), v.detach()
    extra = _extra_keys(S, q.device)
    if extra:  # hidden keys appended: the mask_mod hides every key index >= S
        k, v = (torch.nn.functional.pad(t, (0, 0, 0, extra)) for t in (k, v))  # (B, Hkv, S + extra, D)
    blocks = block_mask(mask, B, T, S, q.device)
    modify = None if scores is None or not scores.modifies else score_mod(scores, T, S)
    with torch._dynamo.config.patch(recompile_limit=RECOMPILE_LIMIT):  # each new shape compiles anew
        return _flex()(q, k, v, blocks, scale, H != k.shape[1], modify)  # (B, H, T, D)


def _extra_keys(S: int, device: torch.device) -> int:
    """Keys to append so that FlexAttention computes correctly. This torch build's compiled CPU
    kernel returns wrong outputs when S % 16 == 8 (measured at S = 8, 24, 40, 56, 72, 88, 120;
    other lengths from 1 to 32 and up to 1000 were exact): such requests run over S + 8 keys,
    the last 8 hidden."""
    return 8 if device.type == "cpu" and S % 16 == 8 else 0


def block_mask(mask: Mask, B: int, T: int, S: int, device: torch.device):
    """The FlexAttention ``BlockMask`` of ``mask`` for B rows, T queries over S keys (cached)."""
    key = _key(mask, B, T, S, device)
    hit = _cache.get(key[0])
    if hit is not None and all(ref() is t for ref, t in zip(hit[0], key[1])):
        _cache.move_to_end(key[0])
        return hit[1]
    from torch.nn.attention.flex_attention import BlockMask

    extra = _extra_keys(S, device)
    kind = mask.blocks(T, S, BLOCK, BLOCK).kind.to(device).expand(B, -1, -1).clone()  # (B, nq, nk)
    if extra:  # the appended keys share the last key tile (S + extra stays within it): mask it
        kind[:, :, -1][kind[:, :, -1] == FULL] = PARTIAL
    blocks = BlockMap(kind, BLOCK, BLOCK)
    (partial_n, partial), (full_n, full) = blocks.lists(PARTIAL), blocks.lists(FULL)
    made = BlockMask.from_kv_blocks(partial_n[:, None], partial[:, None], full_n[:, None], full[:, None],
                                   BLOCK_SIZE=BLOCK, mask_mod=mask_mod(mask, T, S),
                                   seq_lengths=(T, S + extra))  # H of 1: every head shares the map
    _cache[key[0]] = ([weakref.ref(t) for t in key[1]], made)
    while len(_cache) > CACHE_SIZE:
        _cache.popitem(last=False)
    return made


def score_mod(scores: Scores, T: int, S: int):
    """FlexAttention's ``score_mod(score, b, h, q_idx, kv_idx)`` for our score rules (query index
    q_idx is 0..T-1; it sits at key position q_idx + S - T)."""
    offset = S - T

    def modified(score, b, h, q_idx, kv_idx):
        return scores.apply(score, b, h, q_idx + offset, kv_idx)
    return modified


def mask_mod(mask: Mask, T: int, S: int):
    """FlexAttention's ``mask_mod(b, h, q_idx, kv_idx) -> bool`` for ``mask`` (query index q_idx
    is 0..T-1; it sits at key position q_idx + S - T)."""
    offset, window, sinks = S - T, mask.window, mask.sink_tokens
    causal = mask.causal or window is not None
    pad, docs, prefix, user = mask.key_padding_mask, mask.doc_ids, mask.prefix_len, mask.mask_mod

    def visible(b, h, q_idx, kv_idx):
        p = q_idx + offset
        ok = kv_idx <= p if causal else kv_idx < S  # (keys from S on are appended ones: see _extra_keys)
        if prefix is not None:
            ok = ok | (kv_idx < prefix[b if len(prefix) > 1 else 0])
        if window is not None:
            recent = kv_idx > p - window
            ok = ok & (recent | (kv_idx < sinks) if sinks else recent)
        if pad is not None:
            ok = ok & pad[b, kv_idx.clamp(max=S - 1)]
        if docs is not None:
            ok = ok & (docs[b, p] == docs[b, kv_idx.clamp(max=S - 1)])
        if user is not None:
            ok = ok & user(b, h, p, kv_idx)
        return ok
    return visible


def _key(mask: Mask, B: int, T: int, S: int, device: torch.device) -> tuple[tuple, tuple]:
    """(cache key, the mask's tensors and function): a hit must also find the very same ones alive."""
    parts = (mask.key_padding_mask, mask.doc_ids, mask.prefix_len, mask.mask_mod)
    alive = tuple(t for t in parts if t is not None)
    ids = tuple((id(t), getattr(t, "_version", 0)) if t is not None else None for t in parts)
    return (mask.causal, mask.window, mask.sink_tokens, B, T, S, str(device), ids), alive


def _attend(q: Tensor, k: Tensor, v: Tensor, block_mask, scale: float, enable_gqa: bool, modify) -> Tensor:
    from torch.nn.attention.flex_attention import flex_attention

    return flex_attention(q, k, v, score_mod=modify, block_mask=block_mask, scale=scale, enable_gqa=enable_gqa)


def _flex():
    """``_attend`` compiled once: a function of our own, so its compiled shapes count against
    our recompile limit, not against that of a user's ``torch.compile(flex_attention)``."""
    global _compiled
    if _compiled is None:
        _compiled = torch.compile(_attend, dynamic=False)
    return _compiled
