"""Parity inputs and the float64 assertion, shared by the backend test files.

- :func:`make_case`: deterministic inputs ``q, k, v`` and an output gradient for a shape,
  plus the ``attention()`` mask keywords of a named mask kind (:data:`MASK_KINDS`);
- :func:`assert_close_all`: every tensor within ``atol + rtol·|expected|`` (float64 parity
  with the tolerances :data:`F64`), raising ``AssertionError`` naming the tensor and its max
  error, so a test that prints nothing on success still explains a failure.

Running a backend and the FlashAttention rule for low precision are the library's own
(:mod:`selfattn.audit.parity`), re-exported here.
"""
from __future__ import annotations

import zlib
from collections.abc import Sequence

import torch
from torch import Tensor

from selfattn.audit.parity import NAMES, assert_flash_rule, forward_backward, max_error  # noqa: F401

HEADS = {"MHA": (4, 4), "GQA": (4, 2), "MQA": (4, 1)}  # name -> (H, Hkv)
MASK_KINDS = ("causal", "window", "padding", "docs", "all", "many-docs", "heavy-padding")
WINDOW = 13
F64 = {"atol": 1e-10, "rtol": 1e-9}  # float64 parity: backends differ from math only by summation order (~1e-15)


def mask_kwargs(kind: str, B: int, S: int, generator: torch.Generator) -> dict:
    """``attention()`` keywords for a mask kind over S keys:

    causal; window (causal, last ``WINDOW`` keys); padding (causal, batch row 0 left-padded by
    S // 3 so its first queries see nothing, other rows with random holes); docs (packed
    documents, bidirectional inside a document: causal=False); all (causal + window + padding
    + documents); many-docs (causal, documents of ~3 tokens: most tiles cross a boundary);
    heavy-padding (causal, row 0 left-padded by 4/5, other rows 80% holes: most tiles hidden).
    """
    if kind not in MASK_KINDS:
        raise ValueError(f"unknown mask kind {kind!r}; choose one of {MASK_KINDS}")
    pad = torch.rand(B, S, generator=generator) > 0.3  # (B, S) True = real token
    pad[0] = torch.arange(S) >= S // 3
    docs = (torch.rand(B, S, generator=generator) < 0.1).cumsum(dim=1)  # (B, S) sorted document ids
    short_docs = (torch.rand(B, S, generator=generator) < 0.3).cumsum(dim=1)  # (B, S) many short documents
    sparse = torch.rand(B, S, generator=generator) > 0.8  # (B, S) one real token in five
    sparse[0] = torch.arange(S) >= 4 * S // 5
    return {
        "causal": {},
        "window": {"window": WINDOW},
        "padding": {"key_padding_mask": pad},
        "docs": {"causal": False, "doc_ids": docs},
        "all": {"window": WINDOW, "key_padding_mask": pad, "doc_ids": docs},
        "many-docs": {"doc_ids": short_docs},
        "heavy-padding": {"key_padding_mask": sparse},
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


def assert_close_all(actual: Sequence[Tensor], expected: Sequence[Tensor], *, atol: float, rtol: float,
                     names: Sequence[str] = NAMES) -> None:
    """Every ``actual[i]`` within ``atol + rtol * |expected[i]|`` elementwise (NaN fails)."""
    for name, a, e in zip(names, actual, expected, strict=True):
        bound = atol + rtol * e.double().abs()
        err = (a.double() - e.double()).abs()
        if not bool((err <= bound).all()):  # NaN compares False: it fails too
            raise AssertionError(f"{name}: max error {max_error(a, e):.3e} exceeds atol={atol:g} + rtol={rtol:g}·|x|")
