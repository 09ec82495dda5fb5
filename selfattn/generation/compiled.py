"""Decoding compiled, :func:`compile_decode`: one graph per decode step (or one call of the C++
decode kernel), and the forwards of speculative decoding.

An eager decode step runs a model's operations one by one from Python: for SmolLM2-135M (30
layers, about 1500 operations a token) that launching took most of the step. ``torch.compile``
of the whole step (the embedding, every block, the head) makes it one graph of fused loops. It
pays at batch 1; a batch of 8 rows in bfloat16 was faster eager while graphs served it (the
timings: ``docs/benchmarks.md``, "Measurements the code cites"). The graph replaces the few-row form
``decode_layout`` chose by its own products; that those are the slower part is a guess, not yet
measured.

One graph for every step and every generation. A step's shapes change with the number of
cached positions: the position ``past``, each cache's live ``length`` and the keys it returns,
the attention mask's columns, and from one generation to the next the caches' size. Each is
declared dynamic before the first compile (``torch.compiler.config.dynamic_sources``, by the
step's argument names), so the first step compiles the graph that serves the later ones, in
place of the four the automatic rule compiled for the first two generations (a fixed ``past``,
then a fixed cache size, then the step that fills the cache, whose keys are the whole buffer).
That last one still costs a graph of its own, so ``generate`` gives a compiled model's
caches one slot more than the generation fills.

Where the decode kernel serves the model (every family's blocks) and the C++
kernels build, a step without padding is no graph at all but one call of
:mod:`selfattn.generation.kernel_step` (every operation of the step in one parallel region: none of the
guards, wrapper and per-kernel costs below); the graphs serve the rest.

Speculative decoding (:mod:`selfattn.generation.speculative`) feeds a varying number of tokens at once
through a range of blocks: all of them (a verification), the first N (self-speculation's
drafts) or the rest (its verification). :meth:`CompiledDecode.hidden` compiles ``GPT.hidden``
once per range of blocks, the number of tokens dynamic too: a graph for one token and one for
2 to 16 (``decode_layout``'s few-row products, past which a third serves).

Guards. Before each call torch.compile checks that what it compiled for still holds: for a model
it checks every module's attributes (thousands of checks for SmolLM2's 30 layers, a share of a
short step worth saving: ``docs/benchmarks.md``, "Measurements the code cites"). The graphs here
keep the checks on every tensor (the weights' dtype, shape, strides and device; a cast or
``decode_layout`` recompiles) and on the arguments, and drop those on the model's other
attributes (:func:`_guards`): a compiled model decodes as its modules were when it compiled, and
after a change of them (a backend, an option) takes ``compile_decode()`` again, which compiles
afresh.

Each model compiles its own copies (:func:`selfattn.generation._compiling.compile_own`): the graphs are
kept per code object. Compiling takes seconds for a small model and tens of seconds
for SmolLM2 (once per model, dtype and batch size in a process; torch.compile's cache on disk
shortens it in later processes), so it is opt-in.

A model with a sliding-window layer has no graphs: its rolling cache picks the slots it keeps by value,
which a graph cannot follow. The kernel serves its steps (it computes each slot); a step it does not
serve (a padded batch, more tokens than a rolling cache rolls back) runs eagerly, and where the kernel
serves none (it did not build, an int8 mixture of experts) the model is refused.
"""
from __future__ import annotations

import contextlib
import itertools
import warnings
from collections.abc import Iterator, Sequence

import torch
from torch import Tensor

from selfattn.backends import sdpa
from selfattn.generation import kernel_step
from selfattn.generation._compiling import compile_own
from selfattn.generation.layout import FEW, decode_layout, is_laid_out
from selfattn.generation.steps import Steps, next_logits, set_compiled, steps_of
from selfattn.kv_cache import KVCache
from selfattn.model import GPT

# the arguments whose sizes change with the cached positions and the tokens fed, as torch.compile names them
DYNAMIC = ",".join((r"L\['past'\]", r"L\['idx'\]:1", r"L\['x'\]:1", r"L\['mask'\]:1",
                    r"L\['cache'\]\[\d+\]\.length", r"L\['cache'\]\[\d+\]\.[kv]:2"))
_models = itertools.count()  # numbers the models' compiled functions
KEPT_ON_THE_MODEL = ("TENSOR_MATCH", "DUPLICATE_INPUT", "NO_TENSOR_ALIASING")  # the guards on its tensors


def _run(model: GPT, idx: Tensor | None, mask: Tensor | None, cache: Sequence[KVCache], past: int,
         start: int, stop: int | None, x: Tensor | None) -> Tensor:
    """The forward compiled for speculative decoding: ``GPT.hidden`` of ``model``, ``(B, T, C)``."""
    return model.hidden(idx, mask, cache, past, start=start, stop=stop, x=x)


def _guards(entries: list) -> list[bool]:
    """torch.compile's guard filter: every guard but those on the model's attributes that are not
    its tensors (see the module docstring). A guard's name is its source: ``model.…`` for the
    model argument of :func:`~selfattn.generation.steps.next_logits` and :func:`_run`."""
    return [e.guard_type in KEPT_ON_THE_MODEL or not (e.name == "model" or e.name.startswith("model."))
            for e in entries]


def _compile(fn, name: str):
    # no size asserts: inductor checks every input's and extern output's sizes and strides at each call
    # (394 checks a SmolLM2 step), which the guards on the tensors already hold
    return compile_own(fn, name, options={"guard_filter_fn": _guards, "size_asserts": False})


def graphless(model: GPT) -> str | None:
    """Why ``model``'s decoding cannot be compiled into graphs (None when it can)."""
    windowed = [i for i, block in enumerate(model.blocks) if block.attn.window is not None]
    if windowed:
        return (f"layer {windowed[0]} slides over a window of {model.blocks[windowed[0]].attn.window} keys: its "
                f"rolling cache chooses the slots it keeps by value, which a compiled graph cannot follow")
    return None


def unsupported(model: GPT) -> str | None:
    """Why ``model``'s decoding cannot be compiled at all, into graphs or the kernel's steps (None when it can)."""
    no_graphs = graphless(model)
    no_kernel = no_graphs and kernel_step.unsupported(model)
    return no_kernel and f"{no_graphs}, and the decode kernel cannot run it either ({no_kernel})"


def compile_decode(model: GPT) -> GPT:
    """Make ``model`` decode fast from now on: the one call of the fast path.

    Args:
        model: a :class:`~selfattn.model.GPT`, changed in place.

    Returns:
        ``model``, whose later :func:`~selfattn.generation.generate` calls decode fast. A ValueError
        for a model with a sliding-window layer that the kernel cannot run.

    What it sets up:

    - the weights laid out for decoding (:func:`~selfattn.generation.layout.decode_layout`, by its
      rule, unless the model was laid out or quantised already);
    - each decoded token one call of the C++ decode kernel where it serves the model
      (:mod:`selfattn.generation.kernel_step`: every family, on the CPU), else one
      ``torch.compile`` graph of the embedding, every block and the head, which serves every later
      step and generation; speculative decoding's drafts and verifications run through compiled
      graphs of their own (or the kernel). A model with a sliding-window layer has no graphs: the
      steps the kernel does not serve run eagerly (the module docstring says why).

    The first generation compiles the graphs (seconds; tens of seconds for a 135M model). The same
    tokens as eager decoding in float32; in half precision a fused graph rounds less often, so a
    near-tie may break the other way."""
    if not isinstance(model, GPT):
        raise TypeError(f"compile_decode needs a selfattn GPT, got {type(model).__name__}")
    if not is_laid_out(model):
        decode_layout(model)  # before the kernel is asked: it runs the products of the layout's rule
    why = unsupported(model)
    if why is not None:
        raise ValueError(f"compile_decode: {why}; decode this model without it")
    set_compiled(model, CompiledDecode(model))
    return model


def compiled_of(model: GPT) -> CompiledDecode | None:
    """``model``'s compiled decoding, None when it decodes eagerly."""
    steps = steps_of(model)
    return steps if isinstance(steps, CompiledDecode) else None


class CompiledDecode(Steps):
    """A model's decoding compiled: :meth:`step`, one token's next logits, :meth:`logits`, every
    token's through the whole model, and :meth:`hidden`, tokens through a range of its blocks
    (speculative decoding's drafts and verifications). ``kernel``: the decode kernel's steps where
    it serves the model, else None; ``graphs``: whether the rest compiles into graphs (else it runs
    eagerly: a model with a sliding-window layer)."""
    spare = 1  # a cache slot its graphs never fill (the module docstring says why)

    def __init__(self, model: GPT):
        super().__init__(model)
        self.number, self.runs, self.decided = next(_models), {}, set()
        self._step = _compile(next_logits, f"decode_step_{self.number}")
        self.kernel = kernel_step.KernelStep(model) if kernel_step.unsupported(model) is None else None
        self.graphs = graphless(model) is None

    def _decide(self) -> None:
        """What a graph decides by measuring, measured before it is traced for the model's dtype:
        whether a decoded token attends in float32 (:func:`selfattn.backends.sdpa.decide_compiled`)."""
        w = self.model.wte.weight
        if w.dtype not in self.decided:
            for heads in {(b.attn.n_head, b.attn.n_kv_head, b.attn.head_dim) for b in self.model.blocks}:
                sdpa.decide_compiled(w.dtype, *heads, w.device)
            self.decided.add(w.dtype)

    def _graph(self, rows: int) -> bool:
        """Whether a forward of ``rows`` tokens that the kernel does not serve runs as a graph: where the model
        has graphs, and for a model the kernel decodes, up to :data:`~selfattn.generation.layout.FEW` rows (a
        padded batch); a prompt's many rows run eagerly, their products BLAS's, bound by the multiply-adds,
        which a graph does not speed up (and a graph for them would be compiled for seconds)."""
        return self.graphs and (self.kernel is None or rows <= FEW)

    def step(self, idx: Tensor, mask: Tensor | None, cache: Sequence[KVCache], past: int) -> Tensor:
        """Logits ``(B, V)`` after ``idx`` ``(B, T)``, compiled: by the decode kernel where it serves the
        model and the step (:mod:`selfattn.generation.kernel_step`), else a graph (or eagerly)."""
        if self.kernel is not None and self.kernel.serves(mask, cache, idx.shape[1]):
            return self.kernel(idx, cache, past)[:, -1]
        if not self._graph(idx.numel()):
            return super().step(idx, mask, cache, past)
        self._decide()
        with _compiling():
            return self._step(self.model, idx, mask, cache, past)

    def logits(self, idx: Tensor, mask: Tensor | None, cache: Sequence[KVCache], past: int) -> Tensor:
        """Logits ``(B, T, V)`` of every token of ``idx`` ``(B, T)`` through the whole model (a speculative
        verification): by the decode kernel where it serves, else :meth:`hidden`'s graph and the head."""
        if self.kernel is not None and self.kernel.serves(mask, cache, idx.shape[1]):
            return self.kernel(idx, cache, past)
        return self.model.logits(self.hidden(idx, mask, cache, past))

    def hidden(self, idx: Tensor | None, mask: Tensor | None, cache: Sequence[KVCache], past: int, *,
               start: int = 0, stop: int | None = None, x: Tensor | None = None) -> Tensor:
        """``GPT.hidden`` of blocks ``start .. stop - 1``, ``(B, T, C)``, compiled: one function
        per range of blocks, so that each has torch.compile's recompile limit to itself (eager without graphs)."""
        if not self._graph((idx if x is None else x).shape[:2].numel()):
            return super().hidden(idx, mask, cache, past, start=start, stop=stop, x=x)
        run = self.runs.get((start, stop))
        if run is None:
            run = self.runs[start, stop] = _compile(_run, f"decode_run_{self.number}_{start}_{stop}")
        self._decide()
        with _compiling():
            return run(self.model, idx, mask, cache, past, start, stop, x)


@contextlib.contextmanager
def _compiling() -> Iterator[None]:
    """Where a compiled function is called: the sizes of :data:`DYNAMIC` declared dynamic."""
    with torch.compiler.config.patch(dynamic_sources=DYNAMIC), warnings.catch_warnings():
        # RoPE's frequency tables are cached per rule eagerly; traced, they are a few ops of the graph
        warnings.filterwarnings("ignore", message="Dynamo detected a call to a `functools.lru_cache`")
        yield
