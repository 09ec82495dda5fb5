"""Config dataclasses as command-line flags.

Each field of a config dataclass becomes one flag (``n_layer`` -> ``--n-layer``) whose help
is the field's comment in the source. Flags default to "not given", so a caller can layer
values: dataclass defaults, then a preset, then a JSON file
(:func:`selfattn._validate.config_fields`), then the flags a person typed.
"""
from __future__ import annotations

import argparse
import dataclasses
import inspect
import re

from selfattn._validate import field_type


def add_flags(parser: argparse.ArgumentParser, cls: type, *, skip: tuple[str, ...] = (),
              title: str | None = None) -> None:
    """Add one ``--flag`` per field of the dataclass ``cls`` (except ``skip``, and fields holding a
    list or a dict, which a JSON ``--config`` sets) in its own group, titled ``title`` (default:
    the class name)."""
    group = parser.add_argument_group(title or cls.__name__)
    comments = field_comments(cls)
    for f in dataclasses.fields(cls):
        if f.name in skip:
            continue
        base, optional = field_type(cls, f.name)
        if base in (list, dict):
            continue
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


def field_comments(cls: type) -> dict[str, str]:
    """The trailing ``# comment`` of each field line in the class source (empty if no source)."""
    try:
        source = inspect.getsource(cls)
    except (OSError, TypeError):
        return {}
    pattern = re.compile(r"^\s+(\w+)\s*:[^#\n]*#\s*(.+?)\s*$")
    return {m.group(1): m.group(2) for m in map(pattern.match, source.splitlines()) if m}


def _flag_parser(base: type, optional: bool):
    def parse(text: str):
        if optional and text.lower() == "none":
            return None
        return base(text)
    parse.__name__ = base.__name__  # argparse names the type in "invalid int value" errors
    return parse
