"""Rotary position embeddings (RoPE): rotate q and k by their absolute position.

Channel pairs (d, d + R/2) of the first R = ``rotary_dim`` channels of a head are rotated by the
angle ``pos * inv_freq[d]`` (the "rotate half" layout of GPT-NeoX and Llama); the channels past R
pass unchanged (partial rotary, Phi-3's ``partial_rotary_factor``). The score between a query at
position m and a key at position n then depends on m - n only, so a cache or an offset changes
nothing.

``inv_freq[d] = base ** (-2d / R)``, changed by a ``scaling`` rule: a dict in ``transformers``'
form (``rope_type`` and its parameters), for the context-extension schemes real models ship:

- ``"default"``: none;
- ``"linear"``: every frequency divided by ``factor``;
- ``"llama3"``: low frequencies divided by ``factor``, high ones kept, a smooth ramp between
  (``low_freq_factor``, ``high_freq_factor``, ``original_max_position_embeddings``);
- ``"yarn"``: NTK-by-parts between interpolation and extrapolation (``beta_fast``,
  ``beta_slow``, ``truncate``), and cos, sin multiplied by an attention factor
  (``attention_factor``, else from ``factor``, ``mscale``, ``mscale_all_dim``);
- ``"longrope"``: per-frequency factors, ``short_factor`` while the sequence (the largest
  position + 1 of the call, as ``transformers`` decides it) fits ``original_max_position_embeddings``,
  ``long_factor`` beyond, and an attention factor ``sqrt(1 + ln(factor) / ln(original))``.
"""
from __future__ import annotations

import functools
import math

import torch
from torch import Tensor

from selfattn._util import validate as _validate

# rope_type -> the parameters it needs (beyond rope_type) and those it may have
_REQUIRED = {"default": (), "linear": ("factor",),
             "llama3": ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"),
             "yarn": ("factor", "original_max_position_embeddings"),
             "longrope": ("short_factor", "long_factor", "original_max_position_embeddings")}
_OPTIONAL = {"yarn": ("attention_factor", "beta_fast", "beta_slow", "mscale", "mscale_all_dim", "truncate"),
             "longrope": ("factor", "attention_factor")}
ROPE_TYPES = tuple(_REQUIRED)
_POSITIVE = ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings", "attention_factor",
             "beta_fast", "beta_slow")  # the parameters that are finite numbers > 0


def check_scaling(scaling, rotary_dim: int, name: str = "rope_scaling") -> dict | None:
    """``scaling`` as a RoPE rule (see the module docstring), or None for "default"; a
    ValueError (TypeError for a value of the wrong type) naming ``name``, the rule's field, and
    the parameter that is missing, unknown, of the wrong size or not one the rule computes with."""
    if scaling is None:
        return None
    if not isinstance(scaling, dict):
        raise TypeError(f"{name} must be a dict with a 'rope_type', got {type(scaling).__name__}")
    rope_type = scaling.get("rope_type")
    if rope_type not in _REQUIRED:
        raise ValueError(f"{name}.rope_type must be one of {', '.join(map(repr, ROPE_TYPES))}, got {rope_type!r}")
    missing = [key for key in _REQUIRED[rope_type] if scaling.get(key) is None]
    unknown = sorted(set(scaling) - {"rope_type", *_REQUIRED[rope_type], *_OPTIONAL.get(rope_type, ())})
    if missing or unknown:
        got = [f"no {', '.join(missing)}"] * bool(missing) + [f"unknown {', '.join(unknown)}"] * bool(unknown)
        needs = ", ".join(_REQUIRED[rope_type]) or "no parameters"
        raise ValueError(f"{name}: rope_type {rope_type!r} needs {needs}; got {' and '.join(got)}")
    for key, value in scaling.items():  # a factor of 0 divides by zero; inf, NaN or < 0 is no frequency
        if value is None:
            continue
        if key in _POSITIVE:
            _validate.positive_number(f"{name}.{key}", value)
        elif key in ("mscale", "mscale_all_dim"):
            _validate.positive_number(f"{name}.{key}", value, above=-math.inf)  # finite; 0 reads as not given
        elif key == "truncate":
            _validate.flag(f"{name}.truncate", value)
    if rope_type == "llama3" and scaling["high_freq_factor"] <= scaling["low_freq_factor"]:
        raise ValueError(f"{name}.high_freq_factor must be greater than low_freq_factor (the ramp between "
                         f"them divides by their difference), got {scaling['high_freq_factor']!r} and "
                         f"{scaling['low_freq_factor']!r}")
    for key in ("short_factor", "long_factor"):
        if key in scaling:
            factors = scaling[key]
            if not isinstance(factors, list | tuple):
                raise TypeError(f"{name}.{key} must be a list of rotary_dim / 2 = {rotary_dim // 2} factors, "
                                f"got {type(factors).__name__} {factors!r}")
            if len(factors) != rotary_dim // 2:
                raise ValueError(f"{name}.{key} must hold rotary_dim / 2 = {rotary_dim // 2} factors, "
                                 f"got {len(factors)}")
            for factor in factors:
                _validate.positive_number(f"{name}.{key}", factor)
    return None if rope_type == "default" else dict(scaling)


def rope_frequencies(rotary_dim: int, base: float, scaling: dict | None = None,
                     seq_len: int = 0) -> tuple[Tensor, float]:
    """``inv_freq`` ``(R/2,)`` in float64 and the factor cos and sin are multiplied by, for a
    call whose largest position is ``seq_len - 1`` (only longrope looks at it)."""
    exponents = torch.arange(0, rotary_dim, 2, dtype=torch.float64) / rotary_dim  # (R/2,)
    inv_freq = base ** -exponents
    rope_type = "default" if scaling is None else scaling["rope_type"]
    if rope_type == "linear":
        return inv_freq / scaling["factor"], 1.0
    if rope_type == "llama3":
        return _llama3(inv_freq, scaling), 1.0
    if rope_type == "yarn":
        return _yarn(inv_freq, rotary_dim, base, scaling)
    if rope_type == "longrope":
        original = scaling["original_max_position_embeddings"]
        factors = scaling["long_factor" if seq_len > original else "short_factor"]
        factor = scaling.get("factor") or 1.0
        attention = scaling.get("attention_factor")
        if attention is None:
            attention = 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(original))
        return inv_freq / torch.tensor(factors, dtype=torch.float64), attention
    return inv_freq, 1.0


def _llama3(inv_freq: Tensor, s: dict) -> Tensor:
    """Llama 3.1: wavelengths past ``original / low_freq_factor`` slowed by ``factor``, those
    under ``original / high_freq_factor`` kept, the band between blended smoothly."""
    factor, low, high, original = (s[k] for k in ("factor", "low_freq_factor", "high_freq_factor",
                                                  "original_max_position_embeddings"))
    wavelen = 2 * math.pi / inv_freq
    slowed = torch.where(wavelen > original / low, inv_freq / factor, inv_freq)
    smooth = (original / wavelen - low) / (high - low)
    blended = (1 - smooth) * slowed / factor + smooth * slowed
    medium = (wavelen >= original / high) & (wavelen <= original / low)
    return torch.where(medium, blended, slowed)


def _yarn(inv_freq: Tensor, rotary_dim: int, base: float, s: dict) -> tuple[Tensor, float]:
    """YaRN: frequencies that turn fewer than ``beta_slow`` times over the original context are
    interpolated (divided by ``factor``), those turning more than ``beta_fast`` times kept, a
    linear ramp over the dimensions between; cos and sin scaled by the attention factor."""
    factor, original = s["factor"], s["original_max_position_embeddings"]

    def mscale(scale: float, m: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    attention = s.get("attention_factor")
    if attention is None:
        m, m_all = s.get("mscale"), s.get("mscale_all_dim")
        attention = mscale(factor, m) / mscale(factor, m_all) if m and m_all else mscale(factor)

    def dim_of(rotations: float) -> float:  # the dimension that turns `rotations` times over the original context
        return rotary_dim * math.log(original / (rotations * 2 * math.pi)) / (2 * math.log(base))

    low, high = dim_of(s.get("beta_fast") or 32), dim_of(s.get("beta_slow") or 1)
    if s.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, rotary_dim - 1)
    span = high - low if high != low else 0.001  # as transformers keeps the ramp finite
    ramp = ((torch.arange(rotary_dim // 2, dtype=torch.float64) - low) / span).clamp(0, 1)  # (R/2,)
    return inv_freq / factor * ramp + inv_freq * (1 - ramp), float(attention)


def rope_angles(positions: Tensor, head_dim: int, base: float = 10000.0, *, scaling: dict | None = None
                ) -> tuple[Tensor, Tensor]:
    """cos and sin for integer ``positions`` (T,) or (B, T): each ``(1 or B, 1, T, R/2)`` for
    R = ``head_dim`` rotated channels, with the scaling rule's attention factor in them.

    Angles are computed in float64 (cheap: T x R/2 values), so large positions stay exact;
    :func:`apply_rope` casts them to its working precision.
    """
    if positions.dim() == 1:
        positions = positions[None]  # (1, T)
    seq_len = int(positions.max()) + 1 if scaling is not None and scaling["rope_type"] == "longrope" else 0
    long = seq_len > scaling["original_max_position_embeddings"] if seq_len else False
    inv_freq, attention = _frequencies_on(head_dim, float(base), _hashable(scaling), long, positions.device)
    angles = positions[:, None, :, None].double() * inv_freq  # (B, 1, T, R/2)
    cos, sin = angles.cos(), angles.sin()
    return (cos, sin) if attention == 1.0 else (cos * attention, sin * attention)


@functools.lru_cache(maxsize=64)
def _frequencies_on(rotary_dim: int, base: float, scaling: tuple | None, long: bool,
                    device: torch.device) -> tuple[Tensor, float]:
    """:func:`rope_frequencies` on ``device``, computed once per rule: every layer of a decode step
    asks for the same frequencies, and working them out (arange, pow, the scaling rule) cost
    more than the angles themselves. Read-only: callers multiply, never write into it.
    ``long`` stands for ``seq_len`` (longrope looks only at which side of its original length)."""
    rule = None if scaling is None else {k: list(v) if isinstance(v, tuple) else v for k, v in scaling}
    seq_len = rule["original_max_position_embeddings"] + 1 if long else 0
    inv_freq, attention = rope_frequencies(rotary_dim, base, rule, seq_len)
    return inv_freq.to(device), attention


def _hashable(scaling: dict | None) -> tuple | None:
    """A scaling rule as a cache key (lists of longrope factors as tuples)."""
    if scaling is None:
        return None
    return tuple(sorted((k, tuple(v) if isinstance(v, list) else v) for k, v in scaling.items()))


def apply_rope(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """Rotate the first R = 2 · ``cos.shape[-1]`` channels of ``x`` (B, H, T, D) by the angles
    of :func:`rope_angles` (the other D - R pass); same shape and dtype."""
    work = torch.promote_types(x.dtype, torch.float32)  # half inputs rotate in float32
    return rotate(x, *rope_tables(cos, sin, work))


def rope_tables(cos: Tensor, sin: Tensor, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
    """:func:`rope_angles`' cos and sin (..., R/2) as the full-width tables :func:`rotate`
    multiplies by, in ``dtype``: ``[cos, cos]`` and ``[-sin, sin]``, each (..., R)."""
    cos, sin = cos.to(dtype), sin.to(dtype)
    return torch.cat([cos, cos], dim=-1), torch.cat([-sin, sin], dim=-1)


def rotate(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """:func:`apply_rope` with the tables of :func:`rope_tables` (their dtype is the working
    precision), ``x · cos + swap(x) · sin`` where swap exchanges the halves (x1, x2) -> (x2, x1):
    ``(x1·cos - x2·sin, x2·cos + x1·sin)`` in three operations, the same numbers to the last bit
    (a negated factor rounds as the subtraction does). Built once per forward, the tables serve
    every layer; same shape and dtype as ``x``."""
    R = cos.shape[-1]
    head = x[..., :R].to(cos.dtype)  # (B, H, T, R)
    swapped = head.unflatten(-1, (2, R // 2)).flip(-2).flatten(-2)  # (B, H, T, R): (x2, x1)
    rotated = (head * cos + swapped * sin).to(x.dtype)  # (B, H, T, R)
    return rotated if R == x.shape[-1] else torch.cat([rotated, x[..., R:]], dim=-1)  # (B, H, T, D)
