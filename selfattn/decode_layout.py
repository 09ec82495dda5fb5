"""How a model's weights are stored and multiplied for decoding (:meth:`GPT.decode_layout`).

A decode step multiplies one row (batch 1) or a few (a batch, a speculative verification) by
every weight matrix once, so it runs at the speed the matrices stream through a product kernel
for a few rows. That depends on the dtype, the order the matrix is stored in, the form of the
call and the machine. Milliseconds for all of SmolLM2-135M's matrices, one row, in the storage
order below, on two 2-core machines:

    rows 1:            torch.mv  F.linear  W·xᵀ  stream    8: F.linear  W·xᵀ  stream
    Xeon (AVX-512, AVX512-BF16, AMX)
      float32              21.6      20.0    20.2     -         46.0    84.0     -
      bfloat16             16.5      23.1    23.5     -         23.2    15.7     -
    EPYC (AVX-512, AVX512-BF16)
      float32              35.8      36.6    36.1    29.9       78.9   372.4    40.4
      bfloat16             29.4      22.5    22.5    16.5       26.3    31.5    30.1

(The Xeon's row is from before the stream kernel; the EPYC's from one process on 2026-12-04.)

``W·xᵀ`` is ``torch.mm(weight, rows.T).T``: the same product with the matrix as the first
operand, which sends bfloat16 to another kernel. ``stream`` is :mod:`selfattn.stream_kernel`'s C++
kernel, built on first use for this CPU's vectors: one pass over the matrix rows for all the input
rows, each entry widened to float32 as it streams past (the BLAS matrix-vector kernels of the EPYC
stream float32 at 13-18 GB/s, where a sum of the same bytes runs at 24-31). It is a candidate
wherever it builds, whatever the matrices' size, for one row and, where the matrices are stored in
rows, for a few. (It replaced a dot product per matrix row that ``torch.compile`` wrote for the
CPU: as fast in a compiled float32 step, slower in bfloat16 and for several rows, and compiled
anew in every process for every row length.)
The fastest form differs between dtypes and machines, so :func:`decode_layout`
measures the forms on the model's own matrices, for one row and for :data:`MEASURED_ROWS` rows,
and every ``nn.Linear`` becomes a :class:`RowLinear`, which multiplies one row and up to
:data:`FEW` rows by the chosen forms and more (a prompt) by ``F.linear``.

Storage order. The BLAS forms read float32 matrices in the (in, out) order (GPT-2's Conv1D;
GPT-2 small decoded about 1.3x faster than in ``nn.Linear``'s (out, in) order) and half-precision
ones in (out, in) rows; ``stream`` reads rows. Every matrix of a dtype (embeddings too: a tied head
is one) is stored in the order of its one-row form. Values, shapes and ``state_dict`` are
unchanged; the forms round alike up to the order of their sums.
"""
from __future__ import annotations

import functools
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from selfattn import _timing, stream_kernel

HALF = (torch.bfloat16, torch.float16)
FEW = 16  # up to this many rows a RowLinear takes its few-row form; more rows F.linear
MEASURED_ROWS = 8  # the few-row forms are timed at this many rows


def _stream(w: Tensor, rows: Tensor) -> Tensor:
    """The ``stream`` form: :mod:`selfattn.stream_kernel` for the CPU and its dtypes, ``F.linear``
    for the rest (a model cast to float64 or moved after its layout)."""
    if w.device.type == "cpu" and w.dtype in stream_kernel.MATRIX_DTYPES and rows.dtype in stream_kernel.ROW_DTYPES:
        return stream_kernel.rows(w, rows)
    return F.linear(rows, w)


# a product form: (weight (out, in), rows (N, in)) -> (N, out)
PRODUCTS: dict[str, Callable[[Tensor, Tensor], Tensor]] = {
    "mv": lambda w, rows: torch.mv(w, rows[0])[None],  # one row only
    "linear": lambda w, rows: F.linear(rows, w),
    "wxt": lambda w, rows: torch.mm(w, rows.t()).t().contiguous(),  # W·xᵀ (out, N), transposed back
    "stream": _stream,
}
ONE_ROW_FORMS = ("mv", "linear", "wxt", "stream")
FEW_ROW_FORMS = ("linear", "wxt", "stream")  # the forms that take several rows


def stored_in_rows(form: str, dtype: torch.dtype) -> bool:
    """Whether ``form`` reads a matrix of ``dtype`` fastest in (out, in) rows, else in (in, out)."""
    return form == "stream" or dtype in HALF


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
    model about 2 s, and the first time on a machine the stream kernel builds, about 10 s more;
    elsewhere ``"mv"`` and ``"linear"``). Idempotent. Meant for inference: the (in, out) order
    slows the token-embedding lookups of training. Call it again after casting the model to
    another dtype (``.to()`` keeps each matrix's order)."""
    _check_form("one_row", one_row, ONE_ROW_FORMS)
    _check_form("few_rows", few_rows, FEW_ROW_FORMS)
    groups: dict[tuple, list[nn.Module]] = {}  # (dtype, device) -> its matrices' modules
    for module in model.modules():
        if type(module) is nn.Linear:
            module.__class__ = RowLinear  # the same parameters and state_dict, another forward
        if isinstance(module, (nn.Linear, nn.Embedding)):
            groups.setdefault((module.weight.dtype, module.weight.device), []).append(module)
    with torch.inference_mode():
        for modules in groups.values():
            linears = [m for m in modules if isinstance(m, RowLinear)]
            if not linears:  # embeddings alone in their dtype: stored as mv reads them, nothing to measure
                _store(modules, in_rows=stored_in_rows("mv", modules[0].weight.dtype))
                continue
            chosen = one_row or fastest_one_row(modules, linears)
            _store(modules, in_rows=stored_in_rows(chosen, modules[0].weight.dtype))
            few = few_row_candidates(chosen, modules[0].weight.dtype)
            forms = {"one_row": chosen, "few_rows": few_rows or fastest(linears, MEASURED_ROWS, few)}
            for module in linears:
                module.one_row, module.few_rows = forms["one_row"], forms["few_rows"]
    return model


def fastest_one_row(modules: list[nn.Module], linears: list[nn.Linear]) -> str:
    """The one-row form that multiplies every matrix of ``linears`` fastest, each form timed with
    the matrices (all of ``modules``, one dtype and device) stored in its order: the forms that
    read one order timed together (:func:`timings`), then all compared. ``stream`` is a candidate
    where its kernel builds. Off the CPU, ``"mv"``."""
    w = linears[0].weight
    if w.device.type != "cpu":
        return "mv"
    forms = ["mv", "linear", "wxt"]
    if stream_kernel.failure() is None:
        forms.append("stream")
    median = {}  # form -> seconds
    for in_rows in (False, True):
        read_so = tuple(form for form in forms if stored_in_rows(form, w.dtype) == in_rows)
        if read_so:
            _store(modules, in_rows=in_rows)
            median |= timings(linears, 1, read_so)
    return min(median, key=median.get)


def few_row_candidates(one_row: str, dtype: torch.dtype) -> tuple[str, ...]:
    """The few-row forms measured where ``one_row`` takes one row: the BLAS forms, and ``stream``
    where the matrices are stored in rows (which it reads) and its kernel builds."""
    stream = stored_in_rows(one_row, dtype) and stream_kernel.failure() is None
    return ("linear", "wxt") + (("stream",) if stream else ())


def fastest(linears: list[nn.Linear], rows: int, forms: tuple[str, ...]) -> str:
    """The form of ``forms`` that multiplies ``rows`` rows by every matrix of ``linears`` (one
    dtype and device, stored as they are) fastest (:func:`timings`). Off the CPU, the first form."""
    if linears[0].weight.device.type != "cpu":
        return forms[0]
    median = timings(linears, rows, forms)
    return min(median, key=median.get)


def timings(linears: list[nn.Linear], rows: int, forms: tuple[str, ...], repeats: int = 3) -> dict[str, float]:
    """``{form: seconds}`` to multiply ``rows`` rows by every matrix of ``linears`` in each form:
    the median of ``repeats`` passes over them all, the forms interleaved in rotating order,
    after one untimed pass each (kernels set up, matrices paged in)."""
    w = linears[0].weight
    g = torch.Generator().manual_seed(0)  # the global random stream stays the caller's
    inputs = {m.in_features: torch.randn(rows, m.in_features, dtype=w.dtype, generator=g)
              for m in linears}  # (rows, in)
    return _timing.medians_of({form: functools.partial(_pass, form, linears, inputs) for form in forms}, repeats)


def _pass(form: str, linears: list[nn.Linear], inputs: dict[int, Tensor]) -> None:
    """One product of each matrix of ``linears`` with its rows of ``inputs``, in the form ``form``."""
    for m in linears:
        PRODUCTS[form](m.weight, inputs[m.in_features])


def _store(modules: list[nn.Module], *, in_rows: bool) -> None:
    """Each module's weight stored in (out, in) rows or in the (in, out) order (strides (1, out)),
    copied only when it is stored otherwise (a model cast since keeps its order: ``.to()``); never
    an inference tensor, which a forward with gradients could not use."""
    with torch.inference_mode(False):
        for m in modules:
            w = m.weight.data
            m.weight.data = w.contiguous() if in_rows else w.t().contiguous().t()


def _failure(form: str) -> str | None:
    """Why ``form`` cannot run here (None when it can)."""
    if form == "stream":
        why = stream_kernel.failure()
        return why and f"its kernel did not build here ({why})"
    return None


def _check_form(name: str, form, allowed: tuple[str, ...]) -> None:
    if form is not None and form not in allowed:
        raise ValueError(f"{name} must be one of {', '.join(map(repr, allowed))} or None (measured), got {form!r}")
    why = form and _failure(form)
    if why:
        raise ValueError(f"{name}={form!r} cannot run: {why}; name another form or leave {name}=None to measure")
