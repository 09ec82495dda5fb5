"""Config fields that carry their help: ``described(default, "what it is")`` is a dataclass field whose
``metadata["help"]`` the commands show (:mod:`selfattn.cli.flags`), read from the field, never from the source."""
from __future__ import annotations

import dataclasses


def described(default, help_text: str):
    """A dataclass field with ``default`` and its help text (``metadata["help"]``)."""
    return dataclasses.field(default=default, metadata={"help": help_text})


def help_of(f: dataclasses.Field) -> str:
    """The help text of field ``f`` ("" when it has none)."""
    return f.metadata.get("help", "")
