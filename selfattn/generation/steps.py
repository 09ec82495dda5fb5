"""A model's decoding forwards: what :func:`~selfattn.generation.generate` and speculative decoding call
for each step, on the model's public API (:meth:`~selfattn.model.GPT.hidden`, :meth:`~selfattn.model.GPT.logits`).

:class:`Steps` runs them as the model's modules do; :class:`KernelSteps`, the default on the CPU, runs each
decode step as one call of the C++ decode kernel over the weights as they are stored;
:class:`~selfattn.generation.compiled.CompiledDecode`, the same three calls compiled (a graph, or the kernel
over weights laid out for it), replaces them for a model given to
:func:`~selfattn.generation.compiled.compile_decode`. :func:`steps_of` says which a model has.
"""
from __future__ import annotations

import warnings
import weakref
from collections.abc import Sequence

from torch import Tensor

from selfattn.generation.kernel_step import KernelStep, unsupported
from selfattn.kv_cache import KVCache
from selfattn.model import GPT


class Steps:
    """``model``'s decoding forwards, eager. Inputs are checked by the caller (``generate``)."""
    spare = 0  # cache slots beyond those a generation fills (a compiled model's caches take one more)

    def __init__(self, model: GPT):
        self._model = weakref.ref(model)  # weakly: the model is the key these steps are kept under

    @property
    def model(self) -> GPT:
        return self._model()

    def step(self, idx: Tensor, mask: Tensor | None, cache: Sequence[KVCache], past: int) -> Tensor:
        """Logits ``(B, V)`` of the token after ``idx`` ``(B, T)``, whose ``past`` positions are cached:
        the prefill, and with T = 1 a decode step."""
        return next_logits(self.model, idx, mask, cache, past)

    def logits(self, idx: Tensor, mask: Tensor | None, cache: Sequence[KVCache], past: int) -> Tensor:
        """Logits ``(B, T, V)`` of every token of ``idx`` (a speculative verification)."""
        return self.model.logits(self.model.hidden(idx, mask, cache, past))

    def hidden(self, idx: Tensor | None, mask: Tensor | None, cache: Sequence[KVCache], past: int, *,
               start: int = 0, stop: int | None = None, x: Tensor | None = None) -> Tensor:
        """:meth:`~selfattn.model.GPT.hidden` of blocks ``start .. stop - 1``, ``(B, T, C)``."""
        return self.model.hidden(idx, mask, cache, past, start=start, stop=stop, x=x)


def next_logits(model: GPT, idx: Tensor, mask: Tensor | None, cache: Sequence[KVCache], past: int) -> Tensor:
    """Logits ``(B, V)`` of the token after ``idx``: :meth:`Steps.step`, and what a compiled step compiles."""
    return model.logits(model.hidden(idx, mask, cache, past)[:, -1])


_compiled: weakref.WeakKeyDictionary[GPT, Steps] = weakref.WeakKeyDictionary()  # model -> its compiled steps
# (a model dropped drops its steps: they hold it weakly, or the map would keep it alive forever)


class KernelSteps(Steps):
    """The eager steps, each decode step (and verification) one call of the C++ decode kernel where it serves
    it (:class:`~selfattn.generation.kernel_step.KernelStep`, ``as_stored``): a model's default decoding on the
    CPU (float32, or laid out for the kernel), nothing compiled and the model left as it is. Over float32
    ``nn.Linear`` weights the kernel's sums run in another order than PyTorch's products: the same tokens as
    eager steps but at a near-tie."""

    def __init__(self, model: GPT):
        super().__init__(model)
        self.kernel = KernelStep(model, as_stored=True)

    def step(self, idx: Tensor, mask: Tensor | None, cache: Sequence[KVCache], past: int) -> Tensor:
        if self.kernel.serves(mask, cache, idx.shape[1]):
            return self.kernel(idx, cache, past)[:, -1]
        return super().step(idx, mask, cache, past)

    def logits(self, idx: Tensor, mask: Tensor | None, cache: Sequence[KVCache], past: int) -> Tensor:
        if self.kernel.serves(mask, cache, idx.shape[1]):
            return self.kernel(idx, cache, past)
        return super().logits(idx, mask, cache, past)


def steps_of(model: GPT) -> Steps:
    """The forwards ``model`` decodes with: its compiled ones after ``compile_decode(model)``; else the
    decode kernel's where it runs the model as it is stored (:class:`KernelSteps`: on the CPU), else eager.
    Eager while ``model.tap`` is set (hooks): the kernel and graphs never call it, so that they would decode
    as if unhooked; compiled steps passed over say so in a UserWarning (once: one place warns, and Python's
    default filter shows a place's warning once)."""
    steps = _compiled.get(model)
    if model.tap is not None:
        if steps is not None:
            warnings.warn("a hooked model (model.tap set) decodes eagerly: its compiled steps (the decode kernel, "
                          "graphs) never call the tap")
        return Steps(model)
    if steps is not None:
        return steps
    return KernelSteps(model) if unsupported(model, as_stored=True) is None else Steps(model)


def set_compiled(model: GPT, steps: Steps | None) -> None:
    """Make ``steps`` ``model``'s decoding forwards (None: eager again)."""
    if steps is None:
        _compiled.pop(model, None)
    else:
        _compiled[model] = steps


def decode_cache(model: GPT, batch_size: int, fills: int, rollback: int = 0) -> list:
    """The caches of a generation whose last step caches ``fills`` positions; a compiled model's
    get a slot more, which its graphs never fill (see :mod:`selfattn.generation.compiled`)."""
    limit = model.max_positions
    spare = steps_of(model).spare if limit is not None and fills < limit else 0
    return model.new_cache(batch_size, fills + spare, rollback=rollback)
