"""The normalisations of a transformer, described as data: :class:`Norm` builds one of a width.

Two kinds, each with the details real models differ in:

- ``"layernorm"``: ``nn.LayerNorm``, with or without a bias (GPT-2, BLOOM);
- ``"rmsnorm"``: ``x / sqrt(mean(x²) + eps)`` computed in float32 (or float64), times a
  weight. ``offset`` makes the scale ``offset + weight`` (Gemma stores ``w`` and scales by
  ``1 + w``; the weight then starts at ``1 - offset``, so a fresh norm scales by one), and
  ``weight_in_float32`` multiplies before the cast back to the input's dtype (Gemma, OLMo 2,
  gpt-oss) instead of after it (Llama). In float32 the two orders are the same numbers; in half
  precision they round differently, which is why both exist.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from selfattn._util import validate as _validate

KINDS = ("layernorm", "rmsnorm")


@dataclass(frozen=True)
class Norm:
    """How every norm of a model is made; call it with a width to get the module."""
    kind: str = "layernorm"
    eps: float = 1e-5
    bias: bool = False  # LayerNorm only: a learned shift
    offset: float = 0.0  # RMSNorm only: scale by offset + weight
    weight_in_float32: bool = False  # RMSNorm only: the weight multiplies before the cast back

    def __post_init__(self):
        if self.kind not in KINDS:
            raise ValueError(f"norm must be one of {', '.join(map(repr, KINDS))}, got {self.kind!r}")
        _validate.positive_number("norm eps", self.eps)
        if self.kind == "layernorm" and (self.offset or self.weight_in_float32):
            raise ValueError("norm_offset and norm_weight_in_float32 describe an RMSNorm; a LayerNorm has neither")

    def __call__(self, width: int) -> nn.Module:
        if self.kind == "layernorm":
            return nn.LayerNorm(width, eps=self.eps, bias=self.bias)
        return RMSNorm(width, self.eps, offset=self.offset, weight_in_float32=self.weight_in_float32)


class RMSNorm(nn.Module):
    """``(offset + weight) * x / sqrt(mean(x²) + eps)`` over the last dim, in float32 (or
    float64), cast back to x's dtype after the weight (``weight_in_float32``) or before it."""

    def __init__(self, width: int, eps: float, *, offset: float = 0.0, weight_in_float32: bool = False):
        super().__init__()
        self.weight = nn.Parameter(torch.full((width,), 1.0 - offset))
        self.eps, self.offset, self.weight_in_float32 = eps, offset, weight_in_float32

    def forward(self, x: Tensor) -> Tensor:
        work = x.to(torch.promote_types(x.dtype, torch.float32))  # (..., W), half inputs in float32
        normed = F.rms_norm(work, work.shape[-1:], eps=self.eps)  # work * rsqrt(mean(work²) + eps), one kernel
        if self.weight_in_float32:
            return (normed * (self.weight.to(work.dtype) + self.offset)).to(x.dtype)
        return (self.weight + self.offset if self.offset else self.weight) * normed.to(x.dtype)

    def extra_repr(self) -> str:
        opts = [str(self.weight.shape[0]), f"eps={self.eps}"]
        opts += [f"offset={self.offset}"] * bool(self.offset) + ["weight_in_float32"] * self.weight_in_float32
        return ", ".join(opts)
