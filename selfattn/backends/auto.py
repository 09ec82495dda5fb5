"""``backend="auto"``: the backend expected to be fastest for a request, never one that refuses it.

Measured here first: where this machine has timed requests of the kind (``selfattn calibrate``, or
``SELFATTN_AUTO_TUNE=1``; :mod:`selfattn.backends.tuning`), the backend it measured fastest comes first
and the rule orders the rest; what nothing measured covers, and what ``torch.compile`` traces, follows
the rule alone. Each candidate is asked (``unsupported``) before it is chosen; the next one serves when
it refuses. ``flex`` compiles on first use: :func:`allow_compile` (or ``SELFATTN_AUTO_COMPILE=0``)
keeps it out.

The rule (:func:`rule`; why each step: ``docs/design.md``, "How auto chooses"; the timings behind it:
``docs/benchmarks.md``, "Measurements the code cites"):

1. weights asked for: ``math``, the only backend that returns them;
2. plain causal or unmasked attention (a window as long as the sequence included), and a decoded
   token (one query without a gradient that sees every key, not looked up): ``sdpa``;
3. a small request, T·S <= :data:`SMALL`: ``sdpa`` with the dense mask;
4. windows, padding, documents: ``sdpa`` with the dense mask when the block map's density is above
   :data:`DENSE`; below it, for a forward (no gradient, no dropout, compiling allowed) on documents,
   a ``mask_mod`` or a window of at most :data:`FLEX_WINDOW` keys ``flex``, else ``tiled``;
5. scores changed before the softmax (ALiBi, soft-capping, a ``score_mod``) or learned sinks: ``flex``
   where rule 4 takes it, else ``tiled``, then ``sdpa``, ``math``;
6. half precision with a gradient on a CPU without native half matmuls: ``tiled``, whatever the mask;
7. on a CUDA device: plain causal ``sdpa``; other masks and score rules ``flex`` when compiling is
   allowed, else ``triton`` where it is installed and serves, else ``tiled``.
"""
from __future__ import annotations

import os
from collections.abc import Iterator

import torch
from torch import Tensor

from selfattn.backends import tiled, tuning
from selfattn.kernels.features import multiplies_natively
from selfattn.masks import Mask
from selfattn.scores import Scores

SMALL = 2 ** 17  # T·S up to this: sdpa with a dense mask (rule 3)
DENSE = 0.8  # block-map density above this: sdpa with a dense mask (rule 4)
FLEX_WINDOW = 256  # windows up to this many keys: flex's forward beat tiled on the CPU (rule 4)

_compile = os.environ.get("SELFATTN_AUTO_COMPILE", "1") != "0"


def allow_compile(enabled: bool) -> None:
    """Whether ``auto`` may pick a backend that compiles on first use (``flex``)."""
    global _compile
    _compile = bool(enabled)


def allows_compile() -> bool:
    return _compile


def candidates(q: Tensor | None, k: Tensor | None, v: Tensor | None, mask: Mask | None, dropout_p: float,
               return_weights: bool, scores: Scores | None = None) -> Iterator[str]:
    """The backends for this request, best first (see the module docstring): this machine's
    measured fastest, if any, then the rule's, which is worked out only if the caller asks for
    more (for windows, padding and documents it costs many times the lookup:
    ``docs/benchmarks.md``, "Measurements the code cites"). The caller takes the first that is
    installed and does not refuse. q, k, v and mask arrive validated (or None: no request, just
    the name)."""
    if _decoded_token(q, k, v, mask, return_weights, scores):
        yield "sdpa"  # rule 2, not looked up
        return
    measured = None
    if not (return_weights or q is None or mask is None or dropout_p > 0.0 or torch.compiler.is_compiling()):
        grad = torch.is_grad_enabled() and any(t.requires_grad for t in (q, k, v))
        measured = tuning.choice(q, k, v, mask, scores, grad)
        if measured == "flex" and not _compile:
            measured = None
    if measured is not None:
        yield measured
    yield from (name for name in rule(q, k, v, mask, dropout_p, return_weights, scores) if name != measured)


def _decoded_token(q: Tensor | None, k: Tensor | None, v: Tensor | None, mask: Mask | None, return_weights: bool,
                   scores: Scores | None) -> bool:
    """One query without a gradient that sees every key, plain scores: a decoding step."""
    return (q is not None and mask is not None and not return_weights and (scores is None or scores.is_plain)
            and q.shape[2] == 1 and not (torch.is_grad_enabled() and any(t.requires_grad for t in (q, k, v)))
            and mask.sees_every_key(1, k.shape[2]))


def rule(q: Tensor | None, k: Tensor | None, v: Tensor | None, mask: Mask | None, dropout_p: float,
         return_weights: bool, scores: Scores | None = None) -> list[str]:
    """The measured rule of the module docstring (1-7), best first."""
    if return_weights:
        return ["math"]
    if q is None or mask is None:
        return ["sdpa"]
    T, S = q.shape[2], k.shape[2]
    grad = torch.is_grad_enabled() and any(t.requires_grad for t in (q, k, v))
    if scores is not None and not scores.is_plain:  # ALiBi, soft-capping, sinks, a score_mod (rule 5)
        if q.device.type == "cuda":
            return ["flex"] * (_compile and dropout_p == 0.0) + ["triton", "tiled", "sdpa", "math"]
        flex_serves = not grad and dropout_p == 0.0 and _compile and T * S > SMALL and _flex_wins(mask)
        return ["flex"] * flex_serves + ["tiled", "sdpa", "math"]
    if grad and q.device.type == "cpu" and not multiplies_natively(q.device, q.dtype):
        return ["tiled", "sdpa"]  # rule 6: half precision without native half matmuls
    if mask.plain_causal or mask.is_full or (not mask.per_batch and mask.prefix_len is None
                                             and mask.window is not None and mask.window >= S):
        return ["sdpa"]  # a window >= S is plain causal
    if T * S <= SMALL or mask.blocks(T, S, *tiled.tile_sizes(mask)).density() > DENSE:
        return ["sdpa"]
    if q.device.type == "cuda":
        return ["flex"] * _compile + ["triton", "tiled", "sdpa"]
    flex_serves = not grad and dropout_p == 0.0 and _compile
    return ["flex"] * (flex_serves and _flex_wins(mask)) + ["tiled", "sdpa"]


def _flex_wins(mask: Mask) -> bool:
    """Masks whose forward compiled FlexAttention ran faster than tiled on the CPU (rule 4)."""
    short_window = mask.window is not None and mask.window <= FLEX_WINDOW
    return mask.doc_ids is not None or mask.mask_mod is not None or short_window
