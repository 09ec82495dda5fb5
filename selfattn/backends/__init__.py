"""Attention backends: interchangeable implementations of one contract, and ``"auto"``.

Every backend is a module of this package that satisfies :class:`Backend`:

- ``math``: the seed's explicit formula, the executable spec (and the only one that can
  return the attention weights);
- ``sdpa``: ``torch.nn.functional.scaled_dot_product_attention``;
- ``tiled``: the FlashAttention algorithm in plain PyTorch, memory linear in T;
- ``flex``: PyTorch's FlexAttention (compiled), driven by the same mask and block map;
- ``triton``: a fused GPU kernel (optional extra ``triton``), imported on first use.

:func:`resolve` turns ``"auto"`` into a backend name (the rule and its measurements:
:mod:`selfattn.backends.auto`); :func:`load` imports one;
:func:`availability` says whether one can run on a device here, without raising;
:func:`multiplies_natively` whether a device multiplies half precision at full speed
(:func:`assume_native_half` decides it for the CPU, to run either side on any machine).
"""
from __future__ import annotations

import importlib
import sys
from typing import Protocol

import torch
from torch import Tensor

from selfattn.backends import auto
from selfattn.kernels.features import assume_native_half, multiplies_natively  # noqa: F401  (public here)
from selfattn.masks import Mask
from selfattn.scores import Scores

NAMES = ("math", "sdpa", "tiled", "flex", "triton")


class Backend(Protocol):
    """What a backend module provides. q ``(B, H, T, D)``, k and v ``(B, Hkv, S, D)``, out
    ``(B, H, T, D)``; ``mask`` is the request's :class:`~selfattn.masks.Mask`. Requests reach
    a backend validated, with T >= 1 and B >= 1."""

    RETURNS_WEIGHTS: bool  # whether ``run_with_weights`` exists: (out, weights (B, H, T, S))

    def available(self, device: torch.device) -> str | None:
        """Why this backend cannot run on ``device`` on this machine, or None when it can."""

    def unsupported(self, q: Tensor, k: Tensor, v: Tensor, mask: Mask, dropout_p: float,
                    scores: Scores | None = None) -> str | None:
        """Why this backend cannot serve this request (dtype, head size, device, score rules, ...), or None."""

    def run(self, q: Tensor, k: Tensor, v: Tensor, mask: Mask, *, scale: float, dropout_p: float,
            scores: Scores | None = None) -> Tensor:
        """The attention output; ``scores`` (None: plain) as :mod:`selfattn.scores` defines them."""


def resolve(name: str, *, q: Tensor | None = None, k: Tensor | None = None, v: Tensor | None = None,
            mask: Mask | None = None, dropout_p: float = 0.0, return_weights: bool = False,
            scores: Scores | None = None) -> str:
    """The backend that serves ``name``; ``"auto"`` is decided by :mod:`selfattn.backends.auto`
    from the request (q, k, v, mask, dropout_p, return_weights, scores) when it is given."""
    if name == "auto":
        for candidate in auto.candidates(q, k, v, mask, dropout_p, return_weights, scores):
            try:
                backend = load(candidate)
            except ImportError:  # an optional extra that is not installed
                continue
            if q is None or backend.unsupported(q, k, v, mask, dropout_p, scores) is None:
                return candidate
        return "math"
    if name not in NAMES:
        raise ValueError(f"unknown attention backend {name!r}; choose one of {('auto',) + NAMES}")
    return name


def load(name: str) -> Backend:
    """The backend module called ``name`` (imported lazily: triton is optional)."""
    loaded = sys.modules.get(f"selfattn.backends.{name}")  # no import machinery once loaded: torch.compile traces this
    if loaded is not None and name in NAMES:
        return loaded
    return importlib.import_module(f"selfattn.backends.{resolve(name)}")


def availability(name: str, device: torch.device | str = "cpu") -> str | None:
    """Why backend ``name`` cannot run on ``device`` here (a missing extra, no GPU), or None."""
    try:
        backend = load(name)
    except ImportError as e:
        return str(e)
    return backend.available(torch.device(device))


# The pure-PyTorch backends are imported up front so that torch.compile never has to trace an
# import (``load`` finds them in sys.modules); only the optional triton backend stays lazy.
from selfattn.backends import flex, math, sdpa, tiled  # noqa: E402,F401
