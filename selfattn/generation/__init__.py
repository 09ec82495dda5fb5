"""Generation, above the model and on its public API (``hidden``, ``logits``, ``new_cache``, the checks).

    from selfattn.generation import compile_decode, generate
    for tok in generate(model, idx, 64, temperature=0): ...   # on the CPU each step one call of the C++ kernel
    compile_decode(model)                      # weights laid out: the kernel's steps to the bit, graphs elsewhere

- :mod:`~selfattn.generation.generate`: prefill, step, stopping; :mod:`~selfattn.generation.sampling`
  (temperature, top-k, top-p); :mod:`~selfattn.generation.text` (text as it comes);
- :mod:`~selfattn.generation.speculative`: lossless speculative decoding (prompt lookup, early
  exit, a draft model);
- :mod:`~selfattn.generation.steps` (a model's decoding forwards: eager, or the C++ kernel's as the weights
  are stored, the CPU's default), :mod:`~selfattn.generation.compiled`
  (the same compiled: a graph, or :mod:`~selfattn.generation.kernel_step`, one call of the C++ decode
  kernel); :mod:`~selfattn.generation.layout` (how the weights are stored and multiplied for
  decoding) and :mod:`~selfattn.generation.int8` (weight-only int8).
"""
from selfattn.generation.compiled import compile_decode
from selfattn.generation.generate import generate
from selfattn.generation.int8 import quantize_int8
from selfattn.generation.layout import decode_layout
from selfattn.generation.speculative import SpeculationStats, Speculative

__all__ = ["generate", "compile_decode", "decode_layout", "quantize_int8", "Speculative", "SpeculationStats"]
