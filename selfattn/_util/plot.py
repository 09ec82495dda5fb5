"""Figures without pyplot (matplotlib, optional extra ``viz``), saved atomically.

Drawing on a ``matplotlib.figure.Figure`` touches no global backend or figure state, so
library code can plot from any thread or process; :func:`save` writes the file through
:func:`selfattn._util.files.atomic_path`, so a reader never sees half a PNG.
"""
from __future__ import annotations

import os
from pathlib import Path

from selfattn._util import files as _files


def figure(**kwargs):
    """A new ``matplotlib.figure.Figure(**kwargs)``."""
    try:
        from matplotlib.figure import Figure
    except ImportError as e:
        raise ImportError("plots need matplotlib: pip install 'selfattn[viz]'") from e
    return Figure(**kwargs)


def save(fig, path: str | os.PathLike, **kwargs) -> Path:
    """Write ``fig`` to ``path`` (format from its suffix) atomically; returns the path."""
    path = Path(path)
    with _files.atomic_path(path) as tmp:
        fig.savefig(tmp, format=path.suffix.lstrip(".") or "png", **kwargs)
    return path
