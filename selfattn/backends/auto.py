"""``backend="auto"``: the backend expected to be fastest for a request, never one that refuses it.

The rule, from ``python -m benchmarks masks`` and timings of the same kind on a 2-core AMD EPYC
with AVX2 (float32, B=1, H=8, D=64, medians of interleaved runs). The timings behind each rule are
in ``docs/benchmarks.md``, "Measurements the code cites"; the masks tables are in the same file, an
AVX2 run in ``docs/bench/masks-avx2.md``:

1. Weights asked for: ``math``, the only backend that returns them.
2. Plain causal or unmasked attention (a window as long as the sequence included): ``sdpa``.
   PyTorch's fused kernel with ``is_causal`` was the fastest at T = 4096, forward and
   forward+backward, ahead of tiled and FlexAttention. So is one query without a gradient that
   sees every key (a decoded token), taken without the lookup of the measurements (which cost a
   large share of the attention it picks): SDPA without a mask beat the math backend's products over
   512 cached keys of SmolLM2's heads. On the CPU the sdpa backend hands such a token to the
   one-query kernel of :mod:`selfattn.kernels.matvec`, faster still.
3. A small request, T·S <= ``SMALL`` (a decoding step over a cache, a short sequence):
   ``sdpa`` with the dense mask. At T = S = 256 it beat tiled (window 64 and 4 documents); at
   512 the two tied; from 1024 on tiled won. The crossover is in T, not in the batch or heads:
   at T = 256 SDPA was faster from B·H = 8 to 192 (B=16, H=12), forward and forward+backward;
   at T = 512 (B·H = 8 and 32) tiled was faster in 6 of 8 cells (window 64 and 4 documents).
4. Windows, padding, documents: the tiles the mask leaves visible decide (the block map's
   density at the tiled backend's tile size). Tiled costs about 1.2x SDPA per computed pair
   (plain causal at T = 4096, where it computes 53% of the tiles and SDPA with a dense mask all of
   them), so above a density of ``DENSE`` = 0.8 the dense mask wins; below it, the backends that
   skip hidden tiles:
   - forward only (no gradient, no dropout), compiling allowed, and a mask where compiled
     FlexAttention was faster than tiled: documents (at T = 4096 and 16384), a ``mask_mod``
     (flex compiles it; tiled calls it on every partial tile) and windows of at most
     ``FLEX_WINDOW`` = 256 keys (at windows of 512, 1024 and 2048 tiled was faster): ``flex``.
     Left padding is tiled's since it skips padded tiles per batch row (faster than flex at 50%
     padding, T = 4096 and 16384);
   - otherwise ``tiled`` (forward+backward: many times faster than SDPA with a dense mask).
5. Scores changed before the softmax (ALiBi, soft-capping, a ``score_mod``) or learned sinks:
   the same choice of mask as rule 4 (``flex`` forward on documents, a mask_mod or a short
   window; tiled beat flex on causal ALiBi at T = 4096), else ``tiled`` (which serves every
   rule), ``sdpa`` only for what is a dense additive bias, ``math`` last. Soft-capping's forward
   went both ways on two machines of this kind until tiled computed the cap with a sigmoid
   instead of tanh; then tiled won (``python -m benchmarks masks --cells softcap:4096
   causal:4096 --impls auto tiled flex flex-compiled sdpa``).
6. Half precision with a gradient on a CPU without native half matmuls (AVX2): ``tiled``
   whatever the mask. Its tiles are multiplied in float32 there, while PyTorch's bfloat16 SDPA
   backward is slow (several times tiled's forward+backward at T = 4096, plain causal and
   every masked cell), though SDPA's bfloat16 forward still won, so forward passes follow rules
   2-4. Short sequences too: timed alone, tiled's forward+backward won at T = 128 and 256.
7. On a CUDA device (not measured by this project yet): plain causal ``sdpa``; other masks and
   score rules ``flex`` when compiling is allowed, else ``triton`` when it is installed and
   serves the request, else ``tiled``.

Measured here first: where this machine has timed requests of the kind (``selfattn bench
calibrate``, or ``SELFATTN_AUTO_TUNE=1``; :mod:`selfattn.backends.tuning`), the backend it measured
fastest comes first and the rule above orders the rest; requests nothing measured covers follow the
rule alone, and so do requests traced by ``torch.compile`` (a compiled decode step's graph holds
one backend for every size it serves). Each candidate is asked (``unsupported``) before it is
chosen; the next one serves when it refuses. Compiling backends (``flex``: up to seconds for
every new shape on that CPU) can be kept out of ``auto`` with :func:`allow_compile` or the
environment variable ``SELFATTN_AUTO_COMPILE=0``.
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
