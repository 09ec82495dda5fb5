"""``selfattn bench calibrate``: time ``auto``'s candidates on this machine and keep the fastest.

For every mask and score rule of ``selfattn bench masks`` (B = 1, H = 8, D = 64), at a few sequence
lengths, in each dtype and mode (forward under ``torch.no_grad``, forward+backward), the candidate
backends that serve the request are timed (:func:`selfattn.backends.tuning.measure`) and the
fastest is written to this machine's cache file, which ``auto`` then follows
(:mod:`selfattn.backends.tuning`). ``--show`` prints what ``auto`` follows here without timing.
"""
from __future__ import annotations

import math as pymath
import warnings
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from selfattn import _plot, _validate
from selfattn.backends import auto, tuning
from selfattn.bench import common, masks


@dataclass
class Settings:
    masks: tuple[str, ...] = masks.MASKS  # the masks and score rules of bench masks
    lengths: tuple[int, ...] = (256, 1024, 4096)  # T = S
    dtypes: tuple[str, ...] | None = None  # None: float32, and bfloat16 where the hardware computes it natively
    batch: int = 1  # B
    n_head: int = 8  # H
    head_dim: int = 64  # D
    reps: int = 5  # timed calls per backend (median kept)

    def check(self) -> None:
        _validate.positive_ints(batch=self.batch, n_head=self.n_head, head_dim=self.head_dim, reps=self.reps)
        unknown = [m for m in self.masks if m not in masks.MASKS]
        if not self.masks or unknown:
            raise ValueError(f"masks must be among {masks.MASKS}; bad: {unknown or 'none given'}")
        if not self.lengths or not all(isinstance(T, int) and T > 0 for T in self.lengths):
            raise ValueError(f"lengths must be positive ints, got {self.lengths!r}")


FULL = Settings()
QUICK = Settings(masks=("window-256", "docs-16", "causal"), lengths=(256, 1024), n_head=2, reps=3)


def run(settings: Settings, device: torch.device, *, log=print) -> dict:
    settings.check()
    from selfattn.bench.attention import default_dtypes

    dtypes = settings.dtypes or default_dtypes(device)
    info = common.machine(device)
    log(common.describe(info))
    B, H, D = settings.batch, settings.n_head, settings.head_dim
    measured, seen = [], set()
    for dt in dtypes:
        for name in settings.masks:
            for T in settings.lengths:
                q, k, v, _ = masks._inputs(B, H, T, D, device, common.DTYPES[dt])
                mask, scores = masks.request(masks.mask_kwargs(name, B, T, device, H), B, H, device)
                for grad in (False, True):
                    point = (tuning.key(q, mask, scores, T, grad), T, tuning.window(mask, T))
                    if point in seen:  # e.g. a window of 2048 at T = 1024 is plain causal, measured once
                        continue
                    seen.add(point)
                    m = tuning.measure(q, k, v, mask, scores, grad, reps=settings.reps,
                                       allow_compile=auto.allows_compile())
                    measured.append(dict(m, mask=name))
                    log(f"{m['key']:<32} T={T:<6} best {m['best']:<6} " + ", ".join(
                        f"{n} {t * 1e3:.1f} ms" for n, t in sorted(m["times_s"].items(), key=lambda x: x[1])))
    tuning.record(device, measured)
    return {"suite": "calibrate", "machine": info, "settings": dict(asdict(settings), dtypes=list(dtypes)),
            "cache": str(tuning.path(device)), "fingerprint": tuning.fingerprint(device), "results": measured}


def report(result: dict) -> str:
    rows = [[m["key"], str(m["T"]), m["best"], " ".join(f"{n}={t / m['times_s'][m['best']]:.2f}x"
                                                        for n, t in sorted(m["times_s"].items(), key=lambda x: x[1]))]
            for m in result["results"]]
    return "\n".join(["", common.table(["kind dtype mode", "T", "fastest", "each against the fastest"], rows), "",
                      f"auto follows these measurements from {result['cache']}"])


def show(device: torch.device) -> str:
    """What ``auto`` follows on this machine: the cache file and its measurements, or why the rule."""
    file = tuning.path(device)
    tuning.forget()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        entries = tuning.table(device)
    lines = [f"machine: {tuning.fingerprint(device)}", f"cache: {file}"]
    if caught:
        lines.append(f"{caught[0].message}")
    if not entries:
        lines.append("auto follows its measured rule (selfattn/backends/auto.py): nothing is calibrated here"
                     + ("" if file.exists() else "; run `selfattn bench calibrate`"))
        return "\n".join(lines)
    lines.append(f"auto follows this machine's measurements for {len(entries)} kinds, each covering T·S within "
                 f"{tuning.REACH:g} octaves of a measured one; every other request follows its rule")
    rows = [[kind, ", ".join(f"T={m['T']}" + (f" w={m['window']}" if m.get("window") else "") + f": {m['best']}"
                             for m in sorted(ms, key=lambda m: (m["T"] * m["S"], m.get("window") or 0)))]
            for kind, ms in sorted(entries.items())]
    return "\n".join(lines + [common.table(["kind dtype mode", "fastest measured"], rows)])


def plot(result: dict, path: Path) -> Path:
    """Each candidate's time over the fastest's, per measured request (log scale)."""
    fig = _plot.figure(figsize=(14, 5))
    ax = fig.subplots()
    results = result["results"]
    names = sorted({n for m in results for n in m["times_s"]})
    width = 0.8 / max(len(names), 1)
    for i, name in enumerate(names):
        ratios = [m["times_s"][name] / m["times_s"][m["best"]] if name in m["times_s"] else pymath.nan
                  for m in results]
        ax.bar([j + i * width for j in range(len(results))], ratios, width, label=name)
    ax.set_xticks(range(len(results)), [f"{m['key']}\nT={m['T']}" for m in results], fontsize=5, rotation=90)
    ax.set(yscale="log", ylabel="time / the fastest's", title="selfattn bench calibrate")
    ax.legend(fontsize=7)
    fig.tight_layout()
    return _plot.save(fig, path, dpi=110)
