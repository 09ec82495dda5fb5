"""What the families' ``config.json`` files share: required keys, RoPE parameters, layer types.

Each reader takes ``c``, the ``config.json`` dict with the family's defaults filled in (as
``transformers``' config class would), and returns keyword arguments of
:class:`~selfattn.model.GPTConfig`. Anything the decoder cannot compute is a ValueError naming the
key; the family's ``config`` adds the file.
"""
from __future__ import annotations

import functools
from collections.abc import Callable

from selfattn.rope import ROPE_TYPES

LAYER_TYPES = ("full_attention", "sliding_attention")  # transformers' names of the two kinds of layer


def naming_the_file(read: Callable) -> Callable:
    """A family's ``config(hf, where)`` from its ``read(hf) -> GPTConfig``: every TypeError or
    ValueError of ``read`` (or of the decoder it describes) starts with ``where``, the file."""
    @functools.wraps(read)
    def config(hf: dict, where: str):
        try:
            return read(hf)
        except (TypeError, ValueError) as e:
            raise type(e)(f"{where}: {e}") from None
    return config


def silu(c: dict) -> None:
    """The SwiGLU MLP computes SiLU: a ValueError for another ``hidden_act``."""
    if c["hidden_act"] not in ("silu", "swish"):  # one function, two names in transformers' ACT2FN
        raise ValueError(f"hidden_act {c['hidden_act']!r} is not supported; the SwiGLU MLP computes 'silu'")


SIZES = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads")


def filled(hf: dict, defaults: dict, required: tuple[str, ...] = SIZES) -> dict:
    """``hf`` over the family's ``defaults``; a ValueError naming the ``required`` keys it lacks
    (by default the decoder's :data:`SIZES`, which no family assumes)."""
    absent = [key for key in required if hf.get(key) is None]
    if absent:
        raise ValueError(f"a {hf['model_type']} config.json needs {', '.join(absent)}")
    return {**defaults, **hf}


def windows(c: dict, slides: list[bool]) -> dict:
    """``window`` and ``window_layers`` for layers that slide where ``slides`` says, over
    ``c["sliding_window"]`` (None: no layer slides)."""
    window = c.get("sliding_window")
    if window is None or not any(slides):
        return dict(window=None)
    return dict(window=window, window_layers=None if all(slides) else list(slides))


def layer_types(c: dict, n_layer: int, default) -> list[bool]:
    """Which layers slide: ``c["layer_types"]`` when given, else ``default(i)`` per layer."""
    types = c.get("layer_types")
    if types is None:
        return [bool(default(i)) for i in range(n_layer)]
    if not isinstance(types, list) or len(types) != n_layer or any(t not in LAYER_TYPES for t in types):
        raise ValueError(f"layer_types must list {n_layer} of {', '.join(map(repr, LAYER_TYPES))}, got {types!r}")
    return [t == "sliding_attention" for t in types]


def rope(c: dict, head_dim: int, default_theta: float = 10000.0) -> dict:
    """``rope_base``, ``rope_scaling``, ``rope_dims`` and ``window_rope_base`` from ``c``'s RoPE
    parameters: ``rope_scaling`` or ``rope_parameters`` (transformers reads them in this order), one
    dict for every layer or one per layer type (Gemma 3: sliding layers have their own base)."""
    params = c.get("rope_scaling") or c.get("rope_parameters") or {}
    if not isinstance(params, dict):
        raise ValueError(f"rope_parameters must be a JSON object, got {params!r}")
    if set(params) & set(LAYER_TYPES):
        full, sliding = (_rope_rule(c, params.get(kind) or {}, head_dim, default_theta) for kind in LAYER_TYPES)
        if sliding["rope_scaling"] is not None or sliding["rope_dims"] != full["rope_dims"]:
            raise ValueError(f"the sliding layers' RoPE may differ from the others' in its base only, got "
                             f"{params['sliding_attention']!r}")
        return {**full, "window_rope_base": sliding["rope_base"]}
    return _rope_rule(c, params, head_dim, default_theta)


def _rope_rule(c: dict, p: dict, head_dim: int, default_theta: float) -> dict:
    rope_type = p.get("rope_type", p.get("type", "default"))
    if rope_type not in ROPE_TYPES:
        raise ValueError(f"rope_type {rope_type!r} is not supported; selfattn computes "
                         f"{', '.join(map(repr, ROPE_TYPES))}")
    partial = p.get("partial_rotary_factor", c.get("partial_rotary_factor")) or 1.0
    rotary = int(head_dim * partial)
    scaling = None
    if rope_type != "default":
        original = (c.get("original_max_position_embeddings") or p.get("original_max_position_embeddings")
                    or c["max_position_embeddings"])  # transformers' order: a top-level key first (Phi-3)
        keys = {"linear": ("factor",), "llama3": ("factor", "low_freq_factor", "high_freq_factor"),
                "yarn": ("factor", "attention_factor", "beta_fast", "beta_slow", "mscale", "mscale_all_dim",
                         "truncate"),
                "longrope": ("short_factor", "long_factor", "factor", "attention_factor")}[rope_type]
        scaling = {"rope_type": rope_type, **{k: p[k] for k in keys if p.get(k) is not None}}
        if rope_type != "linear":
            scaling["original_max_position_embeddings"] = original
        if rope_type in ("yarn", "longrope") and scaling.get("factor") is None:
            scaling["factor"] = c["max_position_embeddings"] / original
    return dict(rope_base=float(p.get("rope_theta", c.get("rope_theta", default_theta))), rope_scaling=scaling,
                rope_dims=None if rotary == head_dim else rotary)
