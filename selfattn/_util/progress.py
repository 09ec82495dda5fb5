"""Progress of the steps that take a while (loading, tokenizing, exporting, quantizing), shown by
whoever asked for it: library code never prints.

A library loop wraps what it goes through, ``for t in progress.track(tensors, "loading", total=n)``,
and a step it cannot cut into pieces says it runs, ``with progress.stage("tokenizing corpus.txt"):``.
With no reporter installed (a library user's case) ``track`` returns the iterable itself and ``stage``
does nothing. The CLI installs one for the whole command (:func:`reporting` of :func:`terminal`): tqdm
bars on standard error, shown once a step has run :data:`DELAY` seconds, none when ``TQDM_DISABLE`` is
set, standard error is not a terminal, or on a rank other than 0. The reporter lives in a context
variable, so a thread or task that did not install one reports nothing.
"""
from __future__ import annotations

import contextlib
import contextvars
import os
import sys
import threading
import time
from collections.abc import Iterable, Iterator
from typing import Protocol

DELAY = 2.0  # seconds a step runs before its bar shows: quick steps stay silent


class Reporter(Protocol):
    def track(self, iterable: Iterable, what: str, total: int | None, unit: str) -> Iterable: ...

    def stage(self, what: str) -> contextlib.AbstractContextManager: ...


_reporter: contextvars.ContextVar[Reporter | None] = contextvars.ContextVar("selfattn_progress", default=None)


def track(iterable: Iterable, what: str, *, total: int | None = None, unit: str = "it") -> Iterable:
    """``iterable``, its progress reported as ``what`` (``total`` items of ``unit``) when a reporter is installed."""
    reporter = _reporter.get()
    return iterable if reporter is None else reporter.track(iterable, what, total, unit)


@contextlib.contextmanager
def stage(what: str) -> Iterator[None]:
    """The block is one step called ``what``, reported (its elapsed time) when a reporter is installed."""
    reporter = _reporter.get()
    if reporter is None:
        yield
        return
    with reporter.stage(what):
        yield


@contextlib.contextmanager
def reporting(reporter: Reporter | None) -> Iterator[None]:
    """``reporter`` (None: none) reports the progress of the library's steps inside the block."""
    token = _reporter.set(reporter)
    try:
        yield
    finally:
        _reporter.reset(token)


def enabled(stream=None) -> bool:
    """Whether bars may be shown on ``stream`` (standard error): a terminal, and ``TQDM_DISABLE`` unset."""
    stream = sys.stderr if stream is None else stream
    if os.environ.get("TQDM_DISABLE", "").strip().lower() not in ("", "0", "false", "no"):
        return False
    if os.environ.get("RANK", "0") != "0":  # under torchrun, rank 0 alone shows progress
        return False
    try:
        return stream.isatty()
    except (AttributeError, ValueError):  # no isatty, or closed
        return False


def terminal(stream=None) -> Reporter | None:
    """tqdm bars on ``stream`` (standard error) when :func:`enabled` and tqdm is installed, else None."""
    stream = sys.stderr if stream is None else stream
    if not enabled(stream):
        return None
    try:
        import tqdm  # noqa: F401
    except ImportError:
        return None
    return _Tqdm(stream)


class _Tqdm:
    """The terminal reporter: a bar per tracked loop, a ticking elapsed time per stage; each cleared when done."""

    def __init__(self, stream):
        self.stream = stream

    def _bar(self, **kw):
        from tqdm import tqdm

        return tqdm(file=self.stream, delay=DELAY, leave=False, dynamic_ncols=True, mininterval=0.5, **kw)

    def track(self, iterable, what, total, unit):
        if total is None:
            total = len(iterable) if hasattr(iterable, "__len__") else None
        return self._bar(iterable=iterable, desc=what, total=total, unit=unit)

    @contextlib.contextmanager
    def stage(self, what):
        bar = self._bar(desc=what, total=None, bar_format="{desc}: {elapsed}")
        done, start = threading.Event(), time.monotonic()

        def tick():  # the elapsed time moves while the step runs in one call; shown after DELAY, as a bar is
            while not done.wait(0.5):
                if time.monotonic() - start >= DELAY:
                    bar.refresh()

        ticker = threading.Thread(target=tick, daemon=True)
        ticker.start()
        try:
            yield
        finally:
            done.set()
            ticker.join()
            bar.close()
