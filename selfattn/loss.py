"""The language-model loss: the cross-entropy of the head's logits, a chunk of positions at a time.

The head turns N hidden states ``(N, C)`` into ``(N, V)`` logits; for a large vocabulary they are the
largest tensors of a training step (Gemma 3: V = 262,144, so one 512-token sequence makes 0.5 GB of
float32 logits, and the plain backward holds their softmax and gradient as well).
:func:`head_cross_entropy` never holds more than :data:`CHUNK_LOGITS` logits at once: for each chunk
of positions it computes their logits, the loss, and at once the loss's gradient with respect to
them (softmax minus one-hot), which it multiplies into the gradients of the hidden states and of the
head's weight; then the chunk's logits are dropped. The backward only scales those gradients by the
one it receives. The products are those of the plain loss (one forward, two backward), none is
recomputed; what it keeps is one chunk of logits, the gradient of ``h`` and, when the head is
trained, of its weight.

Numerics: the products run in ``h``'s dtype (under autocast, the autocast dtype), the logits, the
soft-cap, the softmax and the loss in float32 (float64 for float64 inputs), as ``F.cross_entropy``
on upcast logits does. Targets of -100 are ignored; the loss is the mean over the others (NaN when
there are none, as ``F.cross_entropy``'s).
"""
from __future__ import annotations

import torch
from torch import Tensor

CHUNK_LOGITS = 2 ** 24  # logits held at once (64 MiB in float32): positions per chunk = this // V
IGNORE = -100  # a target that adds nothing to the loss


def head_cross_entropy(h: Tensor, weight: Tensor, targets: Tensor, *, softcap: float | None = None,
                       chunk: int | None = None) -> Tensor:
    """Mean cross-entropy of the logits ``softcap·tanh(h @ weight.T / softcap)`` (plain ``h @ weight.T``
    without a cap) against ``targets``: ``h`` ``(N, C)``, ``weight`` ``(V, C)``, ``targets`` ``(N,)``
    integers. ``chunk``: positions per chunk (default ``CHUNK_LOGITS // V``)."""
    chunk = chunk or max(1, CHUNK_LOGITS // weight.shape[0])
    device = h.device.type
    dtype = torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else h.dtype
    with torch.autocast(device, enabled=False):
        return _HeadCrossEntropy.apply(h, weight, targets, softcap, chunk, dtype)


class _HeadCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, h: Tensor, weight: Tensor, targets: Tensor, softcap: float | None, chunk: int,
                dtype: torch.dtype) -> Tensor:
        want_h, want_w = ctx.needs_input_grad[:2]
        work = torch.promote_types(dtype, torch.float32)  # float32, or float64 for float64 inputs
        w = weight.to(dtype)
        counted = (targets != IGNORE).sum().to(work)
        total = torch.zeros((), dtype=work, device=h.device)
        grad_h = torch.empty_like(h) if want_h else None
        grad_w = torch.zeros_like(weight, dtype=work) if want_w else None
        for start in range(0, h.shape[0], chunk):
            hc, tc = h[start:start + chunk].to(dtype), targets[start:start + chunk]  # (n, C), (n,)
            z = (hc @ w.T).to(work)  # (n, V)
            capped = None if softcap is None else torch.tanh(z / softcap)  # (n, V)
            logits = z if capped is None else capped * softcap
            keep = tc != IGNORE  # (n,)
            picked = tc.clamp(min=0)[:, None]  # (n, 1) an index for every row; ignored rows are masked out
            lse = torch.logsumexp(logits, dim=-1)  # (n,)
            total += ((lse - logits.gather(1, picked)[:, 0]) * keep).sum()
            if not (want_h or want_w):
                continue
            dz = torch.softmax(logits, dim=-1)  # (n, V): d loss_i / d logits, before the one-hot
            dz.scatter_add_(1, picked, torch.full_like(picked, -1, dtype=work))
            dz *= keep[:, None] / counted
            if capped is not None:
                dz *= 1 - capped * capped  # through softcap·tanh(z / softcap)
            dz = dz.to(dtype)
            if want_h:
                grad_h[start:start + chunk] = dz @ w  # (n, C)
            if want_w:
                grad_w += (dz.T @ hc).to(work)  # (V, C)
        ctx.save_for_backward(grad_h, None if grad_w is None else grad_w.to(weight.dtype))
        return total / counted

    @staticmethod
    def backward(ctx, grad: Tensor):
        grad_h, grad_w = ctx.saved_tensors
        return (None if grad_h is None else grad_h * grad.to(grad_h.dtype),
                None if grad_w is None else grad_w * grad.to(grad_w.dtype), None, None, None, None)
