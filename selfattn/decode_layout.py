"""How a model's weights are stored and multiplied for decoding (:meth:`GPT.decode_layout`).

A decode step multiplies one row (batch 1) or a few (a batch, a speculative verification) by
every weight matrix once, so it runs at the speed PyTorch's CPU kernels stream a matrix for a
few rows. That depends on the dtype, the order the matrix is stored in, the form of the call
and the machine. Milliseconds for all of SmolLM2-135M's matrices on a 2-core Xeon (AVX-512,
AVX512-BF16, AMX), in the storage order below:

    rows               1: torch.mv  F.linear  W·xᵀ     8: F.linear  W·xᵀ
    float32                 21.6      20.0    20.2           46.0    84.0
    bfloat16                16.5      23.1    23.5           23.2    15.7
    float16                 39.2      28.5    29.4           38.6    40.0

``W·xᵀ`` is ``torch.mm(weight, rows.T).T``: the same product with the matrix as the first
operand, which sends bfloat16 to another kernel. The fastest form differs between dtypes, and
a ranking measured on one CPU may be wrong on the next, so :func:`decode_layout` measures the
forms on the model's own matrices, for one row and for :data:`MEASURED_ROWS` rows, and every
``nn.Linear`` becomes a :class:`RowLinear`, which multiplies one row and up to :data:`FEW` rows
by the chosen forms and more (a prompt) by ``F.linear``. The storage order is fixed: float32
matrices take the (in, out) order (GPT-2's Conv1D; GPT-2 small decoded about 1.3x faster than
in ``nn.Linear``'s (out, in) order), half-precision ones keep (out, in) rows. Values, shapes
and ``state_dict`` are unchanged; the forms round alike up to the order of their sums.
"""
from __future__ import annotations

import functools
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from selfattn import _timing

HALF = (torch.bfloat16, torch.float16)
FEW = 16  # up to this many rows a RowLinear takes its few-row form; more rows F.linear
MEASURED_ROWS = 8  # the few-row forms are timed at this many rows

# a product form: (weight (out, in), rows (N, in)) -> (N, out)
PRODUCTS: dict[str, Callable[[Tensor, Tensor], Tensor]] = {
    "mv": lambda w, rows: torch.mv(w, rows[0])[None],  # one row only
    "linear": lambda w, rows: F.linear(rows, w),
    "wxt": lambda w, rows: torch.mm(w, rows.t()).t().contiguous(),  # W·xᵀ (out, N), transposed back
}
FEW_ROW_FORMS = ("linear", "wxt")  # the forms that take several rows


class RowLinear(nn.Linear):
    """An ``nn.Linear`` that multiplies one row by the form ``one_row`` and 2..:data:`FEW` rows
    by ``few_rows`` (names of :data:`PRODUCTS`, set by :func:`decode_layout`), more by ``F.linear``."""
    one_row, few_rows = "mv", "linear"

    def forward(self, x: Tensor) -> Tensor:
        n = x.numel() // self.in_features if self.in_features else 0  # rows, B·T
        if not 0 < n <= FEW:
            return F.linear(x, self.weight, self.bias)
        y = PRODUCTS[self.one_row if n == 1 else self.few_rows](self.weight, x.reshape(n, self.in_features))
        if self.bias is not None:
            y = y + self.bias
        return y.view(*x.shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, one_row={self.one_row!r}, few_rows={self.few_rows!r}"


def decode_layout(model: nn.Module, *, one_row: str | None = None, few_rows: str | None = None) -> nn.Module:
    """Store and multiply ``model``'s weights as decoding reads them fastest (see the module
    docstring), in place; returns the model. ``one_row`` and ``few_rows`` name the forms of
    :data:`PRODUCTS` to use; None measures them here (on the CPU, per dtype: for a 135M-parameter
    model about 1 s in float32, 0.5 s in bfloat16; elsewhere ``"mv"`` and ``"linear"``).
    Idempotent. Meant for inference: the (in, out) order slows the token-embedding lookups of
    training. Call it again after casting the model to another dtype (``.to()`` keeps each
    matrix's order)."""
    _check_form("one_row", one_row, tuple(PRODUCTS))
    _check_form("few_rows", few_rows, FEW_ROW_FORMS)
    linears: dict[tuple, list[RowLinear]] = {}  # (dtype, device) -> its matrices
    for module in model.modules():
        if type(module) is nn.Linear:
            module.__class__ = RowLinear  # the same parameters and state_dict, another forward
        if isinstance(module, (nn.Linear, nn.Embedding)):  # also a model cast since: .to() keeps strides
            w = module.weight.data  # copied only when stored in the other order
            module.weight.data = w.contiguous() if w.dtype in HALF else w.t().contiguous().t()  # strides (1, out)
        if isinstance(module, RowLinear):
            linears.setdefault((module.weight.dtype, module.weight.device), []).append(module)
    with torch.inference_mode():
        for group in linears.values():
            forms = {"one_row": one_row or fastest(group, 1, ("mv", "linear", "wxt")),
                     "few_rows": few_rows or fastest(group, MEASURED_ROWS, FEW_ROW_FORMS)}
            for module in group:
                module.one_row, module.few_rows = forms["one_row"], forms["few_rows"]
    return model


def fastest(linears: list[nn.Linear], rows: int, forms: tuple[str, ...], repeats: int = 3) -> str:
    """The form of ``forms`` that multiplies ``rows`` rows by every matrix of ``linears`` (one
    dtype and device) fastest: the median of ``repeats`` timed passes over them all, the forms
    interleaved in rotating order, after one untimed pass each (kernels set up, matrices paged
    in). Off the CPU, the first form."""
    w = linears[0].weight
    if w.device.type != "cpu":
        return forms[0]
    inputs = {m.in_features: torch.randn(rows, m.in_features, dtype=w.dtype) for m in linears}  # (rows, in)
    passes = {form: functools.partial(_pass, form, linears, inputs) for form in forms}
    for run in passes.values():
        run()
    times = {form: [] for form in forms}
    _timing.rounds(passes, times, list(forms), repeats)
    median = _timing.medians(times)
    return min(forms, key=median.get)


def _pass(form: str, linears: list[nn.Linear], inputs: dict[int, Tensor]) -> None:
    """One product of each matrix of ``linears`` with its rows of ``inputs``, in the form ``form``."""
    for m in linears:
        PRODUCTS[form](m.weight, inputs[m.in_features])


def _check_form(name: str, form, allowed: tuple[str, ...]) -> None:
    if form is not None and form not in allowed:
        raise ValueError(f"{name} must be one of {', '.join(map(repr, allowed))} or None (measured), got {form!r}")
