"""Writing files so that nothing is lost: a whole new file or the old one, never half of one.

:func:`atomic_path` hands out a temporary name beside the target; when the block ends
without an error the temporary is fsynced and renamed over the target (atomic on POSIX) and
the folder is fsynced, so a kill at any moment leaves either the previous file or the new
one. On an error the temporary is removed. Temporaries are named ``.<name>.tmp-<pid>``, so
a cleaner can recognise those of killed writers (:func:`remove_temporaries`); no error names one:
a missing folder, a folder in the way or a refused write names the file asked for. The file ends
with the mode a plain ``open()`` gives a new file (:func:`new_file_mode`, 0644 under the usual umask),
whatever its writer gave the temporary (safetensors writes 0600).

A full disk (or quota) is a :class:`DiskFull`, one line naming the file and the space left
there, whichever writer hit it (Python's own, or a library's such as safetensors' that
reports it as text); the temporary is gone and the previous file is untouched.
"""
from __future__ import annotations

import contextlib
import errno
import os
import shutil
from collections.abc import Iterator
from pathlib import Path

_FULL = (errno.ENOSPC, errno.EDQUOT)


class DiskFull(OSError):
    """A write that found no space left; the message names the file and the free space."""


@contextlib.contextmanager
def atomic_path(path: str | os.PathLike) -> Iterator[Path]:
    """``with atomic_path(p) as tmp: write(tmp)``: ``p`` becomes what was written to ``tmp``."""
    path = Path(path)
    if path.is_dir():  # else the rename would fail naming the temporary, not the file asked for
        raise IsADirectoryError(f"{path} is a folder, not a file: name the file to write")
    if not path.parent.is_dir():  # else the writer fails naming the temporary
        raise FileNotFoundError(errno.ENOENT, f"no folder {path.parent} to write {path.name} in", str(path))
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        yield tmp
        os.chmod(tmp, new_file_mode())
        fsync(tmp)  # some filesystems report a full disk only here
        os.replace(tmp, path)  # the commit point
    except BaseException as e:
        tmp.unlink(missing_ok=True)
        if _disk_full(e):
            raise _full(path) from e
        if isinstance(e, OSError) and str(tmp) in (str(e.filename), str(e.filename2)):
            raise OSError(e.errno, e.strerror, str(path)) from None  # the file asked for, never the temporary
        raise
    fsync(path.parent)


def new_file_mode() -> int:
    """The permission bits a plain ``open(path, "w")`` gives a new file: 0666 less the process's umask."""
    try:  # Linux says the umask without changing it
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("Umask:"):
                return 0o666 & ~int(line.split()[1], 8)
    except (OSError, ValueError):
        pass
    mask = os.umask(0o022)  # elsewhere: set and put back
    os.umask(mask)
    return 0o666 & ~mask


def write_text(path: str | os.PathLike, text: str) -> None:
    """Replace the file ``path`` by ``text``, atomically."""
    with atomic_path(path) as tmp:
        tmp.write_text(text)


def append_text(path: str | os.PathLike, text: str) -> None:
    """Append ``text`` to the file ``path`` (created if missing). When the disk is full the
    file is cut back to what it held before, and a :class:`DiskFull` names it."""
    data = text.encode()
    with open(path, "ab", buffering=0) as f:  # unbuffered: what write() returns is what reached the file
        end = f.seek(0, os.SEEK_END)
        try:
            if f.write(data) != len(data):  # a short write to a regular file: the disk filled up
                raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        except OSError as e:
            f.truncate(end)
            if _disk_full(e):
                raise _full(Path(path)) from e
            raise


def remove_temporaries(folder: str | os.PathLike, name: str = "*") -> None:
    """Delete the temporaries ``.<name>.tmp-<pid>`` in ``folder``, those of killed writers.
    Call it only where no other process is writing (a run folder under its lock)."""
    for tmp in Path(folder).glob(f".{name}.tmp-*"):
        tmp.unlink(missing_ok=True)


def cache_dir() -> Path:
    """Where selfattn keeps what it measured or built for this machine: ``$SELFATTN_CACHE_DIR``,
    else ``$XDG_CACHE_HOME/selfattn``, else ``~/.cache/selfattn`` (not created here)."""
    base = os.environ.get("SELFATTN_CACHE_DIR")
    return Path(base) if base else Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache", "selfattn")


def writable_folder(path: str | os.PathLike) -> Path:
    """``path``, checked to be a folder that exists or can be created and can be written to,
    before any work whose results go there. ``ValueError`` otherwise, naming the obstacle."""
    path = Path(path)
    existing = next(p for p in (path, *path.parents) if p.exists())
    if existing == path and not path.is_dir():
        raise ValueError(f"{str(path)!r} is a file, not a folder")
    if not existing.is_dir():
        raise ValueError(f"folder {str(path)!r} cannot be created: {str(existing)!r} is a file")
    if not os.access(existing, os.W_OK | os.X_OK):
        raise ValueError(f"folder {str(path)!r} cannot be written: no write permission on {str(existing)!r}")
    return path


def fsync(path: str | os.PathLike) -> None:
    """Flush a file's (or a folder's) data to the disk."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _disk_full(e: BaseException) -> bool:
    """Whether ``e`` reports a full disk or quota: an OSError, or a library error carrying the OS text."""
    if isinstance(e, OSError):
        return e.errno in _FULL
    return isinstance(e, Exception) and any(os.strerror(code) in str(e) for code in _FULL)


def _full(path: Path) -> DiskFull:
    free = shutil.disk_usage(path.parent).free
    kept = f"; the previous {path.name} is unchanged" if path.exists() else ""
    return DiskFull(f"no space left on the device writing {path} ({_size(free)} free in {path.parent}){kept}")


def _size(n: int) -> str:
    """``n`` bytes for people: 512 bytes, 3.2 KiB, 1.5 GiB."""
    power = min(max(n.bit_length() - 1, 0) // 10, 4)
    return f"{n} bytes" if power == 0 else f"{n / 1024 ** power:.1f} {('KiB', 'MiB', 'GiB', 'TiB')[power - 1]}"
