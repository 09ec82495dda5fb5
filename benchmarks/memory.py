"""Peak memory of one attention call: allocator statistics on an accelerator, a fresh
subprocess and its maximum resident set size on the CPU.

On the CPU there is no allocator to ask, so each configuration runs in its own child
process, forked from a server that imported torch (and transformers) and ran nothing; the
child reads ``resource.getrusage(...).ru_maxrss`` once idle (the baseline it inherited) and
again after each call, and reports the difference. The forward runs first, so the
forward+backward reading is the high-water mark of both (the larger one in practice).
A child the operating system kills (out of memory) reports as "does not fit".
"""
from __future__ import annotations

import multiprocessing
import sys
import traceback
from dataclasses import dataclass

import torch

from benchmarks import common, impls


@dataclass(frozen=True)
class Spec:
    """One configuration to measure, picklable for the child process."""
    impl: str
    B: int
    T: int
    n_embd: int
    n_head: int
    dtype: str
    modes: tuple[str, ...]
    threads: int


def measure(specs: list[Spec], device: torch.device) -> list[dict]:
    """``{"peak_bytes": {mode: bytes}}`` or ``{"error": why}`` per spec, in order."""
    if device.type != "cpu":
        return [_guarded(lambda s=spec: _run(s, device, _AcceleratorPeak(device))) for spec in specs]
    ctx = _context()
    results = []
    for spec in specs:
        recv, send = ctx.Pipe(duplex=False)
        child = ctx.Process(target=_child, args=(spec, send), daemon=True)
        child.start()
        send.close()
        try:
            result = recv.recv()
        except EOFError:  # the child died without a word
            result = None
        child.join()
        if result is None and child.exitcode is not None and child.exitcode < 0:  # killed: the OOM killer
            result = {"error": f"does not fit: the process was killed (signal {-child.exitcode})"}
        if result is None or "crash" in result:
            raise RuntimeError(f"memory measurement of {spec} failed (exit status {child.exitcode})"
                               + (f":\n{result['crash']}" if result else ""))
        results.append(result)
    return results


def _context():
    """Fork a fresh child per configuration from a server that imported everything once."""
    if "forkserver" not in multiprocessing.get_all_start_methods():
        return multiprocessing.get_context("spawn")
    ctx = multiprocessing.get_context("forkserver")
    preload = ["torch", "benchmarks.impls", "selfattn.backends"]
    try:
        import transformers.models.gpt2.modeling_gpt2  # noqa: F401  (only to know it is there)
        preload.append("transformers.models.gpt2.modeling_gpt2")
    except ImportError:
        pass
    ctx.set_forkserver_preload(preload)
    return ctx


def _child(spec: Spec, conn) -> None:
    torch.set_num_threads(spec.threads)
    try:
        result = _guarded(lambda: _run(spec, torch.device("cpu"), _ResidentPeak()))
    except Exception:  # a real failure: hand the traceback to the parent, which raises it
        result = {"crash": traceback.format_exc()}
    conn.send(result)
    conn.close()


def _guarded(fn) -> dict:
    try:
        return fn()
    except RuntimeError as e:
        if not common.is_oom(e):
            raise
        return {"error": f"does not fit: {str(e).splitlines()[0]}"}


def _run(spec: Spec, device: torch.device, meter) -> dict:
    """Build the implementation, take the baseline, make the inputs and run each mode once:
    the peaks include the input, output and gradient tensors, not the (small) weights."""
    dtype = common.DTYPES[spec.dtype]
    module = impls.build(spec.impl, spec.n_embd, spec.n_head, device, dtype)  # imports its backend too
    meter.start()
    x, g = impls.inputs(spec.B, spec.T, spec.n_embd, device, dtype)
    peaks = {}
    for mode in spec.modes:
        impls.call(module, x, g, mode)
        common.sync(device)
        peaks[mode] = meter.peak()
    return {"peak_bytes": peaks, "baseline_bytes": meter.baseline}


class _ResidentPeak:
    """The process's maximum resident set size, less its value when idle."""

    def start(self) -> None:
        self.baseline = self._maxrss()

    def peak(self) -> int:
        return self._maxrss() - self.baseline

    @staticmethod
    def _maxrss() -> int:
        import resource
        rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        return rss if sys.platform == "darwin" else rss * 1024  # bytes on macOS, KiB on Linux


class _AcceleratorPeak:
    """The caching allocator's peak of allocated bytes, less what was allocated before."""

    def __init__(self, device: torch.device):
        self.device = device

    def start(self) -> None:
        common.sync(self.device)
        torch.accelerator.empty_cache()
        torch.accelerator.reset_peak_memory_stats()
        self.baseline = torch.accelerator.memory_allocated()

    def peak(self) -> int:
        return torch.accelerator.max_memory_allocated() - self.baseline
