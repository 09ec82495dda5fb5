"""What the families' ``config.json`` files share: required keys, RoPE parameters, layer types.

Each reader takes ``c``, the ``config.json`` dict with the family's defaults filled in (as
``transformers``' config class would), and returns keyword arguments of
:class:`~selfattn.model.GPTConfig`. Anything the decoder cannot compute is a ValueError naming the
key; the family's ``config`` adds the file.
"""
from __future__ import annotations

import functools
from collections.abc import Callable

from selfattn._util import validate as _validate
from selfattn.rope import ROPE_TYPES, check_scaling

LAYER_TYPES = ("full_attention", "sliding_attention")  # transformers' names of the two kinds of layer


def naming_the_file(read: Callable) -> Callable:
    """A family's ``config(hf, where, blocks=None)`` from its ``read(hf, blocks) -> GPTConfig``: every
    TypeError or ValueError of ``read`` (or of the decoder it describes) starts with ``where``, the file.
    ``blocks``: how many layers the weights hold, when known (see :func:`layers`)."""
    @functools.wraps(read)
    def config(hf: dict, where: str, blocks: int | None = None):
        try:
            return read(hf, blocks)
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
    (by default the decoder's :data:`SIZES`, which no family assumes), a TypeError or ValueError
    naming one that is not a positive int."""
    absent = [key for key in required if hf.get(key) is None]
    if absent:
        raise ValueError(f"a {hf['model_type']} config.json needs {', '.join(absent)}")
    for key in required:
        _validate.positive_int(key, hf[key])
    return {**defaults, **hf}


def layers(c: dict, blocks: int | None, key: str = "num_hidden_layers") -> int:
    """The number of layers, ``c[key]``, checked before anything is built per layer: a positive int,
    and no more than the ``blocks`` the weights hold (None: not known here). Fewer leaves tensors
    over, which the loader refuses naming them."""
    n_layer = _validate.positive_int(key, c[key])
    if blocks is not None and n_layer > blocks:
        raise ValueError(f"{key} is {n_layer}, but the weights hold {blocks} layer{'s' * (blocks != 1)}")
    return n_layer


def heads(c: dict, head_dim: int | None, n_head: str = "num_attention_heads") -> tuple[int, int, int]:
    """(H, Hkv, D): ``c[n_head]`` query heads, ``num_key_value_heads`` key/value heads (absent or
    null: H) and ``head_dim`` (None: hidden_size / H), each checked under its ``config.json`` name."""
    H, C = _validate.positive_int(n_head, c[n_head]), c["hidden_size"]
    kv = c.get("num_key_value_heads")
    Hkv = H if kv is None else _validate.positive_int("num_key_value_heads", kv)
    if head_dim is None and C % H:
        raise ValueError(f"hidden_size {C} is not divisible by {n_head} {H}")
    if H % Hkv:
        raise ValueError(f"{n_head} {H} is not a multiple of num_key_value_heads {Hkv}")
    return H, Hkv, C // H if head_dim is None else _validate.positive_int("head_dim", head_dim)


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
    key = "rope_scaling" if c.get("rope_scaling") else "rope_parameters"
    params = c.get(key) or {}
    if not isinstance(params, dict):
        raise ValueError(f"{key} must be a JSON object, got {params!r}")
    if set(params) & set(LAYER_TYPES):
        full, sliding = (_rope_rule(c, params.get(kind) or {}, head_dim, default_theta, f"{key}.{kind}")
                         for kind in LAYER_TYPES)
        if sliding["rope_scaling"] is not None or sliding["rope_dims"] != full["rope_dims"]:
            raise ValueError(f"the sliding layers' RoPE may differ from the others' in its base only, got "
                             f"{params['sliding_attention']!r}")
        return {**full, "window_rope_base": sliding["rope_base"]}
    return _rope_rule(c, params, head_dim, default_theta, key)


_UNSCALED = {"rope_theta", "partial_rotary_factor"}  # what a rule without a rope_type may say


def _rope_rule(c: dict, p: dict, head_dim: int, default_theta: float, name: str) -> dict:
    """The RoPE of one rule ``p``, the dict ``c[name]`` (``name`` is named in every error)."""
    rope_type = p.get("rope_type", p.get("type"))
    if rope_type is None and set(p) - _UNSCALED:  # {"factor": 2}: which rule it scales by is not said
        raise ValueError(f"{name} has {', '.join(sorted(set(p) - _UNSCALED))} but no rope_type (or type): "
                         f"one of {', '.join(map(repr, ROPE_TYPES))}")
    rope_type = rope_type or "default"
    if rope_type not in ROPE_TYPES:
        raise ValueError(f"rope_type {rope_type!r} is not supported; selfattn computes "
                         f"{', '.join(map(repr, ROPE_TYPES))}")
    partial = p.get("partial_rotary_factor", c.get("partial_rotary_factor"))
    if partial is not None and _validate.positive_number("partial_rotary_factor", partial) > 1:
        raise ValueError(f"partial_rotary_factor must be in (0, 1], got {partial!r}")
    rotary = int(head_dim * (partial or 1.0))
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
            scaling["factor"] = (_validate.positive_int("max_position_embeddings", c["max_position_embeddings"])
                                 / _validate.positive_number("original_max_position_embeddings", original))
        check_scaling(scaling, rotary, name)
    theta = p.get("rope_theta", c.get("rope_theta", default_theta))
    return dict(rope_base=_validate.positive_number("rope_theta", theta, above=1.0), rope_scaling=scaling,
                rope_dims=None if rotary == head_dim else rotary)
