"""The seed's worked example, computed live: shape walk, parameter count, causality test.

Every number in the text is computed from a real ``SelfAttention`` on a random input; with the
defaults (seed 0, B=1, T=4, C=8, H=2, change position 2) it reproduces the seed document:
256 parameters, max change 0.0 at positions 0-1 and 0.3175 at positions 2-3.
"""
from __future__ import annotations

import contextlib
import os
import re
from pathlib import Path

import torch

from selfattn._util import validate as _validate
from selfattn.masks import Mask
from selfattn.self_attention import SelfAttention

_LIVE_MATRICES = 4  # (1, H, T, T) float32 tensors alive at once: scores, masked scores, weights, and the module's


def worked_example(*, n_embd: int = 8, n_head: int = 2, seq_len: int = 4, seed: int = 0, position: int = 2,
                   n_kv_head: int | None = None, window: int | None = None, head: int = 0) -> str:
    """The worked example's whole text. Raises ValueError on impossible sizes, and on sizes
    whose T x T matrices would not fit in the memory this machine has available."""
    _validate.heads(n_embd, n_head, n_kv_head)  # first: --head is checked against n_head
    if seq_len <= 0:
        raise ValueError(f"--seq-len must be positive, got {seq_len}")
    if not 0 <= position < seq_len:
        raise ValueError(f"--position {position} is outside the sequence 0..{seq_len - 1}")
    if not 0 <= head < n_head:
        raise ValueError(f"--head {head} is outside 0..{n_head - 1}")
    need, available = _LIVE_MATRICES * n_head * seq_len ** 2 * 4, _available_memory()  # float32 (1, H, T, T)
    if need > available:
        raise ValueError(f"--seq-len {seq_len} would need about {need / 1e9:,.1f} GB ({_LIVE_MATRICES} float32 "
                         f"(1, {n_head}, {seq_len}, {seq_len}) score and weight matrices at once), more than the "
                         f"{available / 1e9:,.1f} GB available; the worked example is meant for small T")
    torch.manual_seed(seed)  # the seed document's order of random draws: module, x, then x2[position]
    attn = SelfAttention(n_embd, n_head, n_kv_head=n_kv_head, window=window, backend="math")
    x = torch.randn(1, seq_len, n_embd)
    B, T, C = x.shape
    H, Hkv, D = attn.n_head, attn.n_kv_head, attn.head_dim

    lines = [f"Self-attention from scratch: B={B}, T={T}, C={C}, H={H} heads of D={D}"
             + (f", Hkv={Hkv} key/value heads" if Hkv != H else "")
             + (f", window={window}" if window else "") + f" (seed {seed})", "", "Shape walk"]
    with torch.no_grad():
        walk, y_walk = _shape_walk(attn, x)
        y1, weights = attn(x, return_weights=True)
    assert torch.equal(y_walk, y1), "the shape walk must compute exactly what the module computes"
    lines += [f"  {name:<24}{str(tuple(shape)):<16}{note}" for name, shape, note in walk]

    n = sum(p.numel() for p in attn.parameters())
    lines += ["", "Parameters"]
    if Hkv == H:
        lines.append(f"  qkv 3·C² = {3 * C * C} + proj C² = {C * C} -> {n} = 4·{C}²")
        lines.append(f"  at C = 2048: 4·2048² = {4 * 2048 ** 2:,} (~{4 * 2048 ** 2 / 1e6:.1f}M)")
    else:
        lines.append(f"  qkv C² + 2·C·Hkv·D = {C * C + 2 * C * Hkv * D} + proj C² = {C * C} -> {n}"
                     f" (vs 4·C² = {4 * C * C} without GQA)")

    x2 = x.clone()
    x2[0, position] = torch.randn(C)
    with torch.no_grad():
        y2 = attn(x2)
    lines += ["", f"Causality: change only position {position} of x and run again"]
    if position > 0:
        before = (y1[0, :position] - y2[0, :position]).abs().max().item()
        lines.append(f"  max |change| at positions 0-{position - 1}:".ljust(38)
                     + f"{before!r:<8} unchanged: they cannot see position {position}")
    after = (y1[0, position:] - y2[0, position:]).abs().max().item()
    lines.append(f"  max |change| at positions {position}-{T - 1}:".ljust(38) + f"{round(after, 4)!r:<8} moved")

    lines += ["", f"Attention weights of head {head} (row = query, column = key; '.' = masked, exactly 0)"]
    lines += _matrix(weights[0, head], Mask(window=window).dense(T, T)[0, 0])
    return "\n".join(lines)


def _available_memory() -> int:
    """Bytes a new allocation may take: Linux's MemAvailable, elsewhere the free physical pages."""
    with contextlib.suppress(OSError, AttributeError):
        return int(re.search(r"^MemAvailable:\s+(\d+) kB", Path("/proc/meminfo").read_text(), re.M).group(1)) * 1024
    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def _shape_walk(attn: SelfAttention, x: torch.Tensor):
    """Recompute the module's forward step by step; return (name, shape, note) rows and the output."""
    B, T, C = x.shape
    H, Hkv, D = attn.n_head, attn.n_kv_head, attn.head_dim
    rows = [("x", x.shape, "input (B, T, C)")]
    qkv = attn.qkv(x)
    rows.append(("qkv = x @ W_qkvᵀ", qkv.shape, "one matmul makes q, k and v"))
    q, k, v = qkv.split([C, Hkv * D, Hkv * D], dim=2)
    rows.append(("q, k, v = split", q.shape, "three views of the same input" if Hkv == H
                 else f"q (B, T, C); k, v {tuple(k.shape)}"))
    q = q.view(B, T, H, D).transpose(1, 2)  # (B, H, T, D)
    k = k.view(B, T, Hkv, D).transpose(1, 2)  # (B, Hkv, T, D)
    v = v.view(B, T, Hkv, D).transpose(1, 2)  # (B, Hkv, T, D)
    rows.append(("view + transpose", q.shape, "(B, H, T, D): heads become a batch dimension"))
    if Hkv != H:
        k = k.repeat_interleave(H // Hkv, dim=1)  # (B, H, T, D)
        v = v.repeat_interleave(H // Hkv, dim=1)  # (B, H, T, D)
        rows.append(("k, v shared by groups", k.shape, f"each k/v head serves {H // Hkv} query heads"))
    scores = (q @ k.transpose(-2, -1)) * D ** -0.5  # (B, H, T, T)
    rows.append(("scores = q @ kᵀ · D^-½", scores.shape, f"scaled by 1/sqrt({D}) = {D ** -0.5:.4g}"))
    mask = Mask(window=attn.window).dense(T, T)[0, 0]  # (T, T)
    rows.append(("mask = tril(ones)" if attn.window is None else "mask = band(window)", mask.shape,
                 "True = may attend; the diagonal is kept"))
    weights = torch.softmax(scores.masked_fill(~mask, float("-inf")), dim=-1)  # (B, H, T, T)
    rows.append(("weights = softmax", weights.shape, "masked scores are -inf, so their weight is exactly 0"))
    y = weights @ v  # (B, H, T, D)
    rows.append(("weights @ v", y.shape, "each query: a weighted mix of the values it may see"))
    y = y.transpose(1, 2).contiguous().view(B, T, C)  # (B, T, C)
    rows.append(("transpose + view", y.shape, "heads re-assembled side by side"))
    out = attn.proj(y)
    rows.append(("out = y @ W_projᵀ", out.shape, "same shape as the input"))
    return rows, out


def _matrix(w: torch.Tensor, allowed: torch.Tensor) -> list[str]:
    T, S = w.shape
    head = "       " + "".join(f"k{j:<6}" for j in range(S))
    body = [f"  q{i:<3}" + "".join(f"{w[i, j].item():<7.4f}" if allowed[i, j] else ".      " for j in range(S))
            for i in range(T)]
    return [head.rstrip()] + [b.rstrip() for b in body]
