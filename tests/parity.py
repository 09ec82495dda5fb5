"""Parity helpers: run a backend forward and backward, compare it with the math oracle.

Small on purpose, shared by the backend test files:

- :func:`make_case`: deterministic inputs ``q, k, v`` and an output gradient for a shape,
  plus the ``attention()`` mask keywords of a named mask kind (:data:`MASK_KINDS`);
- :func:`forward_backward`: ``(out, dq, dk, dv)`` of one backend through ``attention()``;
- :func:`assert_close_all`: every tensor within ``atol + rtol·|expected|`` (float64 parity
  with the tolerances :data:`F64`);
- :func:`assert_flash_rule`: the FlashAttention rule for low precision: the backend's max error
  against the float64 oracle is at most twice the error of the math backend run in the same
  dtype, plus a small floor relative to the tensor's size.

Both assertions raise ``AssertionError`` naming the tensor and its max error, so a test that
prints nothing on success still explains a failure.
"""
from __future__ import annotations

import zlib
from collections.abc import Sequence

import torch
from torch import Tensor

from selfattn import attention

NAMES = ("out", "dq", "dk", "dv")
HEADS = {"MHA": (4, 4), "GQA": (4, 2), "MQA": (4, 1)}  # name -> (H, Hkv)
MASK_KINDS = ("causal", "window", "padding", "docs", "all")
WINDOW = 13
F64 = {"atol": 1e-10, "rtol": 1e-9}  # float64 parity: backends differ from math only by summation order (~1e-15)


def mask_kwargs(kind: str, B: int, S: int, generator: torch.Generator) -> dict:
    """``attention()`` keywords for a mask kind over S keys:

    causal; window (causal, last ``WINDOW`` keys); padding (causal, batch row 0 left-padded by
    S // 3 so its first queries see nothing, other rows with random holes); docs (packed
    documents, bidirectional inside a document: causal=False); all (causal + window + padding
    + documents).
    """
    if kind not in MASK_KINDS:
        raise ValueError(f"unknown mask kind {kind!r}; choose one of {MASK_KINDS}")
    pad = torch.rand(B, S, generator=generator) > 0.3  # (B, S) True = real token
    pad[0] = torch.arange(S) >= S // 3
    docs = (torch.rand(B, S, generator=generator) < 0.1).cumsum(dim=1)  # (B, S) sorted document ids
    return {
        "causal": {},
        "window": {"window": WINDOW},
        "padding": {"key_padding_mask": pad},
        "docs": {"causal": False, "doc_ids": docs},
        "all": {"window": WINDOW, "key_padding_mask": pad, "doc_ids": docs},
    }[kind]


def make_case(H: int, Hkv: int, T: int, S: int, D: int, mask: str, *, B: int = 2,
              dtype: torch.dtype = torch.float64) -> tuple[tuple[Tensor, Tensor, Tensor, Tensor], dict]:
    """``(q, k, v, grad_out)`` in ``dtype`` (q, k, v leaves that require grad) and the mask
    keywords; the same numbers for every dtype (drawn in float64 from a seed of the shape)."""
    seed = zlib.crc32(repr((B, H, Hkv, T, S, D, mask)).encode())
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, H, T, D, generator=g, dtype=torch.float64)
    k = torch.randn(B, Hkv, S, D, generator=g, dtype=torch.float64)
    v = torch.randn(B, Hkv, S, D, generator=g, dtype=torch.float64)
    grad = torch.randn(B, H, T, D, generator=g, dtype=torch.float64)
    q, k, v = (t.to(dtype).requires_grad_() for t in (q, k, v))
    return (q, k, v, grad.to(dtype)), mask_kwargs(mask, B, S, g)


def forward_backward(backend: str, q: Tensor, k: Tensor, v: Tensor, grad: Tensor, **kwargs) -> tuple[Tensor, ...]:
    """``(out, dq, dk, dv)`` of ``attention(q, k, v, backend=backend, **kwargs)``, detached."""
    out = attention(q, k, v, backend=backend, **kwargs)
    dq, dk, dv = torch.autograd.grad(out, (q, k, v), grad)
    return out.detach(), dq, dk, dv


def _max_error(actual: Tensor, expected: Tensor) -> float:
    if actual.shape != expected.shape:
        raise AssertionError(f"shape {tuple(actual.shape)} != expected {tuple(expected.shape)}")
    if actual.numel() == 0:
        return 0.0
    return (actual.double() - expected.double()).abs().max().item()


def assert_close_all(actual: Sequence[Tensor], expected: Sequence[Tensor], *, atol: float, rtol: float,
                     names: Sequence[str] = NAMES) -> None:
    """Every ``actual[i]`` within ``atol + rtol * |expected[i]|`` elementwise (NaN fails)."""
    for name, a, e in zip(names, actual, expected, strict=True):
        bound = atol + rtol * e.double().abs()
        err = (a.double() - e.double()).abs()
        if not bool((err <= bound).all()):  # NaN compares False: it fails too
            raise AssertionError(f"{name}: max error {_max_error(a, e):.3e} exceeds atol={atol:g} + rtol={rtol:g}·|x|")


def assert_flash_rule(actual: Sequence[Tensor], same_dtype_math: Sequence[Tensor], exact: Sequence[Tensor], *,
                      rel_floor: float, names: Sequence[str] = NAMES) -> None:
    """``max|actual - exact| <= 2 * max|same_dtype_math - exact| + rel_floor * max|exact|`` per tensor.

    ``exact`` is the math backend in float64, ``same_dtype_math`` the math backend in the
    backend's own dtype: a backend may be at most twice as wrong as the plain reference.
    """
    for name, a, r, e in zip(names, actual, same_dtype_math, exact, strict=True):
        err, ref_err = _max_error(a, e), _max_error(r, e)
        bound = 2 * ref_err + rel_floor * (e.abs().max().item() if e.numel() else 0.0)
        if not err <= bound:  # NaN fails
            raise AssertionError(f"{name}: max error {err:.3e} > 2 x same-dtype math error {ref_err:.3e} "
                                 f"+ floor = {bound:.3e}")
