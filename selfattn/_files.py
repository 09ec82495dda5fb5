"""Writing files so that nothing is lost: a whole new file or the old one, never half of one.

:func:`atomic_path` hands out a temporary name beside the target; when the block ends
without an error the temporary is fsynced and renamed over the target (atomic on POSIX) and
the folder is fsynced, so a kill at any moment leaves either the previous file or the new
one. On an error the temporary is removed. Temporaries are named ``.<name>.tmp-<pid>``, so
a cleaner can recognise those of killed writers.
"""
from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from pathlib import Path


@contextlib.contextmanager
def atomic_path(path: str | os.PathLike) -> Iterator[Path]:
    """``with atomic_path(p) as tmp: write(tmp)``: ``p`` becomes what was written to ``tmp``."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        yield tmp
        fsync(tmp)
        os.replace(tmp, path)  # the commit point
    finally:
        tmp.unlink(missing_ok=True)
    fsync(path.parent)


def write_text(path: str | os.PathLike, text: str) -> None:
    """Replace the file ``path`` by ``text``, atomically."""
    with atomic_path(path) as tmp:
        tmp.write_text(text)


def fsync(path: str | os.PathLike) -> None:
    """Flush a file's (or a folder's) data to the disk."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
