"""``python -m benchmarks context-parallel``: ring attention over N local processes against one.

The suite launches the processes itself (:func:`selfattn.distributed.launch.run_local`, gloo,
one torch thread each) and, for every N, layout and mask, measures per rank:

- the attention activations it holds between forward and backward (the bytes of every
  distinct tensor the call saves for its backward: q, k, v, the output, the log-sum-exp),
  against one process running the tiled backend on the whole sequence: the goal is at most
  1.15/N of it (1/N plus 15%);
- the peak resident memory the first forward+backward adds to the process (its ``ru_maxrss``
  after the call minus before, after a small warm-up call), for the transient buffers the
  saved bytes leave out (the allocator may reuse freed memory, so this is a lower bound);
- the bytes it sends in one forward+backward, against the formula: with k the bytes of a K/V
  shard pair and s the ring's steps, forward ``s·k``, backward ``2·s·k + k`` (the K/V travel
  again with their gradients, and the gradients take one last hop home);
- the time of one forward+backward (the slowest rank's, median over repetitions);
- its attention work: the query-key pairs of every tile the kernel computes, from the block
  map, so the layouts' balance (the slowest rank's work over the mean) is exact, not timed.

On a CPU with fewer cores than N processes the times are not the point: memory, bytes and
balance are. A gate first checks the ring against the math backend in float64 at a small T.

With ``--device cuda`` and at least N GPUs, rank r runs on GPU r over NCCL with the block kernel
``auto`` picks there (triton), and the peak memory is the CUDA allocator's; with fewer GPUs the
suite says so and runs on the CPU.
"""
from __future__ import annotations

import resource
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from benchmarks import common
from selfattn import attention
from selfattn._util import plot as _plot
from selfattn._util.validate import positive_ints
from selfattn.backends import tiled
from selfattn.distributed import layout as layouts
from selfattn.distributed import ring, ring_attention
from selfattn.distributed.launch import run_local
from selfattn.masks import Mask

MASKS = {"causal": None, "window-64": 64, "window-512": 512}  # name -> window


@dataclass
class Settings:
    nprocs: tuple[int, ...] = (2, 4)  # processes in the ring (--nproc)
    T: int = 4096  # positions of the whole sequence
    B: int = 1
    H: int = 8
    D: int = 64
    layouts: tuple[str, ...] = ("zigzag", "contiguous")
    masks: tuple[str, ...] = ("causal", "window-512")
    reps: int = 3  # timed forward+backward calls per configuration (median reported)
    gate_len: int = 192  # T of the float64 gate

    def check(self) -> None:
        positive_ints(T=self.T, B=self.B, H=self.H, D=self.D, reps=self.reps, gate_len=self.gate_len,
                      **{f"nproc {n}": n for n in self.nprocs})
        for name in self.layouts:
            layouts.check_layout(name)
        bad = [m for m in self.masks if m not in MASKS]
        if bad or not self.nprocs:
            raise ValueError(f"masks must be among {', '.join(MASKS)} and --nproc given; got {bad or 'no --nproc'}")
        for n in self.nprocs:
            for length in (self.T, self.gate_len):
                if length % (2 * n):
                    raise ValueError(f"T={length} must be a multiple of 2 x nproc = {2 * n}")


FULL = Settings()
QUICK = Settings(nprocs=(2,), T=512, H=2, masks=("causal", "window-64"), reps=1, gate_len=96)


def run(settings: Settings, device: torch.device, *, log=print) -> dict:
    settings.check()
    comm = "gloo"
    if device.type == "cuda" and torch.cuda.device_count() >= max(settings.nprocs):
        comm = "nccl"
    elif device.type != "cpu":
        log(f"the ranks run on this machine's CPU over gloo, not on {device}: a GPU ring needs one GPU per rank "
            f"({max(settings.nprocs)} for --nproc {max(settings.nprocs)})")
        device = torch.device("cpu")
    info = common.machine(device)
    log(common.describe(info))
    gate = []
    for n in settings.nprocs:
        for name in settings.layouts:
            for m in settings.masks:
                err = max(run_local(_gate, n, settings.gate_len, name, MASKS[m], device.type, backend=comm))
                if not err <= common.TOLERANCE[torch.float64]:
                    raise common.CorrectnessError(f"ring attention, {n} ranks, {name}, {m}, T={settings.gate_len}: "
                                                  f"relative error {err:.3g} against math in float64")
                gate.append({"nproc": n, "layout": name, "mask": m, "max_rel_err": err})
    log(f"gate: ring attention equals math in float64 at T={settings.gate_len} (worst relative error "
        f"{max(g['max_rel_err'] for g in gate):.1e}) for every N, layout and mask")
    rows = []
    for m in settings.masks:
        one = run_local(_measure, 1, settings, "contiguous", MASKS[m], device.type, backend=comm)[0]
        rows.append({"nproc": 1, "layout": "-", "mask": m, **_summary([one], settings, 1, "contiguous", MASKS[m]),
                     "saved_fraction": 1.0})
        log(f"{m:11s} one process ({one['kernel']} backend): saved {rows[-1]['saved_bytes_max'] / 2**20:.1f} MiB, "
            f"{rows[-1]['time_s']:.2f} s")
        for n in settings.nprocs:
            for name in settings.layouts:
                ranks = run_local(_measure, n, settings, name, MASKS[m], device.type, timeout_s=600.0, backend=comm)
                r = {"nproc": n, "layout": name, "mask": m, **_summary(ranks, settings, n, name, MASKS[m])}
                r["saved_fraction"] = r["saved_bytes_max"] / one["saved_bytes"]
                rows.append(r)
                log(f"{m:11s} N={n} {name:10s}: saved {r['saved_fraction']:.3f} of one process per rank, sent "
                    f"{r['sent_bytes_max'] / 2**20:.1f} MiB (formula {r['formula_bytes'] / 2**20:.1f}), "
                    f"{r['steps']} steps, work balance {r['work_balance']:.2f}, {r['time_s']:.2f} s")
    result = {"suite": "context-parallel", "machine": info, "communication": comm, "settings": asdict(settings),
              "gate": gate, "results": rows}
    result["targets"] = targets(result)
    return result


def _inputs(T: int, B: int, H: int, D: int, dtype: torch.dtype, window, device: torch.device):
    g = torch.Generator().manual_seed(0)
    q, k, v, grad = (torch.randn(B, H, T, D, generator=g, dtype=dtype).to(device) for _ in range(4))
    return q, k, v, grad, {"window": window}


def _rank_device(rank: int, device_type: str) -> torch.device:
    return torch.device("cuda", rank) if device_type == "cuda" else torch.device("cpu")


def _gate(rank: int, world: int, T: int, layout: str, window, device_type: str) -> float:
    """Max relative error of out, dq, dk, dv on this rank against math in float64."""
    q, k, v, grad, kw = _inputs(T, 2, 2, 16, torch.float64, window, _rank_device(rank, device_type))
    ref = [t.clone().requires_grad_(True) for t in (q, k, v)]
    out = attention(*ref, backend="math", **kw)
    out.backward(grad)
    local = [layouts.split(t, 2, layout, rank, world).requires_grad_(True) for t in (q, k, v)]
    got = ring_attention(*local, layout=layout, **kw)
    got.backward(layouts.split(grad, 2, layout, rank, world))
    pairs = zip([got, *(t.grad for t in local)], [out, *(t.grad for t in ref)])
    return max(common.rel_error(a, layouts.split(e.detach(), 2, layout, rank, world)) for a, e in pairs)


def _measure(rank: int, world: int, settings: Settings, layout: str, window, device_type: str) -> dict:
    """One rank's numbers; on one process, the ring's block kernel on the whole sequence (the reference)."""
    device = _rank_device(rank, device_type)
    q, k, v, grad, kw = _inputs(settings.T, settings.B, settings.H, settings.D, torch.float32, window, device)
    kw["backend"] = ring.block_kernel("auto", q, k, v)
    local = [layouts.split(t, 2, layout, rank, world).clone().requires_grad_(True) for t in (q, k, v)]
    g_local = layouts.split(grad, 2, layout, rank, world).clone()
    del q, k, v, grad
    small = [t[:, :, :2 * world].detach().clone().requires_grad_(True) for t in local]
    call_on(small, world, layout, kw).sum().backward()  # one-time costs (thread pools, buffers) before the baseline
    before = _peak_bytes(device, reset=True)
    saved: dict[int, int] = {}

    def pack(t: torch.Tensor):
        saved[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    def call():
        return call_on(local, world, layout, kw)

    ring.traffic.reset()
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = call()
    forward = ring.traffic.sent
    out.backward(g_local)
    peak = _peak_bytes(device) - before
    sent = ring.traffic.sent
    times = []
    for _ in range(settings.reps):
        torch.distributed.barrier()
        seconds, _ = common.timed(lambda: call().backward(g_local), device)
        times.append(seconds)
    return {"saved_bytes": sum(saved.values()), "rss_added_bytes": peak, "sent_bytes": sent,
            "forward_bytes": forward, "times_s": times, "kernel": kw["backend"]}


def _peak_bytes(device: torch.device, reset: bool = False) -> int:
    """The process's peak resident memory (CPU), or the CUDA allocator's peak since the last reset."""
    if device.type != "cuda":
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    if reset:
        torch.cuda.reset_peak_memory_stats(device)
    return torch.cuda.max_memory_allocated(device)


def call_on(qkv: list[torch.Tensor], world: int, layout: str, kw: dict) -> torch.Tensor:
    """Ring attention over the ranks; on one process, the ring's block kernel alone (the reference)."""
    return attention(*qkv, **kw) if world == 1 else ring_attention(*qkv, layout=layout, **kw)


def _work(settings: Settings, world: int, layout: str, window) -> list[int]:
    """Per rank: the query-key pairs of every tile the tiled kernel computes, over every key chunk."""
    mask = Mask(window=window)
    everyone = [layouts.chunks(layout, r, world, settings.T) for r in range(world)]
    keys = [c for chunks in everyone for c in chunks]
    work = []
    for chunks in everyone:
        total = 0
        for q_start, nq in chunks:
            for k_start, nk in keys:
                for group in tiled.plan(mask, nq, nk, *tiled.tile_sizes(mask), q_start, k_start):
                    total += sum((t.i1 - t.i0) * (t.k1 - t.k0) for t in group.tiles)
        work.append(total * settings.B * settings.H)
    return work


def _summary(ranks: list[dict], settings: Settings, world: int, layout: str, window) -> dict:
    kv = 2 * settings.B * settings.H * (settings.T // world) * settings.D * 4  # one K/V shard pair, float32
    steps = ranks[0]["forward_bytes"] // kv
    formula = steps * kv + (2 * steps * kv + kv if steps else 0)
    work = _work(settings, world, layout, window)
    per_rank_time = [common.median(r["times_s"]) for r in ranks]
    return {"steps": steps, "saved_bytes_max": max(r["saved_bytes"] for r in ranks),
            "rss_added_bytes_max": max(r["rss_added_bytes"] for r in ranks),
            "sent_bytes_max": max(r["sent_bytes"] for r in ranks), "sent_bytes": [r["sent_bytes"] for r in ranks],
            "formula_bytes": formula, "work": work, "work_balance": max(work) / (sum(work) / len(work)),
            "time_s": max(per_rank_time), "rank_times_s": per_rank_time, "ranks": ranks}


def targets(result: dict) -> list[dict]:
    rows = [r for r in result["results"] if r["nproc"] > 1]
    memory = [(r["saved_fraction"] / (1.15 / r["nproc"]), r) for r in rows]
    worst = max(memory, key=lambda x: x[0]) if memory else None
    exact = [r for r in rows if r["sent_bytes_max"] != r["formula_bytes"] or len(set(r["sent_bytes"])) != 1]
    zigzag = [r for r in rows if r["layout"] == "zigzag" and r["mask"] == "causal"]
    windows = [r for r in rows if r["layout"] == "contiguous" and r["mask"] != "causal"]
    return [
        common.target("attention activations per rank <= 1.15/N of one process", None if worst is None else
                      worst[0] <= 1.0, "not measured" if worst is None else
                      ", ".join(f"N={r['nproc']} {r['layout']} {r['mask']}: {r['saved_fraction']:.3f}"
                                for _, r in memory)),
        common.target("bytes sent per rank = the formula", None if not rows else not exact,
                      "not measured" if not rows else "every rank, every configuration" if not exact else
                      ", ".join(f"N={r['nproc']} {r['layout']} {r['mask']}: {r['sent_bytes']} vs {r['formula_bytes']}"
                                for r in exact)),
        common.target("zigzag, causal: the slowest rank's attention work <= 1.1x the mean", None if not zigzag else
                      max(r["work_balance"] for r in zigzag) <= 1.1, "not measured" if not zigzag else
                      ", ".join(f"N={r['nproc']}: {r['work_balance']:.3f}" for r in zigzag)),
        common.target("a window within one shard (contiguous): one ring step whatever N", None if not windows else
                      all(r["steps"] == 1 for r in windows), "not measured" if not windows else
                      ", ".join(f"N={r['nproc']} {r['mask']}: {r['steps']}" for r in windows)),
    ]


def report(result: dict) -> str:
    s = result["settings"]
    machine = result["machine"]
    where = f"{machine['cores']} CPU cores" if machine["device"] == "cpu" else "one GPU per rank"
    body = [[r["mask"], str(r["nproc"]), r["layout"], str(r["steps"]), f"{r['saved_bytes_max'] / 2**20:.1f}",
             f"{r['saved_fraction']:.3f}", f"{r['rss_added_bytes_max'] / 2**20:.1f}",
             f"{r['sent_bytes_max'] / 2**20:.2f}", f"{r['formula_bytes'] / 2**20:.2f}", f"{r['work_balance']:.3f}",
             f"{r['time_s']:.2f}"] for r in result["results"]]
    return "\n".join([
        "", f"context-parallel: ring attention, float32 forward+backward, T={s['T']}, B={s['B']}, H={s['H']}, "
            f"D={s['D']}, {result['communication']} on {where}; per rank (the largest over the ranks)",
        common.table(["mask", "N", "layout", "steps", "saved MiB", "x one", "RSS+ MiB", "sent MiB", "formula MiB",
                      "work max/mean", "time s"], body),
        "", common.format_targets(result["targets"])])


def plot(result: dict, path: Path) -> Path:
    rows = [r for r in result["results"] if r["nproc"] > 1]
    fig = _plot.figure(figsize=(8, 4.5))
    ax = fig.subplots()
    labels = [f"{r['mask']}\nN={r['nproc']} {r['layout']}" for r in rows]
    ax.bar(range(len(rows)), [r["saved_fraction"] for r in rows], label="saved activations / one process")
    ax.plot(range(len(rows)), [1.15 / r["nproc"] for r in rows], "k_", markersize=30, label="goal: 1.15/N")
    ax.set_xticks(range(len(rows)), labels, fontsize=7)
    ax.set(ylabel="fraction of one process", title="python -m benchmarks context-parallel: memory per rank")
    ax.legend()
    fig.tight_layout()
    return _plot.save(fig, path, dpi=110)
