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


TICKS_UP_TO = 48  # label every row and column of a heatmap up to this many, else let matplotlib choose


def heatmap(values, path: str | os.PathLike, *, rows: list[str], columns: list[str], xlabel: str, ylabel: str,
            title: str, label: str, centre: float | None = None) -> Path:
    """``values`` (a nested list or 2-d tensor, R x K) as a heatmap PNG at ``path``: rows and columns labelled,
    a colour bar named ``label``; with ``centre``, a diverging map symmetric about it (blue below, red above)."""
    values = values.tolist() if hasattr(values, "tolist") else values
    R, K = len(values), len(values[0])
    fig = figure(figsize=(min(24.0, 2.5 + 0.45 * K), min(24.0, 1.8 + 0.4 * R)), layout="constrained")
    ax = fig.add_subplot()
    if centre is None:
        image = ax.imshow(values, aspect="auto", cmap="viridis")
    else:
        reach = max(abs(v - centre) for row in values for v in row) or 1.0
        image = ax.imshow(values, aspect="auto", cmap="RdBu_r", vmin=centre - reach, vmax=centre + reach)
    for ticks, names, set_ticks, set_labels in ((range(K), columns, ax.set_xticks, ax.set_xticklabels),
                                                (range(R), rows, ax.set_yticks, ax.set_yticklabels)):
        if len(names) <= TICKS_UP_TO:
            set_ticks(list(ticks))
            set_labels(names)
    ax.tick_params(axis="x", labelrotation=90)
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.set_title(title, fontsize=10)
    fig.colorbar(image, ax=ax, label=label)
    return save(fig, path, dpi=100)
