"""The run folder's lock: one process trains in a run folder at a time.

:func:`hold` takes an exclusive ``flock`` on ``RUN/.lock``, a file that names the holder (its
PID and host). A second process finds the lock taken and stops with :class:`RunFolderInUse`
("run folder runs/x is in use by PID 4242") before it reads or writes anything there. The
kernel releases a flock when its process ends, however it ends, so the lock of a killed run
is stale by construction: the next run takes it over and writes its own PID.

A folder that holds anything but a run (a ``transformers`` folder ``selfattn export`` wrote, a
project with its own ``config.json``) is refused before anything is written there
(:class:`NotARunFolder`): a run would replace its ``config.json``.

``hold`` nests within a process (the command holds the folder while it reads the configs,
:func:`~selfattn.training.loop.train` holds it again), and under ``torchrun`` only rank 0
takes it: the other ranks write nothing in the run folder. The folder must be on a local
disk or one whose network filesystem supports ``flock`` (NFSv4 does).
"""
from __future__ import annotations

import contextlib
import fcntl
import json
import os
import socket
from collections.abc import Iterator
from pathlib import Path

from selfattn._util import files as _files

NAME = ".lock"
_held: set[Path] = set()  # run folders this process holds (resolved)


class RunFolderInUse(OSError):
    """Another process holds the run folder; the message names its PID."""


class NotARunFolder(ValueError):
    """The folder is neither empty nor a run of ``selfattn train``; the message names what it holds."""


RUN_MARKS = ("ckpt-*.safetensors", "log.jsonl", NAME, "tokens/meta.json")  # files only a run writes


def check_run_folder(run_dir: str | os.PathLike) -> None:
    """Refuse ``run_dir`` when it exists, is not empty and is not a run: none of :data:`RUN_MARKS`, and no
    ``config.json`` of a run (an object with its ``model`` and ``train`` configs)."""
    run_dir = Path(run_dir)
    if not run_dir.is_dir() or not any(run_dir.iterdir()):
        return
    if any(next(run_dir.glob(mark), None) is not None for mark in RUN_MARKS):
        return
    try:
        config = json.loads((run_dir / "config.json").read_text())
    except (OSError, ValueError):
        config = None
    if isinstance(config, dict) and {"model", "train"} <= config.keys():
        return
    held = sorted(p.name for p in run_dir.iterdir())
    shown = ", ".join(held[:4]) + (f" and {len(held) - 4} more" if len(held) > 4 else "")
    raise NotARunFolder(f"{str(run_dir)!r} is not empty and is not a selfattn run (it holds {shown}); a run "
                        f"writes config.json and checkpoints there: pass a new or empty folder")


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
    check_run_folder(run_dir)
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
