"""A JSON object read from a file, every failure one ValueError naming the file."""
from __future__ import annotations

import json
from pathlib import Path


def json_object(path: Path) -> dict:
    """The JSON object in the file ``path``; ValueError naming the file when it holds none."""
    try:
        content = json.loads(text(path))
    except json.JSONDecodeError as e:
        raise ValueError(f"{path}: invalid JSON at line {e.lineno} column {e.colno}: {e.msg}") from None
    if not isinstance(content, dict):
        raise ValueError(f"{path}: expected a JSON object, got {type(content).__name__}")
    return content


def text(path: Path) -> str:
    """The text of the file ``path``, which must be UTF-8 (as JSON is, and the templates beside it): a
    ValueError naming the file and the offset of its first byte that is not, never a character replaced."""
    raw = Path(path).read_bytes()
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise ValueError(f"{path}: not UTF-8 text (byte 0x{raw[e.start]:02x} at offset {e.start})") from None
