"""What a family declares about GGUF files: llama.cpp's names for its architectures, config fields and
tensors, and the fixes llama.cpp's converter makes to the values. Read by :mod:`selfattn.formats.gguf`.

A family module that llama.cpp has an architecture for holds ``GGUF = Names(...)``:

- ``architectures``: ``general.architecture`` -> the ``model_type`` of ``config.json`` it is;
- ``fields``: ``config.json`` key -> (the GGUF field after ``"<architecture>."``, its kind, its default;
  :data:`REQUIRED` when the file must have it), :data:`FIELDS` and the family's own;
- ``in_block`` / ``outside``: llama.cpp's tensor names inside ``blk.N`` and outside the blocks ->
  ``transformers``' names (inside ``layer``, the folder's prefix of layer i). An ``in_block`` key is a
  module (``"attn_q"``: its ``.weight`` and ``.bias`` keep their suffix) or a whole tensor
  (``"attn_sinks.weight"`` -> ``"self_attn.sinks"``);
- ``norm_offset``: what the converter adds to every norm weight (Gemma's ``1 + w`` stored as ``1 + w``),
  taken off when a file is read;
- ``interleaved``: the architectures whose q/k rows the converter interleaves for llama.cpp's RoPE
  (Llama's, not Qwen2's), put back in ``transformers``' order when read;
- ``by_head``: the ``in_block`` modules whose rows the converter regroups from per head (``(H, 3, D)``:
  BLOOM's fused q, k, v) to q, k, v apart (``(3, H, D)``), put back per head when read;
- ``transposed``: the whole ``in_block`` tensors stored with their last two dimensions swapped
  (gpt-oss's experts, ``x @ W`` in ``transformers``), swapped back when read;
- ``alternated``: ``transformers``' tensor (in the layer) -> the two ``in_block`` tensors the converter
  splits it into, taking its even and odd entries along the last dimension (gpt-oss's gate and up
  projections), read back alternated (after ``transposed``);
- ``fixed``: ``config.json`` key -> the value llama.cpp's architecture computes whatever the file says
  (GPT-2's GELU, its tanh approximation; Phi-3's sliding window, none; gpt-oss's experts' clamp, 7), filled in
  when a file is read; the writer refuses a model that computes another;
- ``derive(arch, value, config)``: the config fields llama.cpp derives by its own rules rather than reads
  (Gemma 3's sliding pattern, say), filled into ``config``; ``value(key, kind, default)`` reads a field;
  a field it refuses is a :class:`FieldError`.

What every architecture reads alike is read here for all: the RoPE of the file (:func:`rope`: the base,
the rotated channels, the scaling rule and the tensors of per-frequency factors, :data:`ROPE_TENSORS`)
and the sliding layers (:func:`sliding`, for the families whose llama.cpp architecture has them).
"""
from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field

REQUIRED = object()  # a field the file must have


class FieldError(ValueError):
    """A field that says what the decoder (or llama.cpp) does not compute; the message starts with the field's
    name after ``"<architecture>."``, the reader puts the file's path and the architecture before it."""

# config.json key -> (the GGUF field after "<architecture>.", its kind, default): what every family reads
FIELDS = {
    "hidden_size": ("embedding_length", int, REQUIRED),
    "num_hidden_layers": ("block_count", int, REQUIRED),
    "num_attention_heads": ("attention.head_count", int, REQUIRED),
    "num_key_value_heads": ("attention.head_count_kv", int, None),  # None: one per query head
    "intermediate_size": ("feed_forward_length", int, REQUIRED),
    "max_position_embeddings": ("context_length", int, REQUIRED),
    "head_dim": ("attention.key_length", int, None),  # None: hidden_size / heads
}
RMS_FIELDS = {**FIELDS, "rms_norm_eps": ("attention.layer_norm_rms_epsilon", float, REQUIRED),
              "rope_theta": ("rope.freq_base", float, 10000.0)}
LAYER_NORM_FIELDS = {**FIELDS, "layer_norm_epsilon": ("attention.layer_norm_epsilon", float, REQUIRED)}
OUTSIDE = {"token_embd.weight": "model.embed_tokens.weight", "output_norm.weight": "model.norm.weight",
           "output.weight": "lm_head.weight"}
IN_BLOCK = {"attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm", "attn_q": "self_attn.q_proj",
            "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj", "attn_output": "self_attn.o_proj",
            "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj"}
# the tensors outside the blocks that hold RoPE factors, one per rotated frequency (read into the config, not
# weights): Llama 3's (the converter works them out of its rule), LongRoPE's long and short ones (Phi-3's)
ROPE_TENSORS = ("rope_freqs.weight", "rope_factors_long.weight", "rope_factors_short.weight")


@dataclass(frozen=True)
class Names:
    """A family's GGUF names and fixes (see the module docstring)."""
    architectures: dict[str, str]
    fields: dict[str, tuple[str, type, object]] = field(default_factory=lambda: RMS_FIELDS)
    in_block: dict[str, str] = field(default_factory=lambda: IN_BLOCK)
    outside: dict[str, str] = field(default_factory=lambda: OUTSIDE)
    layer: str = "model.layers.{i}."
    norm_offset: float = 0.0
    interleaved: frozenset[str] = frozenset()
    by_head: frozenset[str] = frozenset()
    transposed: frozenset[str] = frozenset()
    alternated: dict[str, tuple[str, str]] = field(default_factory=dict)
    fixed: dict[str, object] = field(default_factory=dict)
    derive: Callable[[str, Callable, dict], None] | None = None

    def hf_name(self, name: str) -> str:
        """``transformers``' name of llama.cpp's tensor ``name`` (for one of two ``alternated`` halves, the
        tensor it is half of); a name not mapped stays as it is (and is refused by the family's mapping
        as a tensor it does not expect)."""
        if name in self.outside:
            return self.outside[name]
        block, _, rest = name.partition(".")
        i, _, rest = rest.partition(".")
        if block != "blk" or not i.isdigit():
            return name
        module, _, param = rest.rpartition(".")
        whole = next((whole for whole, halves in self.alternated.items() if rest in halves), None)
        if whole is not None:
            return self.layer.format(i=i) + whole
        if rest in self.in_block:
            return self.layer.format(i=i) + self.in_block[rest]
        if module in self.in_block:
            return f"{self.layer.format(i=i)}{self.in_block[module]}.{param}"
        return name

    def half(self, name: str) -> int | None:
        """Which of its ``alternated`` tensor's halves llama.cpp's tensor ``name`` is (0: the even
        entries), or None when it is none."""
        rest = name.split(".", 2)[-1]
        return next((halves.index(rest) for halves in self.alternated.values() if rest in halves), None)


def rope(value: Callable, factors: Callable, c: dict, head_dim: int) -> None:
    """``c["rope_parameters"]``, ``transformers``' RoPE rule, as llama.cpp reads the file's RoPE (its
    ``llama_model::load_hparams``, ``llama_context``'s YaRN factors and ``get_rope_factors``):

    - ``rope.freq_base`` (already ``c["rope_theta"]``); ``rope.dimension_count`` channels of a head
      rotated (the others pass: ``partial_rotary_factor``);
    - per-frequency factors, a tensor of :data:`ROPE_TENSORS`: Llama 3's ``rope_freqs`` divide every
      frequency, read as a ``longrope`` rule of the same factors short and long and no attention factor;
      LongRoPE's long and short ones with ``rope.scaling.original_context_length`` (llama.cpp takes the
      long ones when its context is longer, ``transformers`` when the sequence is) and
      ``rope.scaling.attn_factor`` (default 1) on cos and sin;
    - else ``rope.scaling.type`` (llama.cpp's default: linear) and ``rope.scaling.factor`` (0 or none: 1):
      ``linear`` divides every frequency; ``yarn`` is YaRN over ``rope.scaling.original_context_length``
      with llama.cpp's constants (the ramp between 32 and 1 turns over the original context, its ends
      rounded outward, ``truncate``; the attention factor 0.1 ln(factor) + 1, times ``rope.scaling.attn_factor``):
      the file's ``rope.scaling.yarn_*`` fields are not read, as llama.cpp reads none of them for these
      architectures.

    ``value(field, kind, default)`` reads ``<arch>.<field>``; ``factors(name)`` a tensor's values (None
    when the file has none). A rule llama.cpp does not compute, or two at once, is a :class:`FieldError`."""
    rotated = value("rope.dimension_count", int, head_dim)
    if rotated > head_dim or rotated % 2:
        raise FieldError(f"rope.dimension_count {rotated} is not an even number of channels of a head of {head_dim}")
    kind = value("rope.scaling.type", str, "linear")
    factor = value("rope.scaling.factor", float, 0.0) or value("rope.scale_linear", float, 0.0) or 1.0
    if kind == "none":
        factor = 1.0
    per_freq, long, short = (factors(name) for name in ROPE_TENSORS)
    original = value("rope.scaling.original_context_length", int, c["max_position_embeddings"])
    attn_factor = value("rope.scaling.attn_factor", float, 1.0)
    p = {"rope_type": "default"}
    if per_freq is not None or long is not None or short is not None:
        if factor != 1.0 or kind not in ("none", "linear", "longrope") or (long is None) != (short is None) \
                or (per_freq is not None and long is not None):
            held = ", ".join(n for n, f in zip(ROPE_TENSORS, (per_freq, long, short)) if f is not None)
            raise FieldError(f"rope.scaling.type {kind!r} (factor {factor:g}) with the tensors {held} is not "
                             f"supported: rope_freqs alone, or rope_factors_long and _short together, unscaled")
        if per_freq is not None:
            long, short, attn_factor = per_freq, per_freq, 1.0
        p = {"rope_type": "longrope", "short_factor": short, "long_factor": long, "attention_factor": attn_factor,
             "original_max_position_embeddings": original}
    elif kind == "yarn":
        mscale = 0.1 * math.log(factor) + 1.0 if factor > 1.0 else 1.0
        p = {"rope_type": "yarn", "factor": factor, "original_max_position_embeddings": original,
             "attention_factor": mscale * attn_factor}
    elif kind == "linear" and factor != 1.0:
        p = {"rope_type": "linear", "factor": factor}
    elif kind not in ("none", "linear"):
        raise FieldError(f"rope.scaling.type {kind!r} is not supported (llama.cpp's none, linear, yarn, and longrope "
                         f"with its factors tensors)")
    if rotated != head_dim:
        p["partial_rotary_factor"] = rotated / head_dim
    c["rope_parameters"] = {**p, "rope_theta": c["rope_theta"]}


def sliding(value: Callable, c: dict, pattern: int, window: int | None) -> None:
    """``c["layer_types"]`` and ``c["sliding_window"]`` as llama.cpp's ``load_swa_pattern`` reads them: the
    window ``attention.sliding_window`` (``window`` when absent; 0 or none: no layer slides), the layers
    that slide ``attention.sliding_window_pattern``, one flag a layer or a number n (every n-th layer is
    global, the others slide; 0: all slide), ``pattern`` when absent."""
    window = value("attention.sliding_window", int, window)
    n, every = c["num_hidden_layers"], value("attention.sliding_window_pattern", None, pattern)
    if isinstance(every, list):  # one flag per layer
        slides = [bool(s) for s in every]
        if len(slides) != n:
            raise FieldError(f"attention.sliding_window_pattern has {len(slides)} entries for {n} layers")
    elif isinstance(every, int) and not isinstance(every, bool) and every >= 0:
        slides = [every == 0 or i % every < every - 1 for i in range(n)]
    else:
        raise FieldError(f"attention.sliding_window_pattern is {every!r}, expected a count or a flag per layer")
    slides = [s and bool(window) for s in slides]
    c["layer_types"] = ["sliding_attention" if s else "full_attention" for s in slides]
    c["sliding_window"] = window or c["max_position_embeddings"]
