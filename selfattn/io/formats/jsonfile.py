"""A JSON object read from a file, every failure one ValueError naming the file."""
from __future__ import annotations

import json
from pathlib import Path


def json_object(path: Path) -> dict:
    """The JSON object in the file ``path``; ValueError naming the file when it holds none."""
    try:
        content = json.loads(Path(path).read_text())
    except json.JSONDecodeError as e:
        raise ValueError(f"{path}: invalid JSON at line {e.lineno} column {e.colno}: {e.msg}") from None
    except UnicodeDecodeError as e:
        raise ValueError(f"{path}: not UTF-8 text (byte {e.start})") from None
    if not isinstance(content, dict):
        raise ValueError(f"{path}: expected a JSON object, got {type(content).__name__}")
    return content
