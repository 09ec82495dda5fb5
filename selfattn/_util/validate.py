"""Argument checks of the public API, one error type per kind of mistake.

A value of the wrong type is a ``TypeError``, a value of the right type outside its range a
``ValueError``; every message names the argument and the value it got. Each check returns
the value it accepted (normalised where that helps: ``device("auto")`` resolves), so a
caller reads as ``self.window = _validate.window(window)``.
"""
from __future__ import annotations

import dataclasses
import difflib
import json
import math
import numbers
import types
import typing

import torch
from torch import Tensor


def positive_int(name: str, value) -> int:
    """A size: TypeError when not an int (a bool is not one), ValueError when <= 0."""
    if not isinstance(value, int) or isinstance(value, bool):
        raise TypeError(f"{name} must be an int, got {type(value).__name__} {value!r}")
    if value <= 0:
        raise ValueError(f"{name} must be a positive int, got {value!r}")
    return value


def positive_ints(**values) -> None:
    """:func:`positive_int` for each keyword, in order."""
    for name, value in values.items():
        positive_int(name, value)


def flag(name: str, value) -> bool:
    """A switch: True or False only (None, 0, "" or "no" would each be taken for one of them)."""
    if not isinstance(value, bool):
        raise TypeError(f"{name} must be True or False, got {type(value).__name__} {value!r}")
    return value


def count(name: str, value) -> int:
    """A number of things that may be zero: TypeError when not an int, ValueError when < 0."""
    if not isinstance(value, int) or isinstance(value, bool):
        raise TypeError(f"{name} must be an int, got {type(value).__name__} {value!r}")
    if value < 0:
        raise ValueError(f"{name} must be a non-negative int, got {value!r}")
    return value


def probability(name: str, value) -> float:
    """A dropout rate in [0, 1)."""
    if not isinstance(value, numbers.Real) or isinstance(value, bool):
        raise TypeError(f"{name} must be a number in [0, 1), got {type(value).__name__} {value!r}")
    if not 0.0 <= value < 1.0:
        raise ValueError(f"{name} must be in [0, 1), got {value!r}")
    return float(value)


def positive_number(name: str, value, *, above: float = 0.0) -> float:
    """A finite real number greater than ``above`` (NaN and infinities are refused)."""
    if not isinstance(value, numbers.Real) or isinstance(value, bool):
        raise TypeError(f"{name} must be a number, got {type(value).__name__} {value!r}")
    if not (math.isfinite(value) and value > above):
        raise ValueError(f"{name} must be a finite number > {above:g}, got {value!r}")
    return float(value)


def heads(n_embd, n_head, n_kv_head, head_dim=None) -> tuple[int, int]:
    """(n_kv_head, head_dim) of a width split into query heads and key/value heads; a
    ``head_dim`` given sets D on its own (H·D need not be ``n_embd``)."""
    positive_ints(n_embd=n_embd, n_head=n_head)
    if head_dim is None and n_embd % n_head:
        raise ValueError(f"n_embd={n_embd} is not divisible by n_head={n_head}")
    n_kv_head = positive_int("n_kv_head", n_head if n_kv_head is None else n_kv_head)
    if n_head % n_kv_head:
        raise ValueError(f"n_head={n_head} is not a multiple of n_kv_head={n_kv_head}")
    return n_kv_head, n_embd // n_head if head_dim is None else positive_int("head_dim", head_dim)


def window(value, causal: bool = True) -> int | None:
    """A sliding window (None = none); it is defined on causal attention only."""
    if value is None:
        return None
    positive_int("window", value)
    if not causal:
        raise ValueError(f"window={value} needs causal=True (a window is i - W < j <= i)")
    return value


def embeddings(who: str, x, C: int) -> None:
    """A floating-point ``(B, T, C)`` input of module ``who``."""
    if not isinstance(x, Tensor):
        raise TypeError(f"{who} expects a tensor, got {type(x).__name__}")
    if x.dim() != 3:
        raise ValueError(f"{who} expects input of shape (B, T, C={C}), got {tuple(x.shape)}")
    if x.shape[-1] != C:
        raise ValueError(f"{who}(n_embd={C}) got input with last dim {x.shape[-1]} (shape {tuple(x.shape)})")
    if not x.is_floating_point():
        raise TypeError(f"{who} expects a floating-point input, got dtype {x.dtype}")


def sink_tokens(value, window) -> int | None:
    """StreamingLLM's sink tokens: a count of first keys kept visible, meaningful under a window."""
    if value is None or count("sink_tokens", value) == 0:
        return None
    if window is None:
        raise ValueError(f"sink_tokens={value} needs a window (the sinks stay visible when the window has moved on)")
    return value


def prefix_len(value, B: int, S: int, causal: bool, window, device) -> Tensor | None:
    """A prefix-LM prefix: an int or a ``(B,)`` integer tensor in [0, S]; as ``(B,)`` or ``(1,)`` int64."""
    if value is None:
        return None
    if not causal or window is not None:
        raise ValueError(f"prefix_len needs causal attention without a window (got causal={causal}, "
                         f"window={window}): the prefix is bidirectional, the rest causal")
    if isinstance(value, Tensor):
        if not is_integer(value) or value.dim() != 1 or len(value) not in (1, B):
            raise ValueError(f"prefix_len must be an int or an integer tensor of shape (B={B},), got "
                             f"{value.dtype} {tuple(value.shape)}")
        lengths = value.to(device=device, dtype=torch.long)
    else:
        lengths = torch.tensor([count("prefix_len", value)], device=device)
    if ((lengths < 0) | (lengths > S)).any():
        raise ValueError(f"prefix_len must be in [0, S={S}], got {lengths.tolist()}")
    return lengths


def per_head(name: str, t, H: int, device) -> Tensor | None:
    """A floating-point ``(H,)`` tensor of finite values, one per query head (ALiBi slopes, sink
    logits): a NaN or infinite slope or sink would make every output NaN."""
    if t is None:
        return None
    if not isinstance(t, Tensor) or not t.is_floating_point():
        raise TypeError(f"{name} must be a floating-point tensor of shape (H={H},), got "
                        f"{t.dtype if isinstance(t, Tensor) else type(t).__name__}")
    if t.shape != (H,):
        raise ValueError(f"{name} must have shape (H={H},), one value per query head, got {tuple(t.shape)}")
    if not torch.compiler.is_compiling() and not torch.isfinite(t).all():  # (a compiled graph would break here)
        head = int(torch.nonzero(~torch.isfinite(t))[0, 0])
        raise ValueError(f"{name} must be finite, got {t[head].item()} for head {head}")
    return t.to(device)


def function(name: str, fn):
    """A callable, or None."""
    if fn is not None and not callable(fn):
        raise TypeError(f"{name} must be callable, got {type(fn).__name__}")
    return fn


def qkv(q: Tensor, k: Tensor, v: Tensor) -> None:
    """q ``(B, H, T, D)`` and k, v ``(B, Hkv, S, D)``: floating point, one dtype and device,
    H a multiple of Hkv, T <= S."""
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, Tensor):
            raise TypeError(f"{name} must be a tensor, got {type(t).__name__}")
        if t.dim() != 4:
            raise ValueError(f"{name} must be 4-D ({'(B, H, T, D)' if name == 'q' else '(B, Hkv, S, D)'}), "
                             f"got shape {tuple(t.shape)}")
        if not t.is_floating_point():
            raise TypeError(f"{name} must be floating point, got dtype {t.dtype}")
    if not q.dtype == k.dtype == v.dtype:
        raise TypeError(f"q, k, v must share a dtype, got {q.dtype}, {k.dtype}, {v.dtype}")
    if not q.device == k.device == v.device:
        raise ValueError(f"q, k, v must be on one device, got {q.device}, {k.device}, {v.device}")
    if k.shape != v.shape or k.shape[0] != q.shape[0] or k.shape[3] != q.shape[3]:
        raise ValueError(f"expected q (B, H, T, D) and k, v (B, Hkv, S, D), got q {tuple(q.shape)}, "
                         f"k {tuple(k.shape)}, v {tuple(v.shape)}")
    H, Hkv = q.shape[1], k.shape[1]
    if Hkv == 0 or H % Hkv:
        raise ValueError(f"query heads H={H} must be a multiple of key/value heads Hkv={Hkv}")
    if q.shape[2] > k.shape[2]:
        raise ValueError(f"T={q.shape[2]} queries but only S={k.shape[2]} keys: queries are the last T "
                         f"of the S key positions, so T <= S")


def per_key(name: str, t: Tensor | None, B: int, S: int, kind: type, device) -> Tensor | None:
    """A ``(B, S)`` tensor over the key positions (``kind`` bool or int), moved to ``device``."""
    if t is None:
        return None
    if not isinstance(t, Tensor):
        raise TypeError(f"{name} must be a tensor, got {type(t).__name__}")
    if kind is bool and t.dtype != torch.bool:
        raise TypeError(f"{name} must be a bool tensor (True = real token), got dtype {t.dtype}")
    if kind is int and not is_integer(t):
        raise TypeError(f"{name} must be an integer tensor, got dtype {t.dtype}")
    if t.shape != (B, S):
        raise ValueError(f"{name} must have shape (B={B}, S={S}), got {tuple(t.shape)}")
    return t.to(device)


def is_integer(t: Tensor) -> bool:
    """Whether ``t`` holds integers (not floating point, complex or bool)."""
    return not (t.is_floating_point() or t.is_complex() or t.dtype == torch.bool)


def device(name) -> torch.device:
    """A torch device this machine has. ``"auto"``: the accelerator (CUDA, MPS, ...) when there
    is one, else the CPU. Unknown names and devices this machine lacks are ValueErrors."""
    if isinstance(name, torch.device):
        name = str(name)
    if not isinstance(name, str):
        raise TypeError(f"device must be a string such as 'cpu', 'cuda' or 'auto', got {type(name).__name__}")
    if name == "auto":
        accelerator = torch.accelerator.current_accelerator() if torch.accelerator.is_available() else None
        return accelerator if accelerator is not None else torch.device("cpu")
    try:
        dev = torch.device(name)
    except RuntimeError:
        raise ValueError(f"device {name!r} is not a torch device; use 'auto', 'cpu', 'cuda', 'cuda:1', 'mps', ...") \
            from None
    if dev.type != "cpu" and not (torch.accelerator.is_available()
                                  and torch.accelerator.current_accelerator().type == dev.type):
        raise ValueError(f"device {name!r} is not available on this machine (torch {torch.__version__} sees "
                         f"{_accelerator_text()}); use --device cpu or auto")
    if dev.type != "cpu" and dev.index is not None and dev.index >= torch.accelerator.device_count():
        raise ValueError(f"device {name!r} does not exist: this machine has {torch.accelerator.device_count()} "
                         f"{dev.type} device(s)")
    return dev


def _accelerator_text() -> str:
    if not torch.accelerator.is_available():
        return "no accelerator"
    return f"{torch.accelerator.device_count()} {torch.accelerator.current_accelerator().type} device(s)"


def config_fields(cls: type, values: dict, where: str) -> dict:
    """``values`` checked against the fields of ``cls``: unknown keys and wrong types raise,
    naming the key and ``where`` the values came from (a file name, a preset)."""
    if not isinstance(values, dict):
        raise TypeError(f"{where}: expected a JSON object of {cls.__name__} fields, got {type(values).__name__}")
    names = [f.name for f in dataclasses.fields(cls)]
    out = {}
    for key, value in values.items():
        if key not in names:
            close = difflib.get_close_matches(key, names, n=1)
            hint = f"; did you mean {close[0]!r}?" if close else f"; known keys: {', '.join(names)}"
            raise ValueError(f"{where}: unknown {cls.__name__} key {key!r}{hint}")
        base, optional = field_type(cls, key)
        if value is None and optional:
            out[key] = None
        elif base is float and isinstance(value, int) and not isinstance(value, bool):
            out[key] = float(value)
        elif type(value) is base:
            out[key] = value
        else:
            want = base.__name__ + (" or null" if optional else "")
            raise TypeError(f"{where}: {cls.__name__} key {key!r} must be {want}, got {type(value).__name__} {value!r}")
    return out


def field_type(cls: type, name: str) -> tuple[type, bool]:
    """(base type, whether None is allowed) of a field annotated ``T`` or ``T | None``."""
    hint = typing.get_type_hints(cls)[name]
    args = typing.get_args(hint)
    if typing.get_origin(hint) in (typing.Union, types.UnionType) and type(None) in args:
        (base,) = [a for a in args if a is not type(None)]
        return base, True
    return hint, False


def listed(names, shown: int = 4) -> str:
    """Tensor ``names`` (sorted) for a one-line message: how many, the first few, how many more."""
    names = sorted(str(n) for n in names)
    more = f" and {len(names) - shown} more" if len(names) > shown else ""
    return f"{len(names)} tensor{'s' if len(names) > 1 else ''}: {', '.join(names[:shown])}{more}"


def one_line(e: BaseException, limit: int = 300) -> str:
    """An exception's message on one line, cut to ``limit`` characters (its type if empty)."""
    text = " ".join(str(e).split()) or type(e).__name__
    return text if len(text) <= limit else text[:limit] + "..."


def short_json(value, limit: int = 80) -> str:
    """``value`` as JSON (``repr`` for what JSON cannot write), cut to ``limit`` characters, for an error message."""
    text = json.dumps(value, ensure_ascii=False, default=repr)
    return text if len(text) <= limit else text[:limit - 3] + "..."
