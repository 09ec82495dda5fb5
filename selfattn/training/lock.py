"""The run folder's lock: one process trains in a run folder at a time.

:func:`hold` takes an exclusive ``flock`` on ``RUN/.lock``, a file that names the holder (its
PID and host). A second process finds the lock taken and stops with :class:`RunFolderInUse`
("run folder runs/x is in use by PID 4242") before it reads or writes anything there. The
kernel releases a flock when its process ends, however it ends, so the lock of a killed run
is stale by construction: the next run takes it over and writes its own PID.

``hold`` nests within a process (the command holds the folder while it reads the configs,
:func:`~selfattn.training.loop.train` holds it again), and under ``torchrun`` only rank 0
takes it: the other ranks write nothing in the run folder. The folder must be on a local
disk or one whose network filesystem supports ``flock`` (NFSv4 does).
"""
from __future__ import annotations

import contextlib
import fcntl
import os
import socket
from collections.abc import Iterator
from pathlib import Path

from selfattn import _files

NAME = ".lock"
_held: set[Path] = set()  # run folders this process holds (resolved)


class RunFolderInUse(OSError):
    """Another process holds the run folder; the message names its PID."""


@contextlib.contextmanager
def hold(run_dir: str | os.PathLike) -> Iterator[None]:
    """Hold ``run_dir`` (created if missing) for the block; raises :class:`RunFolderInUse` when
    another live process holds it. A folder this call created and nothing filled is removed."""
    run_dir = Path(run_dir)
    key = run_dir.resolve()
    if key in _held or int(os.environ.get("RANK", "0")) != 0:
        yield
        return
    created = not _files.writable_folder(run_dir).exists()
    run_dir.mkdir(parents=True, exist_ok=True)
    fd = _acquire(run_dir / NAME, run_dir)
    _held.add(key)
    try:
        yield
    finally:
        _held.discard(key)
        (run_dir / NAME).unlink(missing_ok=True)  # still locked: nobody can take the file being removed
        os.close(fd)
        if created:
            with contextlib.suppress(OSError):  # not empty: the run wrote something, keep it
                run_dir.rmdir()


def _acquire(path: Path, run_dir: Path) -> int:
    """An open descriptor of ``path``, exclusively flocked, holding this process's PID and host."""
    while True:
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = _holder(fd)
            os.close(fd)
            raise RunFolderInUse(f"run folder {run_dir} is in use by {holder} (it holds {path}); wait for it "
                                 f"to finish or stop it, or train in another --out") from None
        if _still_at(fd, path):
            break
        os.close(fd)  # its holder removed this file as we locked it: lock the one there now
    os.ftruncate(fd, 0)
    os.pwrite(fd, f"{os.getpid()} {socket.gethostname()}\n".encode(), 0)
    return fd


def _holder(fd: int) -> str:
    """'PID 4242' (and its host when not this one) from a lock file; the holder may not have written it yet."""
    pid, _, host = os.pread(fd, 256, 0).decode(errors="replace").strip().partition(" ")
    if not pid:
        return "another process"
    return f"PID {pid}" + (f" on {host}" if host and host != socket.gethostname() else "")


def _still_at(fd: int, path: Path) -> bool:
    """Whether the open file ``fd`` is still the one named ``path``."""
    try:
        here, there = os.fstat(fd), os.stat(path)
    except FileNotFoundError:
        return False
    return (here.st_dev, here.st_ino) == (there.st_dev, there.st_ino)
