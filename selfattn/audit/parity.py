"""A backend against the math oracle, tensor by tensor, outputs and gradients.

- :func:`forward_backward`: ``(out, dq, dk, dv)`` of one backend through ``attention()``;
- :func:`flash_rule`: FlashAttention's test rule for low precision: a backend's max error
  against the exact answer may be at most twice the error of the math backend computed in the
  backend's own dtype, plus a floor (absolute, or relative to the size of the answer);
- :func:`assert_flash_rule`: the same as an assertion that names every failing tensor.

The exact answer is the math backend in float64 (or float32 for half inputs where float64 is
too costly, as on a GPU at T = 16384). A NaN or infinite value always fails.
"""
from __future__ import annotations

import math
from collections.abc import Sequence
from typing import NamedTuple

import torch
from torch import Tensor

from selfattn.self_attention import attention

NAMES = ("out", "dq", "dk", "dv")


class Parity(NamedTuple):
    """One tensor under the FlashAttention rule."""
    name: str
    error: float  # max |actual - exact|
    reference_error: float  # max |same-dtype math - exact|
    bound: float  # 2 * reference_error + floor

    @property
    def ok(self) -> bool:
        return math.isfinite(self.error) and self.error <= self.bound


def forward_backward(backend: str, q: Tensor, k: Tensor, v: Tensor, grad: Tensor, *,
                     dtype: torch.dtype | None = None, **kwargs) -> tuple[Tensor, ...]:
    """``(out, dq, dk, dv)`` of ``attention(q, k, v, backend=backend, **kwargs)``, detached.

    With ``dtype``, q, k, v and ``grad`` are first cast to it (q, k, v as new leaves), so one
    set of float64 inputs serves every dtype; otherwise q, k, v must require grad.
    """
    if dtype is not None:
        q, k, v = (t.detach().to(dtype).requires_grad_() for t in (q, k, v))
        grad = grad.to(dtype)
    out = attention(q, k, v, backend=backend, **kwargs)
    dq, dk, dv = torch.autograd.grad(out, (q, k, v), grad)
    return out.detach(), dq, dk, dv


def max_error(actual: Tensor, expected: Tensor) -> float:
    """max |actual - expected| in float64 (NaN or inf when ``actual`` has one); 0 for empty tensors."""
    if actual.shape != expected.shape:
        raise AssertionError(f"shape {tuple(actual.shape)} != expected {tuple(expected.shape)}")
    if actual.numel() == 0:
        return 0.0
    diff = (actual.double() - expected.double()).abs()
    return math.nan if diff.isnan().any() else diff.max().item()


def flash_rule(actual: Sequence[Tensor], same_dtype_math: Sequence[Tensor], exact: Sequence[Tensor], *,
               floor: float = 0.0, rel_floor: float = 0.0, names: Sequence[str] = NAMES) -> list[Parity]:
    """Each tensor: ``max|actual - exact| <= 2 max|same_dtype_math - exact| + floor + rel_floor * max|exact|``."""
    if not len(actual) == len(same_dtype_math) == len(exact) <= len(names):
        raise ValueError(f"flash_rule needs as many actual, same-dtype and exact tensors (at most {len(names)}), "
                         f"got {len(actual)}, {len(same_dtype_math)}, {len(exact)}")
    rows = []
    for name, a, r, e in zip(names, actual, same_dtype_math, exact):
        ref_err = max_error(r, e)
        size = e.abs().max().item() if e.numel() else 0.0
        rows.append(Parity(name, max_error(a, e), ref_err, 2 * ref_err + floor + rel_floor * size))
    return rows


def assert_flash_rule(actual: Sequence[Tensor], same_dtype_math: Sequence[Tensor], exact: Sequence[Tensor], *,
                      floor: float = 0.0, rel_floor: float = 0.0, names: Sequence[str] = NAMES) -> None:
    """:func:`flash_rule` as an assertion naming each failing tensor and its errors."""
    bad = [p for p in flash_rule(actual, same_dtype_math, exact, floor=floor, rel_floor=rel_floor, names=names)
           if not p.ok]
    if bad:
        raise AssertionError("; ".join(f"{p.name}: error {p.error:.3e} > 2 x same-dtype math error "
                                       f"{p.reference_error:.3e} + floor = {p.bound:.3e}" for p in bad))
