"""One decode step compiled whole, for :meth:`GPT.compile_decode`.

An eager decode step runs a model's operations one by one from Python: for SmolLM2-135M (30
layers, about 1500 operations a token) that launching took most of the step. On a 2-core AMD
EPYC, batch 1, prompt 16, float32: 44 ms a token eager, of which the weight products took
about 20; with the step compiled 19 ms (bfloat16: 14). ``torch.compile`` of the whole step
(the embedding, every block, the head) makes it one graph of fused loops. It pays at batch 1;
a batch of 8 rows in bfloat16 was faster eager there (``docs/benchmarks.md``: SmolLM2 79.9
against 52.5 tok/s). The graph replaces the BLAS form ``decode_layout`` measured for 8 rows by
its own products; that those are the slower part is a guess, not yet measured.

One graph for every step and every generation. A step's shapes change with the number of
cached positions: the position ``past``, each cache's live ``length`` and the keys it returns,
the attention mask's columns, and from one generation to the next the caches' size. Each is
declared dynamic before the first compile (``torch.compiler.config.dynamic_sources``, by the
step's argument names), so the first step compiles the graph that serves the later ones, in
place of the four the automatic rule compiled for the first two generations (a fixed ``past``,
then a fixed cache size, then the step that fills the cache, whose keys are the whole buffer).
That last one still costs a graph of its own, so :meth:`GPT.generate` gives a compiled model's
caches one slot more than the generation fills.

Each model compiles its own copy of the step (:func:`selfattn._compiling.compile_own`): the
graphs are kept per code object. Compiling takes seconds for a small model and tens of seconds
for SmolLM2 (once per model, dtype and batch size in a process; torch.compile's cache on disk
shortens it in later processes), so it is opt-in. A model with a sliding-window layer is refused:
its rolling cache picks the slots it keeps by value, which the graph cannot follow.
"""
from __future__ import annotations

import itertools
import warnings
from collections.abc import Callable, Sequence

import torch
from torch import Tensor, nn

from selfattn._compiling import compile_own
from selfattn.kv_cache import KVCache

# the step's arguments whose sizes change with the cached positions, as torch.compile names them
DYNAMIC = ",".join((r"L\['past'\]", r"L\['mask'\]:1", r"L\['cache'\]\[\d+\]\.length", r"L\['cache'\]\[\d+\]\.[kv]:2"))
_models = itertools.count()  # numbers the models' compiled steps


def _step(model: nn.Module, idx: Tensor, mask: Tensor | None, cache: Sequence[KVCache], past: int) -> Tensor:
    """The function compiled: logits ``(B, V)``, ``GPT._next_logits`` of ``model`` (a GPT: this
    module is imported by the model's, so it names the class only here)."""
    return model._next_logits(idx, mask, cache, past)


def unsupported(model: nn.Module) -> str | None:
    """Why ``model``'s decoding cannot be compiled (None when it can)."""
    windowed = [i for i, block in enumerate(model.blocks) if block.attn.window is not None]
    if windowed:
        return (f"layer {windowed[0]} slides over a window of {model.blocks[windowed[0]].attn.window} keys: its "
                f"rolling cache chooses the slots it keeps by value, which a compiled graph cannot follow")
    return None


def compiled(model: nn.Module) -> Callable[[Tensor, Tensor | None, Sequence[KVCache], int], Tensor]:
    """``step(idx, mask, cache, past) -> logits (B, V)``: :func:`_step` compiled for ``model``."""
    why = unsupported(model)
    if why is not None:
        raise ValueError(f"compile_decode: {why}; decode this model without it")
    fn = compile_own(_step, f"decode_step_{next(_models)}")

    def step(idx: Tensor, mask: Tensor | None, cache: Sequence[KVCache], past: int) -> Tensor:
        with torch.compiler.config.patch(dynamic_sources=DYNAMIC), warnings.catch_warnings():
            # RoPE's frequency tables are cached per rule eagerly; traced, they are a few ops of the graph
            warnings.filterwarnings("ignore", message="Dynamo detected a call to a `functools.lru_cache`")
            return fn(model, idx, mask, cache, past)

    return step
