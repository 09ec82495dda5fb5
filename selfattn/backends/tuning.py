"""``auto`` tuned to this machine: the backends timed here, per kind of request, kept in a cache file.

A rule measured on one CPU can be wrong on the next (AVX2 against AVX-512 with BF16, another
memory bandwidth, another thread count), so ``auto`` can follow this machine's own measurements,
as Triton's autotuner and cuDNN's benchmark mode do:

- ``selfattn calibrate`` times the candidate backends (``sdpa``, ``tiled``, ``flex``,
  ``triton``, each where it serves) on a few sequence lengths per kind of mask, dtype and mode,
  and writes the fastest of each to :func:`path`;
- with ``SELFATTN_AUTO_TUNE=1``, a request that no measurement covers is timed the first time it
  is seen (on random tensors of its shapes, under its own mask and score rules) and added to the file.

A *kind* is what the rule itself turns on: the mask's rules and the score rules present
(``window``, ``docs+padding``, ``causal|alibi_slopes``, ...), the dtype and the mode (forward alone or
with a gradient). A measurement covers requests of its kind whose T·S lies within ``REACH``
octaves of its own (a factor 16: T = 4096 covers T = 1024 to 16384 at T = S), the nearest one in
log2(T·S) (and of the window's share of the keys, for windows) deciding. Requests nothing covers, dropout, and
a cache from another machine follow :mod:`~selfattn.backends.auto`'s measured rule.

The file is keyed by a fingerprint of the machine (CPU model and flags, torch's kernel level,
torch version, thread count, whether half precision is multiplied natively; the GPU for CUDA):
``$SELFATTN_CACHE_DIR`` (default ``$XDG_CACHE_HOME/selfattn`` or ``~/.cache/selfattn``)
``/auto-<hash>.json``. A file that cannot be read, or that holds another fingerprint, is ignored
with one warning.
"""
from __future__ import annotations

import functools
import hashlib
import importlib
import json
import math as pymath
import os
import platform
import warnings
from pathlib import Path

import torch
from torch import Tensor

from selfattn._util import files as _files
from selfattn._util import timing as _timing
from selfattn.kernels.features import multiplies_natively
from selfattn.masks import Mask
from selfattn.scores import Scores

VERSION = 1  # of the file's layout
REACH = 4.0  # octaves of T·S around a measurement that it covers
TIE = 1.15  # a runner-up within this factor of the fastest is timed again, with it, for twice the rounds
CANDIDATES = ("sdpa", "tiled", "flex", "triton")
CPU_FLAGS = ("avx2", "avx512f", "avx512_bf16", "avx512_fp16", "amx_tile", "amx_bf16", "amx_fp16")
_tables: dict[tuple, dict] = {}  # what decides the file (see _where) -> its {key: [measurement]}, read once


def tune_at_first_use() -> bool:
    """Whether a request no measurement covers is timed when first seen (``SELFATTN_AUTO_TUNE=1``)."""
    return os.environ.get("SELFATTN_AUTO_TUNE", "0") not in ("", "0")


@functools.cache
def cpu() -> tuple[str, tuple[str, ...]]:
    """The CPU's model name and the flags among ``CPU_FLAGS`` it has (from /proc/cpuinfo)."""
    model, flags = platform.processor() or platform.machine(), set()
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    model = line.split(":", 1)[1].strip()
                elif line.startswith("flags"):
                    flags = set(line.split(":", 1)[1].split())
                    break
    except OSError:
        pass
    return model, tuple(f for f in CPU_FLAGS if f in flags)


def fingerprint(device: torch.device) -> dict:
    """What makes this machine's timings its own (see the module docstring)."""
    model, flags = cpu()
    info = {"device": device.type, "cpu": model, "cpu_flags": list(flags),
            "cpu_capability": torch.backends.cpu.get_cpu_capability(), "torch": torch.__version__,
            "threads": torch.get_num_threads(), "native_half": multiplies_natively(device, torch.bfloat16)}
    if device.type == "cuda":
        info["gpu"] = torch.cuda.get_device_name(device)
    return info


def path(device: torch.device | str = "cpu") -> Path:
    """The cache file of this machine's measurements for ``device``."""
    device = torch.device(device)
    digest = hashlib.sha256(json.dumps(fingerprint(device), sort_keys=True).encode()).hexdigest()[:16]
    return _files.cache_dir() / f"auto-{device.type}-{digest}.json"


def window(mask: Mask, S: int) -> int | None:
    """The mask's window where it hides keys (a window >= S is plain causal), else None."""
    return mask.window if mask.window is not None and mask.window < S else None


def kind(mask: Mask, scores: Scores | None, S: int) -> str:
    """The kind of a request, as the rule sees it: its mask's rules, then its score rules after ``|``."""
    if mask.mask_mod is not None:
        parts = ["mask_mod"]
    else:
        rules = (("window", window(mask, S) is not None), ("docs", mask.doc_ids is not None),
                 ("padding", mask.key_padding_mask is not None), ("prefix", mask.prefix_len is not None))
        parts = [name for name, present in rules if present] or ["causal" if mask.causal or mask.window else "full"]
    scores = scores or Scores()
    rules = [name for name in ("alibi_slopes", "softcap", "score_mod", "sinks") if getattr(scores, name) is not None]
    return "+".join(parts) + ("|" + "+".join(rules) if rules else "")


def key(q: Tensor, mask: Mask, scores: Scores | None, S: int, grad: bool) -> str:
    """``"<kind> <dtype> <mode>"``, the entry a request is looked up under."""
    return f"{kind(mask, scores, S)} {str(q.dtype)[6:]} {'fwd+bwd' if grad else 'fwd'}"


def table(device: torch.device) -> dict:
    """This machine's measurements for ``device``, ``{key: [measurement]}``; {} when there are none
    (a damaged or foreign file is ignored, with one warning)."""
    where = _where(device)
    if where not in _tables:
        _tables[where] = _read(path(device), fingerprint(device))
    return _tables[where]


def _where(device: torch.device) -> tuple:
    """What can change the cache file within a process, cheap to ask on every request: naming the
    file hashes the whole fingerprint, which made a lookup several times slower (``docs/benchmarks.md``,
    "Measurements the code cites")."""
    return (str(device), torch.get_num_threads(), multiplies_natively(device, torch.bfloat16),
            os.environ.get("SELFATTN_CACHE_DIR"), os.environ.get("XDG_CACHE_HOME"))


def forget() -> None:
    """Drop what was read, so the next request reads the cache file again."""
    _tables.clear()


def _read(file: Path, expected: dict) -> dict:
    if not file.exists():
        return {}
    try:
        data = json.loads(file.read_text())
        if data.get("version") != VERSION:
            raise ValueError(f"layout version {data.get('version')!r}, expected {VERSION}")
        entries = data["entries"]
        if not all(isinstance(m["best"], str) and m["T"] > 0 and m["S"] > 0 for ms in entries.values() for m in ms):
            raise ValueError("a measurement without best, T or S")
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
        warnings.warn(f"selfattn: ignoring auto's cache {file}: unreadable ({e}); run `selfattn calibrate`",
                      stacklevel=2)
        return {}
    if data.get("fingerprint") != expected:
        warnings.warn(f"selfattn: ignoring auto's cache {file}: it was measured on another machine or setting "
                      f"({data.get('fingerprint')}); run `selfattn calibrate`", stacklevel=2)
        return {}
    return entries


def nearest(measurements: list[dict], T: int, S: int, window: int | None) -> dict | None:
    """The measurement closest in octaves of T·S and, for windows, of the window's share of the keys
    (W / S: what the tiles skip), if it is within ``REACH`` of T·S. By size alone, a window of 2048
    at T = 16384 would follow one of 2048 at T = 4096 (half the keys, where dense SDPA won training in
    bfloat16) and run far slower than tiled (``docs/benchmarks.md``, "Measurements the code cites");
    by share it follows a window of 256 at T = 4096."""
    def distance(m: dict) -> float:
        d = abs(pymath.log2(T * S) - pymath.log2(m["T"] * m["S"]))
        if window is not None and m.get("window"):
            d += abs(pymath.log2(window / S) - pymath.log2(m["window"] / m["S"]))
        return d
    best = min(measurements, key=distance, default=None)
    return best if best is not None and abs(pymath.log2(T * S / (best["T"] * best["S"]))) <= REACH else None


def choice(q: Tensor, k: Tensor, v: Tensor, mask: Mask, scores: Scores | None, grad: bool) -> str | None:
    """The backend this machine measured fastest for requests like this one, or None (not measured:
    the rule decides). With ``SELFATTN_AUTO_TUNE=1`` an uncovered request is measured now."""
    T, S = q.shape[2], k.shape[2]
    entries = table(q.device)
    found = nearest(entries.get(key(q, mask, scores, S, grad), []), T, S, window(mask, S))
    if found is None and tune_at_first_use() and not torch.compiler.is_compiling():
        found = record(q.device, [measure(q, k, v, mask, scores, grad)])[0]
    return None if found is None else found["best"]


def measure(q: Tensor, k: Tensor, v: Tensor, mask: Mask, scores: Scores | None, grad: bool, *,
            reps: int = 5, allow_compile: bool = True) -> dict:
    """Time every candidate backend that serves this request on random tensors of its shapes
    (forward, or forward and backward when ``grad``): one call to warm up (two for a compiling
    backend), then ``reps`` rounds in rotating order, the median kept; a near tie (within ``TIE``)
    gets ``2 · reps`` more rounds of the two, since a call varies by 10-25% on a shared machine and
    the calibration's choice is only as good as its closest call. Returns the measurement."""
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(t.shape, generator=g).to(device=t.device, dtype=t.dtype).requires_grad_(grad)
               for t in (q, k, v))
    dout = torch.randn(q.shape, generator=g).to(device=q.device, dtype=q.dtype) if grad else None  # (B, H, T, D)
    scale = q.shape[-1] ** -0.5
    fns = {}
    for name in CANDIDATES:
        if name == "flex" and not allow_compile:
            continue
        try:
            backend = importlib.import_module(f"selfattn.backends.{name}")  # triton: an optional extra
        except ImportError:
            continue
        with torch.set_grad_enabled(grad):
            if backend.unsupported(q, k, v, mask, 0.0, scores) is None:
                fns[name] = functools.partial(_call, backend, q, k, v, dout, mask, scores, scale)
    times = {name: [] for name in fns}
    for name, fn in fns.items():
        for _ in range(2 if name == "flex" else 1):
            fn()
    _timing.rounds(fns, times, list(fns), reps)
    median = _timing.medians(times)
    close = sorted(median, key=median.get)[:2]
    if len(close) == 2 and median[close[1]] <= TIE * median[close[0]]:  # a near tie: the two timed longer
        _timing.rounds(fns, times, close, 2 * reps)
        median = _timing.medians(times)
    return {"key": key(q, mask, scores, k.shape[2], grad), "T": q.shape[2], "S": k.shape[2],
            "window": window(mask, k.shape[2]), "B": q.shape[0], "H": q.shape[1], "D": q.shape[3],
            "times_s": median, "calls": {name: len(ts) for name, ts in times.items()},
            "best": min(median, key=median.get)}


def _call(backend, q, k, v, dout, mask, scores, scale) -> None:
    """One timed call: the forward, and with ``dout`` (a random gradient, as training hands one: not
    the stride-0 ones of ``out.sum()``) the backward too."""
    with torch.set_grad_enabled(dout is not None):
        out = backend.run(q, k, v, mask, scale=scale, dropout_p=0.0, scores=scores)
        if dout is not None:
            out.backward(dout)
    if q.device.type != "cpu":
        torch.accelerator.synchronize()


def record(device: torch.device, measurements: list[dict]) -> list[dict]:
    """Add measurements to this machine's cache file (replacing one of the same key, T, S and window),
    written atomically; returns them."""
    device = torch.device(device)
    entries = table(device)
    for m in measurements:
        same = lambda old: (old["T"], old["S"], old.get("window")) == (m["T"], m["S"], m.get("window"))  # noqa: E731
        entries[m["key"]] = [old for old in entries.get(m["key"], []) if not same(old)] + [m]
    file = path(device)
    file.parent.mkdir(parents=True, exist_ok=True)
    _files.write_text(file, json.dumps({"version": VERSION, "fingerprint": fingerprint(device), "entries": entries},
                                       indent=1, sort_keys=True) + "\n")
    return measurements
