"""``python -m benchmarks loading``: how long a GGUF file takes to be ready to generate, ours beside llama.cpp.

Each model (SmolLM2-135M-Instruct Q4_1 and Gemma 3 270M Q4_K_M, the files ``make models`` fetches) is loaded
``reps`` times by each side, each time in a fresh process, the sides taking turns, the median kept:

- ours: ``selfattn.io.loading.load(FILE)`` after the imports (a process that has imported the library, as
  a server or a notebook has), then one forward of the bos token (the model ready to generate): the
  seconds of the load, and of load + that first token. The file's metadata, tokenizer and every tensor,
  dequantised to float32 into the model;
- llama.cpp: ``llama-completion -m FILE -n 1`` (no warm-up), with the same threads: the seconds from its
  start to its first token (the time stamp of its log's ``load time`` line, printed right after that
  token; its own ``load time`` counts from its context's creation, after the model is read): its model
  memory-mapped, its quantised blocks kept as they are or repacked for its kernels, one token computed.

The issue's goals: SmolLM2 ready within 1.5 s after imports, Gemma 3 270M within 3 s. ``--quick``:
SmolLM2 alone, once. Without llama.cpp (``make llama-cpp``) its rows are missing, said why.
"""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from benchmarks import assets, common, llama_cpp
from selfattn._util import plot as _plot
from selfattn._util import validate as _validate

FILES = {"SmolLM2-135M Q4_1": assets.SMOLLM2.path, "Gemma 3 270M Q4_K_M": assets.GEMMA3.path}  # `make models`
GOALS = {"SmolLM2-135M Q4_1": 1.5, "Gemma 3 270M Q4_K_M": 3.0}  # seconds to ready, after imports (the issue's)
TIMEOUT_S = 600.0
_OURS = """
import json, sys, time
import torch
from selfattn.io.loading import load
start = time.perf_counter()
loaded = load(sys.argv[1])
loaded_s = time.perf_counter() - start
with torch.no_grad():
    loaded.model.eval()(torch.tensor([[loaded.start_token or 0]]))
print(json.dumps({"load_s": loaded_s, "ready_s": time.perf_counter() - start}))
"""
_READY = re.compile(r"^(\d+)\.(\d+)\.(\d+)\.(\d+) I common_perf_print: +load time", re.M)  # min.s.ms.us stamp


@dataclass
class Settings:
    models: tuple[str, ...] = tuple(FILES)  # the names of FILES to load
    reps: int = 3  # fresh processes per model and side (median reported)

    def check(self) -> None:
        _validate.positive_ints(reps=self.reps)
        unknown = [m for m in self.models if m not in FILES]
        if not self.models or unknown:
            raise ValueError(f"models must be among {', '.join(map(repr, FILES))}, got {list(self.models)}")


FULL = Settings()
QUICK = Settings(models=("SmolLM2-135M Q4_1",), reps=1)


def _ours(path: Path, threads: int) -> dict:
    done = subprocess.run([sys.executable, "-c", _OURS, str(path)], capture_output=True, text=True,
                          timeout=TIMEOUT_S, env=_env(threads))
    if done.returncode:
        raise OSError(f"loading {path} failed: {done.stderr.strip().splitlines()[-1:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def _env(threads: int) -> dict:
    return {**os.environ, "OMP_NUM_THREADS": str(threads)}


def _theirs(binary: Path, path: Path, threads: int) -> float:
    """Seconds from llama.cpp's start to its first token on ``path`` (its log's time stamp)."""
    done = subprocess.run([str(binary), "-m", str(path), "-p", "Hi", "-n", "1", "--no-warmup", "-no-cnv",
                           "-t", str(threads), "-c", "512"], capture_output=True, text=True, timeout=TIMEOUT_S)
    found = _READY.search(done.stdout + done.stderr)
    if done.returncode or not found:
        raise OSError(f"llama-completion on {path} exited {done.returncode} without its time stamps")
    minutes, seconds, ms, us = map(int, found.groups())
    return 60 * minutes + seconds + ms / 1e3 + us / 1e6


def run(settings: Settings, device: torch.device, *, log=print) -> dict:
    settings.check()
    info = common.machine(device)
    log(common.describe(info))
    threads = torch.get_num_threads()
    binary, missing = llama_cpp.program("llama-completion")
    rows = []
    for name in settings.models:
        path = FILES[name]
        if not path.is_file():
            raise ValueError(f"{path} is missing: run `make models`")
        ours, theirs = [], []
        for _ in range(settings.reps):  # the sides take turns
            ours.append(_ours(path, threads))
            if binary is not None:
                theirs.append(_theirs(binary, path, threads))
        row = {"model": name, "file_mb": path.stat().st_size / 2**20,
               "load_s": common.median([o["load_s"] for o in ours]),
               "ready_s": common.median([o["ready_s"] for o in ours]),
               "llama_cpp_s": common.median(theirs) if theirs else None, "goal_s": GOALS[name]}
        rows.append(row)
        log(f"{name}: ours ready in {row['ready_s']:.2f} s (load {row['load_s']:.2f} s)"
            + (f", llama.cpp {row['llama_cpp_s']:.2f} s" if theirs else ""))
    return {"suite": "loading", "machine": info, "settings": asdict(settings), "threads": threads,
            "llama_missing": missing, "results": rows, "targets": _targets(rows)}


def _targets(rows: list[dict]) -> list[dict]:
    return [common.target(f"{r['model']}: ready to generate within {r['goal_s']:g} s after imports",
                          r["ready_s"] <= r["goal_s"], f"{r['ready_s']:.2f} s") for r in rows]


def report(result: dict) -> str:
    body = [[r["model"], f"{r['file_mb']:.0f}", f"{r['load_s']:.2f}", f"{r['ready_s']:.2f}",
             "-" if r["llama_cpp_s"] is None else f"{r['llama_cpp_s']:.2f}",
             "-" if r["llama_cpp_s"] is None else f"{r['ready_s'] / r['llama_cpp_s']:.2f}x"]
            for r in result["results"]]
    missing = [f"llama.cpp's rows are missing: {result['llama_missing']}"] if result["llama_missing"] else []
    return "\n".join([
        "", f"loading: median of {result['settings']['reps']} fresh processes per model and side, "
            f"{result['threads']} threads",
        common.table(["model", "file MB", "ours: load s", "ours: ready s", "llama.cpp: ready s", "ours / llama.cpp"],
                     body),
        *missing, common.format_targets(result["targets"])])


def plot(result: dict, path: Path) -> Path:
    fig = _plot.figure(figsize=(6, 3.5))
    ax = fig.subplots()
    rows = result["results"]
    x = range(len(rows))
    ax.bar([i - 0.2 for i in x], [r["ready_s"] for r in rows], 0.4, label="ours: ready to generate")
    ax.bar([i + 0.2 for i in x], [r["llama_cpp_s"] or 0 for r in rows], 0.4, label="llama.cpp: start to first token")
    ax.set_xticks(list(x), [r["model"] for r in rows])
    ax.set(ylabel="seconds")
    ax.legend(fontsize=8)
    fig.suptitle(f"python -m benchmarks loading ({result['machine']['device']}, {result['threads']} threads)")
    fig.tight_layout()
    return _plot.save(fig, path, dpi=110)
