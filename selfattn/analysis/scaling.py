"""Why scale the scores by 1/sqrt(head_dim): the softmax at init under three scalings.

A score ``q · k`` sums D products. With q and k of independent unit-variance entries (what
LayerNorm'd inputs and a variance-preserving init, weights N(0, 1/C), give) its variance is D,
so ``q · k / sqrt(D)`` has variance 1 whatever the width. Dividing by sqrt(C) = sqrt(H·D)
instead leaves variance 1/H: the wider the model (the more heads at a fixed head size), the
flatter the softmax and the smaller the gradient reaching q and k. Not dividing at all
leaves variance D: the softmax saturates into a near one-hot and its gradient vanishes.

:func:`measure` draws q, k, v ~ N(0, 1) of shape ``(B, H, T, D)`` with H = C / D, runs the
math backend with every query seeing all T keys, and reports per scaling the score standard
deviation, the mean largest weight of a row (1/T is uniform, 1 is one-hot), the mean row
entropy divided by ln T (1 is uniform, 0 is one-hot) and the root-mean-square gradient of
``sum(out * g)`` (g ~ N(0, 1)) with respect to q.
"""
from __future__ import annotations

import math
from collections.abc import Sequence

import torch

from selfattn._util.validate import positive_ints
from selfattn.self_attention import attention

SCALINGS = ("1/sqrt(D)", "1/sqrt(C)", "1 (none)")


def measure(n_embd: int, head_dim: int, *, seq_len: int = 128, batch: int = 4, seed: int = 0) -> list[dict]:
    """One row per scaling in :data:`SCALINGS` for width ``n_embd`` = H · ``head_dim``."""
    positive_ints(n_embd=n_embd, head_dim=head_dim, seq_len=seq_len, batch=batch)
    if n_embd % head_dim:
        raise ValueError(f"n_embd={n_embd} is not a multiple of head_dim={head_dim}")
    if seq_len < 2:
        raise ValueError(f"seq_len must be >= 2 (one key is always one-hot), got {seq_len}")
    H, D, T = n_embd // head_dim, head_dim, seq_len
    g = torch.Generator().manual_seed(seed)
    q, k, v, grad_out = (torch.randn(batch, H, T, D, generator=g) for _ in range(4))  # (B, H, T, D) each
    rows = []
    for name, scale in zip(SCALINGS, (D ** -0.5, n_embd ** -0.5, 1.0)):
        q_ = q.clone().requires_grad_(True)
        out, weights = attention(q_, k, v, causal=False, scale=scale, backend="math", return_weights=True)
        (out * grad_out).sum().backward()
        entropy = -(weights * weights.clamp(min=torch.finfo(weights.dtype).tiny).log()).sum(-1)  # (B, H, T)
        rows.append({"n_embd": n_embd, "n_head": H, "head_dim": D, "scaling": name, "scale": scale,
                     "score_std": ((q @ k.transpose(-2, -1)) * scale).std().item(),
                     "max_weight": weights.amax(-1).mean().item(),
                     "entropy": (entropy.mean() / math.log(T)).item(),
                     "grad_rms": q_.grad.pow(2).mean().sqrt().item()})
    return rows


def study(widths: Sequence[int] = (64, 256, 1024, 4096), head_dim: int = 64, *, seq_len: int = 128,
          seed: int = 0) -> list[dict]:
    """:func:`measure` at each width, the same seed for each (so rows differ only by C)."""
    if not widths:
        raise ValueError("widths must name at least one width")
    return [row for C in widths for row in measure(C, head_dim, seq_len=seq_len, seed=seed)]


def report(rows: list[dict], seq_len: int) -> str:
    lines = [f"Softmax at init, q, k, v ~ N(0, 1), every query sees T = {seq_len} keys; "
             f"uniform: max weight {1 / seq_len:.4f}, entropy/ln T 1.0; one-hot: 1.0 and 0.0", "",
             f"  {'C':>5} {'H':>3} {'D':>3}  {'scaling':<10} {'score std':>9} {'max weight':>10} "
             f"{'entropy/lnT':>11} {'grad rms dq':>11}"]
    for r in rows:
        lines.append(f"  {r['n_embd']:>5} {r['n_head']:>3} {r['head_dim']:>3}  {r['scaling']:<10} "
                     f"{r['score_std']:>9.3f} {r['max_weight']:>10.4f} {r['entropy']:>11.3f} {r['grad_rms']:>11.4f}")
    return "\n".join(lines)
