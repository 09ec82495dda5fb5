"""How a model's weights are stored and multiplied for decoding (:func:`decode_layout`).

A decode step multiplies one row (batch 1) or a few (a batch, a speculative verification) by
every weight matrix once, so it runs at the speed the matrices stream through a product kernel
for a few rows. That depends on the dtype, the order the matrix is stored in, the form of the
call and the machine (the forms timed on two machines: ``docs/benchmarks.md``, "The product forms
of decoding"). The forms (:data:`PRODUCTS`):

- ``mv``, ``linear``: ``torch.mv`` and ``F.linear``, PyTorch's BLAS kernels;
- ``wxt``: ``torch.mm(weight, rows.T).T``, the same product with the matrix as the first operand,
  which sends bfloat16 to another kernel;
- ``matvec``: :mod:`selfattn.kernels.matvec`'s C++ kernel, built on first use for this CPU's vectors:
  one pass over the matrix rows for all the input rows, each entry widened to float32 as it streams
  past. The C++ decode kernel (:mod:`selfattn.generation.kernel_step`) runs its products.

Every ``nn.Linear`` becomes a :class:`RowLinear`, which multiplies one row and up to :data:`FEW`
rows by the chosen forms and more (a prompt) by ``F.linear`` (:func:`many_rows`: in float32 for half
precision where the device does not multiply it natively, as the tiled backend does). The choice is a rule
(:func:`rule`: ``matvec`` wherever it builds, the form that led the timings and that the decode
kernel serves), never a race: a measurement on a busy machine may pick another form each load,
and with it take the decode kernel away. ``decode_layout(model, measure=True)`` times the forms on
the model's own matrices instead, for one row and :data:`MEASURED_ROWS` rows.

Storage order. The BLAS forms read float32 matrices fastest in the (in, out) order (GPT-2's Conv1D)
and half-precision ones in (out, in) rows; ``matvec`` reads rows. Every matrix of a dtype (embeddings
too: a tied head is one) is stored in the order of its one-row form, and a mixture's experts in rows
(the decode kernel's). Values, shapes and ``state_dict`` are unchanged; the forms round alike up to the
order of their sums.
"""
from __future__ import annotations

import functools
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from selfattn._util import timing as _timing
from selfattn.kernels import matvec
from selfattn.kernels.features import multiplies_natively
from selfattn.model import MoE

HALF = (torch.bfloat16, torch.float16)
FEW = 16  # up to this many rows a RowLinear takes its few-row form; more rows F.linear
MEASURED_ROWS = 8  # the few-row forms are timed at this many rows


def _matvec(w: Tensor, rows: Tensor) -> Tensor:
    """The ``matvec`` form: :mod:`selfattn.kernels.matvec` for the CPU and its dtypes, ``F.linear``
    for the rest (a model cast to float64 or moved after its layout)."""
    if w.device.type == "cpu" and w.dtype in matvec.MATRIX_DTYPES and rows.dtype in matvec.ROW_DTYPES:
        return matvec.rows(w, rows)
    return F.linear(rows, w)


# a product form: (weight (out, in), rows (N, in)) -> (N, out)
PRODUCTS: dict[str, Callable[[Tensor, Tensor], Tensor]] = {
    "mv": lambda w, rows: torch.mv(w, rows[0])[None],  # one row only
    "linear": lambda w, rows: F.linear(rows, w),
    "wxt": lambda w, rows: torch.mm(w, rows.t()).t().contiguous(),  # W·xᵀ (out, N), transposed back
    "matvec": _matvec,
}
ONE_ROW_FORMS = ("mv", "linear", "wxt", "matvec")
FEW_ROW_FORMS = ("linear", "wxt", "matvec")  # the forms that take several rows


def stored_in_rows(form: str, dtype: torch.dtype) -> bool:
    """Whether ``form`` reads a matrix of ``dtype`` fastest in (out, in) rows, else in (in, out)."""
    return form == "matvec" or dtype in HALF


class RowLinear(nn.Linear):
    """An ``nn.Linear`` that multiplies one row by the form ``one_row`` and 2..:data:`FEW` rows
    by ``few_rows`` (names of :data:`PRODUCTS`, set by :func:`decode_layout`), more by :func:`many_rows`."""
    one_row, few_rows = "mv", "linear"

    def forward(self, x: Tensor) -> Tensor:
        n = x.numel() // self.in_features if self.in_features else 0  # rows, B·T
        if not 0 < n <= FEW:
            return many_rows(x, self.weight, self.bias)
        y = PRODUCTS[self.one_row if n == 1 else self.few_rows](self.weight, x.reshape(n, self.in_features))
        if self.bias is not None:
            y = y + self.bias
        return y.view(*x.shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, one_row={self.one_row!r}, few_rows={self.few_rows!r}"


def many_rows(x: Tensor, w: Tensor, bias: Tensor | None = None) -> Tensor:
    """``F.linear(x, w, bias)`` for many rows (a prompt), compute-bound: in half precision where the device
    multiplies it natively (:func:`~selfattn.kernels.features.multiplies_natively`), else widened to float32
    and the result rounded back once (an emulated half-precision matmul is many times slower than float32's:
    ``docs/benchmarks.md``, "Decode against llama.cpp"); each product of two half values is exact in float32,
    so the two differ only in the order of their sums."""
    if x.dtype not in HALF or multiplies_natively(x.device, x.dtype):
        return F.linear(x, w, bias)
    return F.linear(x.float(), w.float(), None if bias is None else bias.float()).to(x.dtype)


def rule(dtype: torch.dtype, device: torch.device) -> str:
    """The one-row form :func:`decode_layout` takes unless told or asked to measure: ``matvec`` on the
    CPU wherever its kernel builds for ``dtype`` (it is the form the C++ decode kernel serves, and it
    led every float32 and bfloat16 row of the timings in ``docs/benchmarks.md``), else ``torch.mv``.
    A few rows take ``matvec`` too where the matrices are stored in its rows, else ``F.linear``."""
    if device.type == "cpu" and dtype in matvec.MATRIX_DTYPES and matvec.failure() is None:
        return "matvec"
    return "mv"


def decode_layout(model: nn.Module, *, one_row: str | None = None, few_rows: str | None = None,
                  measure: bool = False) -> nn.Module:
    """Store and multiply ``model``'s weights as decoding reads them fastest (see the module
    docstring), in place; returns the model. ``one_row`` and ``few_rows`` name the forms of
    :data:`PRODUCTS` to use; None takes :func:`rule`'s, or with ``measure=True`` times the forms here
    on the model's own matrices (on the CPU, per dtype: seconds for a 135M-parameter model; the result
    depends on what else the machine runs, so it is never the default). Idempotent. Meant for
    inference: the (in, out) order slows the token-embedding lookups of training. Call it again after
    casting the model to another dtype (``.to()`` keeps each matrix's order)."""
    _check_form("one_row", one_row, ONE_ROW_FORMS)
    _check_form("few_rows", few_rows, FEW_ROW_FORMS)
    groups: dict[tuple, list[nn.Module]] = {}  # (dtype, device) -> its matrices' modules
    for module in model.modules():
        if type(module) is nn.Linear:
            module.__class__ = RowLinear  # the same parameters and state_dict, another forward
        if isinstance(module, (nn.Linear, nn.Embedding)):
            groups.setdefault((module.weight.dtype, module.weight.device), []).append(module)
    with torch.inference_mode():
        for (dtype, device), modules in groups.items():
            linears = [m for m in modules if isinstance(m, RowLinear)]
            if not linears:  # embeddings alone in their dtype: stored as mv reads them, nothing to measure
                _store(modules, in_rows=stored_in_rows("mv", dtype))
                continue
            by_rule = rule(dtype, device)
            chosen = one_row or (fastest_one_row(modules, linears) if measure else by_rule)
            _store(modules, in_rows=stored_in_rows(chosen, dtype))
            candidates = few_row_candidates(chosen, dtype)  # matvec among them where it reads these rows
            few = few_rows or (fastest(linears, MEASURED_ROWS, candidates) if measure
                               else "matvec" if by_rule == "matvec" and "matvec" in candidates else "linear")
            for module in linears:
                module.one_row, module.few_rows = chosen, few
        for module in model.modules():
            if isinstance(module, MoE):
                _store_experts(module)
    return model


def is_laid_out(model: nn.Module) -> bool:
    """Whether every matrix of ``model`` is laid out for decoding (:func:`decode_layout`) or
    quantised (no plain ``nn.Linear`` left)."""
    return not any(type(m) is nn.Linear for m in model.modules())


def fastest_one_row(modules: list[nn.Module], linears: list[nn.Linear]) -> str:
    """The one-row form that multiplies every matrix of ``linears`` fastest, each form timed with
    the matrices (all of ``modules``, one dtype and device) stored in its order: the forms that
    read one order timed together (:func:`timings`), then all compared. ``matvec`` is a candidate
    where its kernel builds. Off the CPU, ``"mv"``."""
    w = linears[0].weight
    if w.device.type != "cpu":
        return "mv"
    forms = ["mv", "linear", "wxt"]
    if matvec.failure() is None:
        forms.append("matvec")
    median = {}  # form -> seconds
    for in_rows in (False, True):
        read_so = tuple(form for form in forms if stored_in_rows(form, w.dtype) == in_rows)
        if read_so:
            _store(modules, in_rows=in_rows)
            median |= timings(linears, 1, read_so)
    return min(median, key=median.get)


def few_row_candidates(one_row: str, dtype: torch.dtype) -> tuple[str, ...]:
    """The few-row forms measured where ``one_row`` takes one row: the BLAS forms, and ``matvec``
    where the matrices are stored in rows (which it reads) and its kernel builds."""
    in_rows = stored_in_rows(one_row, dtype) and matvec.failure() is None
    return ("linear", "wxt") + (("matvec",) if in_rows else ())


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
    g = torch.Generator().manual_seed(0)  # the global generator stays the caller's
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


def _store_experts(moe: MoE) -> None:
    """A mixture's experts, ``(E, in, out)`` as gpt-oss ships them, stored in (out, in) rows (strides
    ``(in·out, 1, in)``), as the decode kernel streams them; values and shapes unchanged, copied only once."""
    with torch.inference_mode(False):
        for p in (moe.gate_up_proj, moe.down_proj):
            p.data = p.data.transpose(1, 2).contiguous().transpose(1, 2)


def _failure(form: str) -> str | None:
    """Why ``form`` cannot run here (None when it can)."""
    if form == "matvec":
        why = matvec.failure()
        return why and f"its kernel did not build here ({why})"
    return None


def _check_form(name: str, form, allowed: tuple[str, ...]) -> None:
    if form is not None and form not in allowed:
        raise ValueError(f"{name} must be one of {', '.join(map(repr, allowed))} or None (measured), got {form!r}")
    why = form and _failure(form)
    if why:
        raise ValueError(f"{name}={form!r} cannot run: {why}; name another form or leave {name}=None to measure")
