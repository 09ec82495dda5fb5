"""Timing inside the library, for the choices it measures on the machine it runs on (``auto``'s
backends, :mod:`selfattn.backends.tuning`; the product forms of :mod:`selfattn.generation.layout`)."""
from __future__ import annotations

import time
from collections.abc import Callable


def rounds(fns: dict[str, Callable[[], object]], times: dict[str, list[float]], names: list[str], reps: int) -> None:
    """``reps`` rounds of the named calls, the order rotated each round, each time appended to ``times``."""
    for r in range(reps):
        for name in names[r % len(names):] + names[:r % len(names)]:
            start = time.perf_counter()
            fns[name]()
            times[name].append(time.perf_counter() - start)


def medians(times: dict[str, list[float]]) -> dict[str, float]:
    return {name: sorted(ts)[len(ts) // 2] for name, ts in times.items()}


def medians_of(fns: dict[str, Callable[[], object]], reps: int) -> dict[str, float]:
    """``{name: median seconds}`` of ``reps`` rotated rounds of the calls, after one untimed call each."""
    for fn in fns.values():
        fn()  # warm-up: kernels set up, memory paged in
    times = {name: [] for name in fns}
    rounds(fns, times, list(fns), reps)
    return medians(times)
