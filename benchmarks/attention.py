"""``python -m benchmarks attention``: our backends and the peers on the same inputs, in one run.

What is timed: a whole causal self-attention layer ``(B, T, C) -> (B, T, C)`` (fused
q/k/v projection, attention, output projection, no biases: the seed's module), every
implementation loaded with the same weights (:mod:`selfattn.peers`). Ours are
``SelfAttention(backend=...)`` for each backend and ``auto``.

- ``fwd``: one forward under ``torch.no_grad`` (inference);
- ``fwd+bwd``: a forward and the backward of a fixed random output gradient (gradients of
  the input and of the weights).

B·T is fixed (``tokens``) while T sweeps, so every configuration processes the same tokens
and only the attention span grows.

FLOPs are counted, not measured, the same for every implementation (useful work only):
    projections:  8·B·T·C² forward (q, k, v and output), backward 2x forward;
    attention:    2·B·H·T²·D forward: QKᵀ and PV, 2·B·H·T²·D each over all T² pairs, of
                  which causality keeps half; backward 2.5x forward (FlashAttention's
                  convention: the five backward matmuls, recomputing QKᵀ, over the two).
    forward+backward = 3.5x the attention forward + 3x the projection forward.
Achieved GFLOP/s is that count over the median time; its fraction of this machine's own
measured matmul throughput (a large square matmul of the same dtype) is reported with it.

Before any timing, every implementation passes the correctness gate: its output and its
input gradient at T = ``gate_len`` against the math backend in float64 on the same
(rounded) weights and inputs. At each configuration the warm-up results are also compared
with the reference implementation of that configuration (math where it runs, else sdpa).
A configuration whose estimated memory exceeds the cap is reported as "does not fit", one
whose time predicted from the previous T exceeds ``max_call_s`` as "too slow"; neither runs.
"""
from __future__ import annotations

import os
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from benchmarks import common, memory
from benchmarks.impls import IMPLS, MODES, OURS, Impl, call, implementation, inputs, reference
from selfattn import backends
from selfattn._util import plot as _plot
from selfattn._util.validate import positive_ints
from selfattn.self_attention import SelfAttention

GIB = 2 ** 30

# Implementations that materialise the (B, H, T, T) scores: how many such matrices to budget
# for at the peak of (fwd, fwd+bwd). Scores, masked copy, softmax; the backward keeps the
# softmax and adds the gradients of the weights and of the scores. Measured on the CPU at
# T = 4096: 2.7-3.7 (fwd) and 3.8-4.0 (fwd+bwd); one more is budgeted for safety.
_MATERIALISED = {"math": (4, 5), "seed": (4, 5), "hf-gpt2-eager": (4, 5)}
# Bytes per element of the (T, T) masks an implementation builds on each call (bool, and
# a float copy where the mask is additive).
_MASK_BYTES = {"math": 2, "seed": 2, "torch-mha": 6, "hf-gpt2-eager": 6}


@dataclass
class Settings:
    seq_lens: tuple[int, ...] = (128, 256, 512, 1024, 2048, 4096, 8192, 16384)  # the T sweep
    tokens: int = 16384  # B·T, fixed across the sweep (B = tokens / T)
    n_embd: int = 64  # C (the attention work grows as C: 64 keeps the full 2-core CPU run near 7 minutes)
    n_head: int = 1  # H; head dim D = C / H = 64, GPT-2's
    dtypes: tuple[str, ...] | None = None  # None: float32, and bfloat16 where the device supports it
    warmup: int = 1  # untimed calls of each implementation per configuration
    reps: int = 5  # timed calls of each implementation per configuration (median reported)
    max_mem_gib: float | None = None  # memory cap per call; None: 90% of free accelerator / 50% of free RAM
    max_call_s: float = 3.0  # skip an implementation whose predicted time per call exceeds this
    gate_len: int = 300  # T of the correctness gate (not a multiple of any tile: ragged tiles checked)
    matmul_n: int | None = None  # size of the square matmul measuring the ceiling (None: 2048 CPU, 8192 else)
    impls: tuple[str, ...] = IMPLS  # implementations, ours and peers
    memory: bool = True  # measure peak memory (CPU: the first dtype only, one subprocess per config)

    def check(self) -> None:
        positive_ints(**{name: getattr(self, name) for name in ("tokens", "n_embd", "n_head", "reps", "gate_len")})
        if self.warmup < 1:
            raise ValueError(f"warmup must be >= 1 (the warm-up results are checked), got {self.warmup}")
        if self.n_embd % self.n_head:
            raise ValueError(f"n_embd={self.n_embd} is not divisible by n_head={self.n_head}")
        bad = [T for T in self.seq_lens if T <= 0 or self.tokens % T]
        if not self.seq_lens or bad:
            raise ValueError(f"every T must divide tokens={self.tokens} (B = tokens / T); bad: {bad or 'none given'}")
        unknown = [n for n in self.impls if n not in IMPLS]
        if unknown:
            raise ValueError(f"unknown implementations {unknown}; choose from {IMPLS}")
        if self.dtypes is not None and not set(self.dtypes) <= set(common.DTYPES):
            raise ValueError(f"dtypes must be among {tuple(common.DTYPES)}, got {self.dtypes}")


FULL = Settings()
QUICK = Settings(seq_lens=(128, 256, 512), tokens=512, n_embd=64, n_head=2, max_call_s=2.0, gate_len=150, reps=3,
                 matmul_n=1024)  # two heads of 32: the multi-head paths run too


def attention_flops(B: int, T: int, H: int, D: int, mode: str) -> float:
    """Causal attention FLOPs: forward 2·B·H·T²·D, backward 2.5x that (see the module doc)."""
    fwd = 2 * B * H * T * T * D
    return fwd if mode == "fwd" else 3.5 * fwd


def module_flops(B: int, T: int, C: int, H: int, mode: str) -> float:
    """The layer's FLOPs: projections 8·B·T·C² forward (backward 2x) plus the attention."""
    proj = 8 * B * T * C * C
    return (proj if mode == "fwd" else 3 * proj) + attention_flops(B, T, H, C // H, mode)


def estimate_bytes(name: str, B: int, T: int, C: int, H: int, dtype: torch.dtype, mode: str) -> int:
    """A generous estimate of one call's peak memory, to skip what would not fit."""
    name = backends.resolve(name) if name in OURS else name
    item = torch.empty((), dtype=dtype).element_size()
    score_item = max(item, 4) if name == "math" else item  # math keeps half-precision scores in float32
    copies = _MATERIALISED.get(name, (0, 0))[MODES.index(mode)]
    return copies * B * H * T * T * score_item + _MASK_BYTES.get(name, 0) * T * T + 24 * B * T * C * item


def memory_cap(device: torch.device, max_mem_gib: float | None) -> int:
    if max_mem_gib is not None:
        if not max_mem_gib > 0:
            raise ValueError(f"max_mem_gib must be positive, got {max_mem_gib!r}")
        return int(max_mem_gib * GIB)
    if device.type != "cpu":
        return int(0.9 * torch.accelerator.get_memory_info()[0])
    return int(0.5 * _available_ram())


def _available_ram() -> int:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def default_dtypes(device: torch.device) -> tuple[str, ...]:
    """float32, plus bfloat16 where the hardware computes it natively."""
    return ("float32", "bfloat16") if backends.multiplies_natively(device, torch.bfloat16) else ("float32",)


def run(settings: Settings, device: torch.device, *, impls: list[Impl] | None = None, log=print) -> dict:
    """The whole suite; returns the JSON-ready result (see :mod:`benchmarks`)."""
    settings.check()
    dtypes = settings.dtypes or default_dtypes(device)
    impls = impls if impls is not None else [implementation(n) for n in settings.impls]
    cap = memory_cap(device, settings.max_mem_gib)
    info = common.machine(device)
    log(common.describe(info))
    n = settings.matmul_n or (2048 if device.type == "cpu" else 8192)
    ceiling = {dt: common.matmul_peak(device, common.DTYPES[dt], n) for dt in dtypes}
    for dt, m in ceiling.items():
        log(f"matmul ceiling ({n}x{n} @ {n}x{n}, {dt}): {m['gflops']:.1f} GFLOP/s")
    gate, rows = [], []
    for dt in dtypes:
        dtype = common.DTYPES[dt]
        checked = _gate(impls, settings, device, dtype)
        gate += checked
        for g in checked:
            log(f"gate {dt:<9} {g['impl']:<14} " + (f"output err {g['out_err']:.1e}, input-grad err {g['grad_err']:.1e}"
                                                     if g["status"] == "ok" else f"unavailable: {g['reason']}"))
        ok = [i for i in impls if any(g["impl"] == i.name and g["status"] == "ok" for g in checked)]
        rows += [dict(r, dtype=dt) for r in _unavailable_rows(checked, settings)]
        rows += _sweep(ok, settings, device, dtype, dt, cap, ceiling[dt]["gflops"], log)
    if settings.memory:
        _measure_memory(rows, settings, device, dtypes if device.type != "cpu" else dtypes[:1], log)
    result = {"suite": "attention", "machine": info,
              "settings": dict(asdict(settings), dtypes=list(dtypes), impls=[i.name for i in impls],
                               max_mem_bytes=cap, matmul_n=n, auto_backend=backends.resolve("auto")),
              "flops": {"forward": "8·B·T·C² (projections) + 2·B·H·T²·D (causal attention: QKᵀ, PV, half each)",
                        "forward+backward": "3·8·B·T·C² + 3.5·2·B·H·T²·D (backward: 2x projections, 2.5x attention)"},
              "matmul": ceiling, "gate": gate, "results": rows}
    result["targets"] = targets(result)
    return result


def _gate(impls: list[Impl], settings: Settings, device: torch.device, dtype: torch.dtype) -> list[dict]:
    """Each implementation's output and input gradient against the math backend in float64."""
    C, H, T = settings.n_embd, settings.n_head, settings.gate_len
    ref = reference(C, H, device, dtype)
    oracle = SelfAttention(C, H, backend="math").double()
    oracle.load_state_dict({k: v.double().cpu() for k, v in ref.state_dict().items()})
    x, grad = inputs(2, T, C, device, dtype, seed=1)
    x64 = x.double().cpu().requires_grad_()
    y64 = oracle(x64)
    y64.backward(grad.double().cpu())
    rows = []
    dt = str(dtype).removeprefix("torch.")
    for impl in impls:
        why = impl.unavailable(device, dtype, H, C // H)
        if why:
            rows.append({"impl": impl.name, "kind": impl.kind, "dtype": dt, "status": "unavailable", "reason": why})
            continue
        module = impl.build(ref).eval()
        y = call(module, x, grad, "fwd")
        dx = call(module, x, grad, "fwd+bwd")
        what = f"{impl.name} ({dtype}, B=2, T={T}, C={C}, H={H}) vs the math backend in float64"
        rows.append({"impl": impl.name, "kind": impl.kind, "dtype": dt, "status": "ok",
                     "out_err": common.check_close(f"{what}: output", y, y64, dtype),
                     "grad_err": common.check_close(f"{what}: input gradient", dx, x64.grad, dtype),
                     "tolerance": common.TOLERANCE[dtype]})
    return rows


def _unavailable_rows(checked: list[dict], settings: Settings) -> list[dict]:
    return [{"impl": g["impl"], "kind": g["kind"], "mode": mode, "T": T, "B": settings.tokens // T,
             "status": "unavailable", "reason": g["reason"]}
            for g in checked if g["status"] != "ok" for T in settings.seq_lens for mode in MODES]


def _sweep(impls: list[Impl], settings: Settings, device, dtype: torch.dtype, dt: str, cap: int,
           ceiling: float, log) -> list[dict]:
    C, H = settings.n_embd, settings.n_head
    preferred = {"math": 0, "sdpa": 1}  # the per-configuration reference: math where it runs, else sdpa
    impls = sorted(impls, key=lambda i: preferred.get(i.name, 2))
    ref = reference(C, H, device, dtype)
    last: dict[tuple[str, str], tuple[int, float]] = {}  # (impl, mode) -> (T, median seconds) last measured
    gone: dict[tuple[str, str], tuple[str, str]] = {}  # (impl, mode) -> (status, reason) for every larger T
    rows = []
    for T in settings.seq_lens:
        B = settings.tokens // T
        x, grad = inputs(B, T, C, device, dtype)
        for mode in MODES:
            cfg = {}
            fns = {}
            for impl in impls:
                row = {"impl": impl.name, "kind": impl.kind, "dtype": dt, "mode": mode, "T": T, "B": B,
                       "flops": module_flops(B, T, C, H, mode),
                       "est_bytes": estimate_bytes(impl.name, B, T, C, H, dtype, mode)}
                cfg[impl.name] = row
                prev = last.get((impl.name, mode))
                predicted = prev[1] * T / prev[0] if prev else 0.0  # B·T fixed: the attention work grows as T
                if (impl.name, mode) in gone:
                    row["status"], row["reason"] = gone[(impl.name, mode)]
                elif row["est_bytes"] > cap:
                    row["status"] = "does not fit"
                    row["reason"] = f"would need ~{row['est_bytes'] / GIB:.1f} GiB, cap {cap / GIB:.1f} GiB"
                elif predicted > settings.max_call_s:
                    row["status"] = "too slow"
                    row["reason"] = f"predicted ~{predicted:.0f} s per call > max_call_s {settings.max_call_s:g}"
                    gone[(impl.name, mode)] = (row["status"], row["reason"])
                else:
                    module = impl.build(ref).eval()
                    fns[impl.name] = lambda m=module: call(m, x, grad, mode)
            checker = _Checker(f"T={T}, B={B}, {mode}, {dt}", dtype)
            times, oom = common.interleaved(fns, device, warmup=settings.warmup, reps=settings.reps,
                                            on_warmup=checker)
            for name, error in oom.items():
                cfg[name].update(status="does not fit", reason=f"out of memory: {error}")
                gone[(name, mode)] = ("does not fit", f"out of memory at T={T}")
            for name, ts in times.items():
                t = common.median(ts)
                last[(name, mode)] = (T, t)
                gflops = cfg[name]["flops"] / t / 1e9
                cfg[name].update(status="ok", time_s=t, times_s=ts, gflops=gflops, matmul_fraction=gflops / ceiling,
                                 check_err=checker.errors.get(name), checked_against=checker.reference)
            fastest = min((r["time_s"] for r in cfg.values() if r["status"] == "ok"), default=None)
            for r in cfg.values():
                if r["status"] == "ok":
                    r["ratio"] = r["time_s"] / fastest
            rows += cfg.values()
            if fastest is not None:
                best = min((r for r in cfg.values() if r["status"] == "ok"), key=lambda r: r["time_s"])
                log(f"{dt:<9} {mode:<8} T={T:<6} B={B:<5} fastest {best['impl']} {fastest * 1e3:.2f} ms")
    return rows


class _Checker:
    """The warm-up hook: the first result of a configuration is the reference, every other
    implementation's must match it (CorrectnessError otherwise)."""

    def __init__(self, where: str, dtype: torch.dtype):
        self.where, self.dtype = where, dtype
        self.reference, self.expected, self.errors = None, None, {}

    def __call__(self, name: str, result: torch.Tensor) -> None:
        if self.reference is None:
            self.reference, self.expected = name, result.detach()
        elif name != self.reference:
            self.errors[name] = common.check_close(f"{name} at {self.where} vs {self.reference}", result,
                                                   self.expected, self.dtype)


def _measure_memory(rows: list[dict], settings: Settings, device, dtypes, log) -> None:
    groups: dict[tuple[str, str, int], list[dict]] = {}
    for r in rows:
        if r["status"] == "ok" and r["dtype"] in dtypes:
            groups.setdefault((r["impl"], r["dtype"], r["T"]), []).append(r)
    specs = [memory.Spec(impl, group[0]["B"], T, settings.n_embd, settings.n_head, dt,
                         tuple(r["mode"] for r in group), torch.get_num_threads())
             for (impl, dt, T), group in groups.items()]
    log(f"peak memory: {len(specs)} configurations" + (", one subprocess each" if device.type == "cpu" else ""))
    for spec, result, group in zip(specs, memory.measure(specs, device), groups.values()):
        for r in group:
            if "error" in result:
                r["memory_error"] = result["error"]
            else:
                r["peak_bytes"] = result["peak_bytes"][r["mode"]]


def targets(result: dict) -> list[dict]:
    """The issue's attention targets, PASS/MISS/n-a, with the measured numbers."""
    rows = [r for r in result["results"] if r["status"] == "ok"]
    at = {(r["impl"], r["dtype"], r["mode"], r["T"]): r for r in rows}
    configs = sorted({(r["dtype"], r["mode"], r["T"]) for r in rows})
    out = []

    worst = None  # auto vs the fastest other implementation
    for dt, mode, T in configs:
        auto = at.get(("auto", dt, mode, T))
        others = [r for r in rows if (r["dtype"], r["mode"], r["T"]) == (dt, mode, T) and r["impl"] != "auto"]
        if auto and others:
            best = min(others, key=lambda r: r["time_s"])
            ratio = auto["time_s"] / best["time_s"]
            if worst is None or ratio > worst[0]:
                worst = (ratio, f"{dt} {mode} T={T}: auto {auto['time_s'] * 1e3:.3g} ms vs {best['impl']} "
                                f"{best['time_s'] * 1e3:.3g} ms")
    out.append(common.target("auto within 5% of the fastest other implementation at every T, fwd and fwd+bwd",
                             None if worst is None else worst[0] <= 1.05,
                             "not measured" if worst is None else f"worst {worst[0]:.2f}x ({worst[1]})"))

    out.append(_tiled_memory_target(result))

    ratios = [(at[("tiled", dt, m, T)]["time_s"] / at[("sdpa", dt, m, T)]["time_s"], f"{dt} {m} T={T}")
              for dt, m, T in configs if T >= 1024 and ("tiled", dt, m, T) in at and ("sdpa", dt, m, T) in at]
    w = max(ratios, default=None)
    out.append(common.target("tiled within 1.3x of sdpa at T >= 1024", None if w is None else w[0] <= 1.3,
                             "not measured" if w is None else f"worst {w[0]:.2f}x ({w[1]}); "
                             + ", ".join(f"{r:.2f}x {where}" for r, where in ratios)))

    fr = [(at[("auto", dt, "fwd", T)]["matmul_fraction"], f"{dt} T={T}") for dt, m, T in configs
          if m == "fwd" and T >= 4096 and ("auto", dt, "fwd", T) in at]
    w = min(fr, default=None)
    out.append(common.target("auto forward at T >= 4096 reaches >= 60% of the measured matmul throughput",
                             None if w is None else w[0] >= 0.6,
                             "not measured" if w is None else ", ".join(f"{f:.0%} ({where})" for f, where in fr)))

    sp = [(at[("seed", dt, "fwd+bwd", 2048)]["time_s"] / at[("auto", dt, "fwd+bwd", 2048)]["time_s"], dt)
          for dt in sorted({c[0] for c in configs})
          if ("seed", dt, "fwd+bwd", 2048) in at and ("auto", dt, "fwd+bwd", 2048) in at]
    w = min(sp, default=None)
    out.append(common.target("the seed's module beaten >= 3x at T = 2048 fwd+bwd (auto)",
                             None if w is None else w[0] >= 3.0,
                             "not measured (T=2048 not run for both)" if w is None
                             else ", ".join(f"{s:.2f}x ({dt})" for s, dt in sp)))
    return out


def _tiled_memory_target(result: dict) -> dict:
    """Tiled memory linear in T: at fixed B·T, its peak must stay flat as T grows (a
    quadratic implementation grows as T); state the peak at the largest T vs math."""
    mem = [r for r in result["results"] if r["mode"] == "fwd+bwd" and "peak_bytes" in r and r["impl"] == "tiled"]
    tiled = sorted((r for r in mem if r["dtype"] == mem[0]["dtype"]), key=lambda r: r["T"]) if mem else []
    if len(tiled) < 2:
        return common.target("tiled memory linear in T (flat at fixed B·T)", None, "not measured")
    lo, hi = tiled[0], tiled[-1]
    growth = hi["peak_bytes"] / max(lo["peak_bytes"], 1)
    maths = [r for r in result["results"] if r["impl"] == "math" and r["mode"] == "fwd+bwd"
             and r["T"] == hi["T"] and r["dtype"] == hi["dtype"]]
    if maths and "peak_bytes" in maths[0]:
        vs = f"math {maths[0]['peak_bytes'] / 2 ** 20:.0f} MiB measured"
    elif maths:
        vs = f"math {maths[0]['status']}: estimated {maths[0]['est_bytes'] / 2 ** 20:.0f} MiB"
    else:
        vs = "math not run"
    return common.target(
        "tiled memory linear in T (fwd+bwd peak flat within 2x at fixed B·T)", growth <= 2.0,
        f"{hi['dtype']} T={lo['T']}: {lo['peak_bytes'] / 2 ** 20:.0f} MiB, T={hi['T']}: "
        f"{hi['peak_bytes'] / 2 ** 20:.0f} MiB ({growth:.2f}x for {hi['T'] // lo['T']}x T) vs {vs}")


def report(result: dict) -> str:
    """The printed tables: time (ms) and ratio to the fastest per T, memory, targets."""
    s = result["settings"]
    missing = {g["impl"]: g["reason"] for g in result["gate"] if g["status"] == "unavailable"}
    rows = [r for r in result["results"] if r["status"] != "unavailable"]
    names = [n for n in s["impls"] if any(r["impl"] == n for r in rows)]
    lines = [f"unavailable here: {name} ({why})" for name, why in missing.items()]
    short = {"does not fit": "no fit", "too slow": "slow"}
    for dt in s["dtypes"]:
        for mode in MODES:
            sel = [r for r in rows if r["dtype"] == dt and r["mode"] == mode]
            Ts = sorted({r["T"] for r in sel})
            cell = {(r["impl"], r["T"]): r for r in sel}
            body = []
            for name in names:
                line = [name]
                for T in Ts:
                    r = cell.get((name, T))
                    line.append("" if r is None else f"{r['time_s'] * 1e3:.3g} x{r['ratio']:.2f}"
                                if r["status"] == "ok" else short[r["status"]])
                body.append(line)
            lines += ["", f"{dt} {mode}: median ms and x the fastest (B·T = {s['tokens']}, C = {s['n_embd']}, "
                          f"H = {s['n_head']}; auto = {s['auto_backend']})",
                      common.table(["impl"] + [f"T={T}" for T in Ts], body)]
            auto = [cell[("auto", T)] for T in Ts if cell.get(("auto", T), {}).get("status") == "ok"]
            if auto:
                lines.append("auto GFLOP/s (% of matmul): " + ", ".join(
                    f"T={r['T']} {r['gflops']:.1f} ({r['matmul_fraction']:.0%})" for r in auto))
        mem = [r for r in rows if r["dtype"] == dt and r["mode"] == "fwd+bwd"]
        if any("peak_bytes" in r for r in mem):
            Ts = sorted({r["T"] for r in mem})
            cell = {(r["impl"], r["T"]): r for r in mem}
            body = [[name] + [_mem_cell(cell.get((name, T))) for T in Ts] for name in names]
            lines += ["", f"{dt} fwd+bwd peak memory, MiB (~ = estimate of a configuration not run)",
                      common.table(["impl"] + [f"T={T}" for T in Ts], body)]
    return "\n".join(lines + ["", common.format_targets(result["targets"])])


def _mem_cell(r: dict | None) -> str:
    if r is None:
        return ""
    if "peak_bytes" in r:
        return f"{r['peak_bytes'] / 2 ** 20:.0f}"
    if "memory_error" in r:
        return "no fit"
    return f"~{r['est_bytes'] / 2 ** 20:.0f}" if r["status"] != "ok" else "?"


def plot(result: dict, path: Path) -> Path:
    """Time per T for each mode, and fwd+bwd peak memory, one row per dtype (log-log)."""
    rows, s = result["results"], result["settings"]
    fig = _plot.figure(figsize=(16, 4.5 * len(s["dtypes"])))
    axes = fig.subplots(len(s["dtypes"]), 3, squeeze=False)
    for i, dt in enumerate(s["dtypes"]):
        for j, (mode, key, label) in enumerate((("fwd", "time_s", "fwd: ms"), ("fwd+bwd", "time_s", "fwd+bwd: ms"),
                                               ("fwd+bwd", "peak_bytes", "fwd+bwd: peak MiB"))):
            ax = axes[i][j]
            for name in s["impls"]:
                pts = sorted((r["T"], r[key]) for r in rows
                             if r["impl"] == name and r["dtype"] == dt and r["mode"] == mode and key in r)
                if pts:
                    scale = 1e3 if key == "time_s" else 2 ** -20
                    ax.plot([T for T, _ in pts], [v * scale for _, v in pts], marker="o", label=name,
                            linestyle="-" if name in OURS else "--")
            ax.set(xscale="log", yscale="log", xlabel="T (B·T fixed)", title=f"{dt} {label}")
            if not ax.lines:
                ax.text(0.5, 0.5, "not measured" + (" (CPU: first dtype only)" if key == "peak_bytes" else ""),
                        ha="center", va="center", transform=ax.transAxes)
            ax.grid(True, which="both", alpha=0.3)
        axes[i][0].legend(fontsize=8)
    fig.suptitle(f"python -m benchmarks attention: B·T = {s['tokens']}, C = {s['n_embd']}, H = {s['n_head']} "
                 f"({result['machine']['cpu']}, {result['machine']['device']})")
    fig.tight_layout()
    return _plot.save(fig, path, dpi=110)
