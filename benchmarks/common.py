"""What every benchmark suite shares: the machine, the clock, the matmul and memory-bandwidth
ceilings, peak memory of a call, the correctness check, and the files a suite writes.

Timing rules (all suites): pinned threads, a warm-up call of every implementation first,
then repetitions *interleaved* across implementations (round-robin, the order rotated
each repetition, so drift and thermal effects spread evenly), and the median reported.
On an accelerator the device is synchronised before the clock starts and stops.
"""
from __future__ import annotations

import ctypes
import gc
import importlib.metadata
import json
import os
import platform
import statistics
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import torch
from torch import Tensor

from selfattn._util import files as _files
from selfattn.backends import tuning

# Largest tolerated relative error (max |a - b| / max |b|) of an implementation against the
# reference, per dtype: float32 rounding over a few hundred terms stays near 1e-6; bfloat16
# keeps 8 bits of mantissa (relative step 2^-8 = 0.4%) and some peers also round the scores.
TOLERANCE = {torch.float64: 1e-9, torch.float32: 1e-4, torch.float16: 1e-2, torch.bfloat16: 5e-2}

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


class CorrectnessError(AssertionError):
    """An implementation disagrees with the reference: no timing of it is trustworthy."""


def pin_threads(threads: int | None) -> int:
    """Fix torch's intra-op thread count (default: every core this process may use)."""
    if threads is None:
        threads = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    if not isinstance(threads, int) or threads <= 0:
        raise ValueError(f"--threads must be a positive int, got {threads!r}")
    torch.set_num_threads(threads)
    return threads


def machine(device: torch.device) -> dict:
    """The machine and library versions, as printed and stored with every result."""
    info = {"device": str(device), "cpu": tuning.cpu()[0], "cores": os.cpu_count(),
            "threads": torch.get_num_threads(), "cpu_capability": torch.backends.cpu.get_cpu_capability(),
            "python": platform.python_version(), "platform": platform.platform(), "torch": torch.__version__}
    for lib in ("transformers", "triton"):
        try:
            info[lib] = importlib.metadata.version(lib)
        except importlib.metadata.PackageNotFoundError:
            info[lib] = None
    if device.type == "cuda":
        info["gpu"] = torch.cuda.get_device_name(device)
    return info


def describe(info: dict) -> str:
    gpu = f", {info['gpu']}" if info.get("gpu") else ""
    return (f"machine: {info['cpu']} ({info['cores']} cores, {info['cpu_capability']}){gpu}; device {info['device']}, "
            f"{info['threads']} torch threads\nversions: python {info['python']}, torch {info['torch']}, "
            f"transformers {info['transformers'] or 'not installed'}, triton {info['triton'] or 'not installed'}")


def sync(device: torch.device) -> None:
    if device.type != "cpu":
        torch.accelerator.synchronize()


def timed(fn: Callable[[], object], device: torch.device) -> tuple[float, object]:
    """Seconds one call of ``fn`` takes (device synchronised around it), and its result."""
    sync(device)
    start = time.perf_counter()
    result = fn()
    sync(device)
    return time.perf_counter() - start, result


def interleaved(fns: dict[str, Callable[[], object]], device: torch.device, *, warmup: int, reps: int,
                on_warmup: Callable[[str, object], None] | None = None
                ) -> tuple[dict[str, list[float]], dict[str, str]]:
    """Time every function ``warmup + reps`` times, round-robin, the order rotated each round.

    The warm-up rounds run in the given order (so a reference listed first runs first) and
    hand each result to ``on_warmup(name, result)``. A function that runs out of memory is
    dropped from the rounds. Returns the ``reps`` timings per name, and ``{name: error}``
    for the dropped ones.
    """
    names = list(fns)
    times: dict[str, list[float]] = {name: [] for name in names}
    out_of_memory: dict[str, str] = {}
    for r in range(warmup + reps):
        live = [name for name in names if name not in out_of_memory]
        shift = 0 if r < warmup else (r - warmup) % max(len(live), 1)
        for name in live[shift:] + live[:shift]:
            try:
                seconds, result = timed(fns[name], device)
            except RuntimeError as e:  # torch.OutOfMemoryError is a RuntimeError too
                if not is_oom(e):
                    raise
                out_of_memory[name] = str(e).splitlines()[0]
                del times[name]
                if device.type != "cpu":
                    torch.accelerator.empty_cache()
                continue
            if r < warmup:
                if on_warmup is not None:
                    on_warmup(name, result)
            else:
                times[name].append(seconds)
            del result
    return times, out_of_memory


def is_oom(e: BaseException) -> bool:
    """An allocation failure: the accelerator's OutOfMemoryError or the CPU allocator's error."""
    return isinstance(e, torch.OutOfMemoryError) or "can't allocate memory" in str(e) or "out of memory" in str(e)


def median(xs: Sequence[float]) -> float:
    return statistics.median(xs)


def matmul_peak(device: torch.device, dtype: torch.dtype, n: int, reps: int = 5) -> dict:
    """This machine's own ceiling: GFLOP/s of an (n, n) @ (n, n) matmul, median of ``reps``."""
    a = torch.randn(n, n, device=device).to(dtype)
    b = torch.randn(n, n, device=device).to(dtype)
    times, _ = interleaved({"matmul": lambda: a @ b}, device, warmup=1, reps=reps)
    seconds = median(times["matmul"])
    return {"n": n, "seconds": seconds, "gflops": 2 * n ** 3 / seconds / 1e9}


def stream_bandwidth(device: torch.device, nbytes: int, reps: int = 5) -> dict:
    """This machine's streaming memory bandwidth, the roofline of a decode step, in GB/s.

    Three kernels over ``nbytes`` of float32 (far beyond any cache: 1 GiB by default), each the
    median of ``reps`` timed calls after a warm-up: ``sum`` (reads the tensor once), ``copy``
    (``dst.copy_(src)`` of two tensors of ``nbytes / 2``: counted as ``nbytes`` read and
    written) and ``matvec`` (the tensor as a matrix times a vector: reads it once, the very
    kernel a batch-1 decode step spends its time in). ``gbps`` is the fastest of the three, so
    a fraction of it is a fraction of the best rate this machine streamed its memory at.
    """
    n = nbytes // 4
    if n < 4096:
        raise ValueError(f"bandwidth test needs at least 16 KiB, got {nbytes} bytes")
    n -= n % 4096
    x = torch.ones(n, device=device)
    half_src, half_dst = x[: n // 2], torch.empty(n // 2, device=device)
    matrix, vector = x.view(-1, 4096), torch.ones(4096, 1, device=device)
    fns = {"sum": lambda: x.sum(), "copy": lambda: half_dst.copy_(half_src), "matvec": lambda: matrix @ vector}
    times, _ = interleaved(fns, device, warmup=1, reps=reps)
    out = {"bytes": 4 * n, "reps": reps} | {f"{name}_gbps": 4 * n / median(ts) / 1e9 for name, ts in times.items()}
    out["gbps"] = max(out[f"{name}_gbps"] for name in fns)
    return out


class BandwidthProbe:
    """A sum over ``nbytes`` of float32 (far beyond any cache), timed just before and just after
    each run of a decode row: the streaming bandwidth while it ran, against which its roofline
    fraction is read. On a shared VM it moves by a third between minutes (a 2-core EPYC:
    33 to 58 GB/s within ten), so a bandwidth measured before or after the rows says little of
    theirs. The sum is :func:`stream_bandwidth`'s fastest kernel there."""

    def __init__(self, device: torch.device, nbytes: int):
        if nbytes < 16 * 1024:
            raise ValueError(f"bandwidth probe needs at least 16 KiB, got {nbytes} bytes")
        self.x = torch.ones(nbytes // 4, device=device)

    def __call__(self) -> torch.Tensor:
        return self.x.sum()

    def gbps(self, seconds: list[float]) -> float:
        """The bandwidth of the median of ``seconds``, the probe's timings."""
        return 4 * self.x.numel() / median(seconds) / 1e9


class PeakMemory:
    """Peak memory a call adds: ``growth(fn) -> (bytes, fn())``.

    CPU (Linux): the freed heap is handed back to the system first (glibc ``malloc_trim``),
    the resident set size read (``VmRSS``), its high-water mark reset to it (``/proc/self/clear_refs``
    5), the call run and the high-water mark (``VmHWM``) read: the growth is every page the call
    touched on top of what was resident, transient ones included. Accelerators: the allocator's
    peak over what was allocated before the call. ``unavailable`` says why when neither works.
    """

    def __init__(self, device: torch.device):
        self.device = device
        self.unavailable = None
        if device.type == "cpu":
            try:
                _status_kib("VmHWM")
                with open("/proc/self/clear_refs", "w") as f:
                    f.write("5")
            except OSError as e:
                self.unavailable = f"cannot reset the peak resident set size: {e}"
            try:
                self._trim = ctypes.CDLL("libc.so.6").malloc_trim
            except (OSError, AttributeError):
                self._trim = None
        elif not hasattr(torch, device.type) or not hasattr(getattr(torch, device.type), "max_memory_allocated"):
            self.unavailable = f"no allocator statistics on {device.type}"

    def growth(self, fn: Callable[[], object]) -> tuple[int | None, object]:
        if self.unavailable:
            return None, fn()
        gc.collect()
        if self.device.type == "cpu":
            if self._trim is not None:
                self._trim(0)
            before = _status_kib("VmRSS")
            with open("/proc/self/clear_refs", "w") as f:
                f.write("5")
            result = fn()
            return max(_status_kib("VmHWM") - before, 0) * 1024, result
        backend = getattr(torch, self.device.type)
        sync(self.device)
        before = backend.memory_allocated(self.device)
        backend.reset_peak_memory_stats(self.device)
        result = fn()
        sync(self.device)
        return backend.max_memory_allocated(self.device) - before, result


def _status_kib(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise OSError(f"/proc/self/status has no {field}")


def rel_error(actual: Tensor, expected: Tensor) -> float:
    """max |actual - expected| / max |expected|, in float64 on the CPU."""
    a, e = actual.detach().double().cpu(), expected.detach().double().cpu()
    if a.shape != e.shape:
        raise CorrectnessError(f"shape {tuple(a.shape)} where the reference has {tuple(e.shape)}")
    if not torch.isfinite(a).all():
        return float("inf")
    return ((a - e).abs().max() / e.abs().max().clamp_min(1e-30)).item()


def check_close(what: str, actual: Tensor, expected: Tensor, dtype: torch.dtype) -> float:
    """Raise :class:`CorrectnessError` unless ``actual`` matches ``expected`` within the
    tolerance of ``dtype``; return the relative error."""
    err = rel_error(actual, expected)
    if not err <= TOLERANCE[dtype]:
        raise CorrectnessError(f"{what}: relative error {err:.3g} > tolerance {TOLERANCE[dtype]:g} for {dtype}; "
                               f"refusing to time an implementation that computes something else")
    return err


def check_rounding(what: str, ours: Tensor, theirs: Tensor, exact: Tensor) -> tuple[float, float]:
    """Low precision: two roundings of one model differ by both their errors, so each is measured
    against ``exact`` (the same model in float32) and ours may err at most twice as much as theirs,
    plus 2% of the logits' range (the rule of the low-precision tests). Returns both relative errors.

    An error is the mean over positions (every dim but the last) of each position's largest, over
    the logits' range. Not the largest of all: where a model grows a massive activation, either
    rounding can land far off at that one position (SmolLM2-135M in bfloat16, 150 random prompts
    of 48 tokens: the largest error was ours more than twice transformers' in 2, the other way in
    3, up to 1.4 of the range, at its second token); a bug moves every position."""
    exact = exact.double()
    scale = exact.abs().max().clamp_min(1e-30)
    err, ref = (((x.double() - exact).abs().amax(dim=-1).mean() / scale).item() for x in (ours, theirs))
    if not err <= 2 * ref + 0.02:
        raise CorrectnessError(f"{what}: relative error to float32 {err:.3g} > 2 x the peer's {ref:.3g} + 0.02; "
                               f"refusing to time an implementation that computes something else")
    return err, ref


def write_json(out: Path, name: str, result: dict) -> Path:
    out.mkdir(parents=True, exist_ok=True)
    path = out / f"{name}.json"
    _files.write_text(path, json.dumps(result, indent=2) + "\n")
    return path


def table(header: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    """A plain-text table, first column left-aligned, the others right-aligned."""
    widths = [max(len(str(r[i])) for r in [header, *rows]) for i in range(len(header))]

    def line(row: Sequence[str]) -> str:
        return "  ".join(str(c).ljust(w) if i == 0 else str(c).rjust(w) for i, (c, w) in enumerate(zip(row, widths)))
    return "\n".join([line(header), "  ".join("-" * w for w in widths), *map(line, rows)])


def target(text: str, passed: bool | None, measured: str) -> dict:
    """One line of a suite's targets section; ``passed`` None = not measured in this run."""
    return {"target": text, "status": "n/a" if passed is None else "PASS" if passed else "MISS", "measured": measured}


def format_targets(targets: Sequence[dict]) -> str:
    return "\n".join(["targets"] + [f"  [{t['status']:>4}] {t['target']}: {t['measured']}" for t in targets])
