"""Config dataclasses <-> command-line flags and JSON, with strict checking.

Each field of a config dataclass becomes one flag (``n_layer`` -> ``--n-layer``) whose help
is the field's comment in the source. Flags default to "not given", so a caller can layer
values: dataclass defaults, then a preset, then a JSON file, then the flags a person typed.
Unknown keys and mistyped values are ``ValueError``/``TypeError`` naming the key.
"""
from __future__ import annotations

import argparse
import dataclasses
import difflib
import inspect
import re
import types
import typing


def add_flags(parser: argparse.ArgumentParser, cls: type, *, skip: tuple[str, ...] = (), title: str | None = None) -> None:
    """Add one ``--flag`` per field of the dataclass ``cls`` (except ``skip``) in its own group,
    titled ``title`` (default: the class name)."""
    group = parser.add_argument_group(title or cls.__name__)
    comments = field_comments(cls)
    for f in dataclasses.fields(cls):
        if f.name in skip:
            continue
        base, optional = _field_type(cls, f.name)
        flag = "--" + f.name.replace("_", "-")
        help_text = f"{comments.get(f.name, '')} [{f.default!r}]".strip().replace("%", "%%")  # argparse formats it
        if base is bool:
            group.add_argument(flag, dest=f.name, action=argparse.BooleanOptionalAction,
                               default=argparse.SUPPRESS, help=help_text)
        else:
            group.add_argument(flag, dest=f.name, type=_flag_parser(base, optional), default=argparse.SUPPRESS,
                               metavar=base.__name__.upper() + ("|none" if optional else ""), help=help_text)


def given(args: argparse.Namespace, cls: type) -> dict:
    """The fields of ``cls`` that were given on the command line, as a dict."""
    return {f.name: getattr(args, f.name) for f in dataclasses.fields(cls) if hasattr(args, f.name)}


def check(cls: type, values: dict, where: str) -> dict:
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
        base, optional = _field_type(cls, key)
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


def field_comments(cls: type) -> dict[str, str]:
    """The trailing ``# comment`` of each field line in the class source (empty if no source)."""
    try:
        source = inspect.getsource(cls)
    except (OSError, TypeError):
        return {}
    pattern = re.compile(r"^\s+(\w+)\s*:[^#\n]*#\s*(.+?)\s*$")
    return {m.group(1): m.group(2) for m in map(pattern.match, source.splitlines()) if m}


def _field_type(cls: type, name: str) -> tuple[type, bool]:
    """(base type, whether None is allowed) of a field annotated ``T`` or ``T | None``."""
    hint = typing.get_type_hints(cls)[name]
    args = typing.get_args(hint)
    if typing.get_origin(hint) in (typing.Union, types.UnionType) and type(None) in args:
        (base,) = [a for a in args if a is not type(None)]
        return base, True
    return hint, False


def _flag_parser(base: type, optional: bool):
    def parse(text: str):
        if optional and text.lower() == "none":
            return None
        return base(text)
    parse.__name__ = base.__name__  # argparse names the type in "invalid int value" errors
    return parse
