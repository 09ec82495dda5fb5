"""``python -m benchmarks decode-llama``: batch-1 decode and prefill tokens/s on real GGUF models, ours beside
llama.cpp's ``llama-bench``, in one run.

Models (``models``): SmolLM2-135M-Instruct (Q4_1) and Gemma 3 270M (Q4_K_M), the files ``make models`` fetches.
Our loader reads a file's dequantised values (float32); each of ``dtypes`` is ours against a copy of the file
that llama.cpp's ``llama-quantize --allow-requantize`` writes of those same values, once, into the same folder
(``<stem>-<type>.gguf``, :func:`copy_path`; Gemma 3's float32 copy is the one the tests use):

- ``float32``: ours in float32, llama.cpp on the F32 copy;
- ``bfloat16``: ours cast to bfloat16 (``model.to(torch.bfloat16)``), llama.cpp on the BF16 copy (both round
  each float32 value to nearest even);
- ``int8``: our weight-only int8 (:func:`selfattn.generation.int8.quantize_int8`: a scale per output row) of
  the float32 model, llama.cpp on the Q8_0 copy (a scale per block of 32): 8 bits a weight on both sides.

Ours is prepared as ``selfattn sample`` prepares it (``decode_layout``, ``quantize_int8`` for int8), then
``compile_decode(model)``: the path that decodes is recorded, ``kernel`` (the C++ decode kernel), ``graph``
(a ``torch.compile`` graph) or ``eager`` where ``compile_decode`` refuses the model (a ValueError), which then
decodes without it; with why not the kernel (``kernel_step.unsupported``'s reason, or the ValueError's).

What is timed, with this process's torch threads on both sides (``llama-bench -t N``):

- decode: llama-bench's ``tg`` test feeds ``new_tokens`` tokens one at a time from an empty context; ours
  generates greedily from a 1-token prompt (the start token) and times the ``new_tokens`` steps after its first
  token (the 1-token prefill untimed): tokens/s = new_tokens / seconds. Each side runs its LM head every token;
  ours also takes the argmax, llama-bench feeds random tokens;
- prefill: llama-bench's ``pp`` test, one batch of ``prompt`` tokens; ours ``generate(model, prompt, 1)``, the
  prompt's forward through a fresh cache to the first token: tokens/s = prompt / seconds.

llama.cpp's cache holds float16 keys and values (its default), ours the model's dtype. Each repetition runs
``llama-bench -r 1`` (its own warm-up, then pp and tg once) and ours once, the two taking turns, the order
rotated each repetition (this VM's speed drifts by a third over minutes: rows timed apart drift apart); the
median of ``reps`` is reported. Ours is warmed up once before (the kernel built, a graph compiled). llama.cpp's
threads spin while they wait for each other: where another process holds one of their cores its rows collapse,
so run it on a quiet machine.

Before timing, per model: ours (float32, as loaded) and ``llama-completion`` on the F32 copy continue a short
prompt greedily for ``check_tokens`` tokens, and the texts must be equal (both decode the same model); each
prepared model's logits on that prompt must be finite, and whether its greedy text equals float32's is
recorded. Without llama.cpp's programs (``make llama-cpp``) ours runs alone and the report says why.

Targets (the issue's): batch-1 decode at least 1.1x llama.cpp's tg tokens/s, and prefill at least llama.cpp's pp,
for every model and dtype. ``--quick``: SmolLM2 in float32, prompt 16, 8 tokens, once.
"""
from __future__ import annotations

import copy
import itertools
import json
import os
import subprocess
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from benchmarks import assets, common, llama_cpp
from benchmarks.quantized import weight_bytes
from selfattn._util import plot as _plot
from selfattn._util import validate as _validate
from selfattn.generation import compile_decode, decode_layout, generate, kernel_step
from selfattn.generation.compiled import compiled_of
from selfattn.generation.int8 import quantize_int8
from selfattn.model import GPT


@dataclass(frozen=True)
class Model:
    name: str  # as the report names it
    file: Path  # the GGUF file our loader reads
    stem: str  # llama-quantize's copies are <stem>-<type>.gguf beside it


MODELS = {"smollm2": Model("SmolLM2-135M-Instruct Q4_1", assets.SMOLLM2.path,
                           "SmolLM2-135M-Instruct"),
          "gemma3": Model("Gemma 3 270M Q4_K_M", assets.GEMMA3.path, "gemma-3-270m")}  # where `make models` keeps them
LLAMA_TYPES = {"float32": "F32", "bfloat16": "BF16", "int8": "Q8_0"}  # our dtype -> llama.cpp's copy of the file
GOALS = {"decode": 1.1, "prefill": 1.0}  # ours / llama.cpp's tokens/s (the issue's)
CHECK_PROMPT = "The capital of France is"
TIMEOUT_S = 600.0  # one llama.cpp program's run


@dataclass
class Settings:
    models: tuple[str, ...] = tuple(MODELS)  # keys of MODELS
    dtypes: tuple[str, ...] = tuple(LLAMA_TYPES)  # ours: float32, bfloat16, int8
    prompt: int = 512  # prefill tokens (llama-bench -p)
    new_tokens: int = 128  # decoded tokens (llama-bench -n)
    reps: int = 3  # interleaved repetitions per side (median reported)
    check_tokens: int = 8  # greedy tokens compared with llama.cpp's before timing (0: no comparison)

    def check(self) -> None:
        _validate.positive_ints(prompt=self.prompt, new_tokens=self.new_tokens, reps=self.reps)
        _validate.count("check_tokens", self.check_tokens)
        for name, given, known in (("models", self.models, MODELS), ("dtypes", self.dtypes, LLAMA_TYPES)):
            if not given or any(g not in known for g in given):
                raise ValueError(f"{name} must be some of {', '.join(known)}, got {list(given)}")


FULL = Settings()
QUICK = Settings(models=("smollm2",), dtypes=("float32",), prompt=16, new_tokens=8, reps=1)


def copy_path(model: Model, llama_type: str) -> Path:
    """Where llama.cpp's copy of ``model``'s file in ``llama_type`` (F32, BF16, Q8_0) lives."""
    return model.file.with_name(f"{model.stem}-{llama_type.lower()}.gguf")


def requantised(binary: Path, source: Path, out: Path, llama_type: str, threads: int) -> Path:
    """``out``, the values of ``source`` written as ``llama_type`` by ``llama-quantize`` (``binary``) when it
    is absent: under a name of this process's own, then renamed into place, so a copy is whole or absent."""
    if out.is_file():
        return out
    part = out.with_suffix(f".part{os.getpid()}")
    done = subprocess.run([str(binary), "--allow-requantize", str(source), str(part), llama_type, str(threads)],
                          capture_output=True, text=True, timeout=TIMEOUT_S)
    if done.returncode or not part.is_file():
        part.unlink(missing_ok=True)
        raise OSError(f"llama-quantize {source.name} -> {llama_type} exited {done.returncode}: "
                      f"{done.stderr.strip().splitlines()[-1:]}")
    os.replace(part, out)
    return out


def parse_bench(text: str, prompt: int, new_tokens: int) -> dict:
    """Tokens/s of the ``pp`` (``prompt`` tokens) and ``tg`` (``new_tokens`` tokens) tests in llama-bench's
    ``-o json`` output ``text``, each the mean of its samples (one with ``-r 1``), and the build."""
    tests = json.loads(text)
    pp = [t for t in tests if t["n_prompt"] == prompt and t["n_gen"] == 0]
    tg = [t for t in tests if t["n_prompt"] == 0 and t["n_gen"] == new_tokens]
    if len(pp) != 1 or len(tg) != 1:
        raise OSError(f"llama-bench printed {len(pp)} pp{prompt} and {len(tg)} tg{new_tokens} tests, not one each")
    return {"pp_tps": pp[0]["avg_ts"], "tg_tps": tg[0]["avg_ts"], "build": pp[0]["build_commit"]}


def bench(binary: Path, path: Path, threads: int, prompt: int, new_tokens: int) -> dict:
    """One ``llama-bench -r 1`` of ``path`` (a warm-up, then pp and tg once): :func:`parse_bench`'s numbers."""
    done = subprocess.run([str(binary), "-m", str(path), "-t", str(threads), "-p", str(prompt), "-n", str(new_tokens),
                           "-r", "1", "-o", "json"], capture_output=True, text=True, timeout=TIMEOUT_S)
    if done.returncode:
        raise OSError(f"llama-bench on {path} exited {done.returncode}: {done.stderr.strip().splitlines()[-1:]}")
    return parse_bench(done.stdout, prompt, new_tokens)


def prepare(base: GPT, dtype: str) -> tuple[GPT, str, str | None]:
    """A copy of ``base`` to decode in ``dtype``, as ``selfattn sample`` prepares it (cast, ``decode_layout``,
    ``quantize_int8`` of the float32 model for int8), then ``compile_decode``; the path that decodes it,
    ``kernel``, ``graph`` or ``eager`` (``compile_decode`` refused the model), and why not the kernel."""
    model = copy.deepcopy(base).to(torch.float32 if dtype == "int8" else common.DTYPES[dtype]).eval()
    decode_layout(model)
    if dtype == "int8":
        quantize_int8(model)
    try:
        compile_decode(model)
    except ValueError as e:
        return model, "eager", str(e)
    if compiled_of(model).kernel is not None:
        return model, "kernel", None
    return model, "graph", kernel_step.unsupported(model)


def prefill_tps(model: GPT, idx: torch.Tensor, device: torch.device) -> float:
    """Tokens/s of ``idx`` ``(1, P)``'s forward through a fresh cache to its first greedy token."""
    seconds, _ = common.timed(lambda: list(generate(model, idx, 1, temperature=0.0)), device)
    return idx.shape[1] / seconds


def decode_tps(model: GPT, start: torch.Tensor, n: int, device: torch.device) -> float:
    """Tokens/s of ``n`` greedy decode steps after the 1-token prompt ``start`` ``(1, 1)`` (its prefill untimed)."""
    it = generate(model, start, n + 1, temperature=0.0)
    next(it)
    seconds, _ = common.timed(lambda: list(it), device)
    return n / seconds


def interleave(sides: dict[str, Callable[[], dict]], reps: int, device: torch.device) -> dict[str, list[dict]]:
    """Each side's result, ``reps`` times, the sides taking turns, the order rotated each repetition."""
    runs: dict[str, list[dict]] = {name: [] for name in sides}
    fns = {name: (lambda name=name: runs[name].append(sides[name]())) for name in sides}
    _, oom = common.interleaved(fns, device, warmup=0, reps=reps)
    if oom:
        raise OSError(f"out of memory: {oom}")
    return runs


def _greedy(model: GPT, loaded, ids: list[int], n: int) -> str:
    """The text of ``model``'s greedy continuation of ``ids`` by ``n`` tokens, cut at an end token."""
    tokens = [int(t) for t in generate(model, torch.tensor([ids], device=model.wte.weight.device), n,
                                       temperature=0.0)]
    return loaded.tokenizer.decode(list(itertools.takewhile(lambda t: t not in loaded.eos, tokens)))


def check(loaded, base: GPT, binary: Path | None, f32: Path | None, n: int, threads: int) -> dict:
    """Ours (``base``: float32 as loaded) and llama-completion on the F32 copy ``f32`` continue
    :data:`CHECK_PROMPT` greedily by ``n`` tokens: a :class:`~benchmarks.common.CorrectnessError` unless the texts
    are equal. Without llama.cpp (``binary`` None) or with ``n`` 0, ours alone is recorded."""
    out = {"prompt": CHECK_PROMPT, "tokens": n, "ours": None, "llama_cpp": None}
    if n == 0:
        return out
    ids = loaded.require_tokenizer().encode(CHECK_PROMPT, special=True)  # bos first where the file says so
    out["ours"] = _greedy(base, loaded, ids, n)
    if binary is not None:
        out["llama_cpp"] = llama_cpp.complete(binary, f32, CHECK_PROMPT, n, threads=threads, context=256,
                                              timeout=TIMEOUT_S).decode(errors="replace")
        if out["llama_cpp"] != out["ours"]:
            raise common.CorrectnessError(f"{loaded.source.name}: our greedy continuation {out['ours']!r} is not "
                                          f"llama.cpp's {out['llama_cpp']!r} on {f32.name}: not the same model")
    return out


def _finite(model: GPT, loaded, dtype: str) -> None:
    """A :class:`~benchmarks.common.CorrectnessError` unless the prepared model's logits on :data:`CHECK_PROMPT`
    are finite."""
    ids = loaded.require_tokenizer().encode(CHECK_PROMPT, special=True)
    with torch.inference_mode():
        logits = model(torch.tensor([ids], device=model.wte.weight.device))[0]  # (1, T, V)
    if not torch.isfinite(logits).all():
        raise common.CorrectnessError(f"{loaded.source.name} {dtype}: logits not finite on {CHECK_PROMPT!r}")


def _programs() -> tuple[dict[str, Path] | None, str | None]:
    """llama.cpp's programs the suite runs, or (None, why not)."""
    found = {}
    for name in ("llama-bench", "llama-quantize", "llama-completion"):
        found[name], why = llama_cpp.program(name)
        if why is not None:
            return None, why
    return found, None


def _row(key: str, loaded, base: GPT, dtype: str, programs: dict | None, file: Path | None, settings: Settings,
         device: torch.device, threads: int, reference: str | None) -> dict:
    """Ours in ``dtype`` against llama-bench on ``file``, interleaved: the medians and every repetition."""
    model, path, why = prepare(base, dtype)
    _finite(model, loaded, dtype)
    ids = loaded.require_tokenizer().encode(CHECK_PROMPT, special=True)
    greedy = _greedy(model, loaded, ids, settings.check_tokens) if settings.check_tokens else None
    g = torch.Generator().manual_seed(0)
    prompt = torch.randint(base.config.vocab_size, (1, settings.prompt), generator=g).to(device)  # (1, P)
    start = torch.tensor([[loaded.start_token or 0]], device=device)  # (1, 1)
    prefill_tps(model, prompt, device)  # the warm-up, untimed: the kernel built, a graph compiled
    decode_tps(model, start, settings.new_tokens, device)
    sides = {}
    if programs is not None:
        sides["llama.cpp"] = lambda: bench(programs["llama-bench"], file, threads, settings.prompt, settings.new_tokens)
    sides["ours"] = lambda: {"prefill": prefill_tps(model, prompt, device),
                             "decode": decode_tps(model, start, settings.new_tokens, device)}
    runs = interleave(sides, settings.reps, device)
    ours = runs["ours"]
    row = {"model": MODELS[key].name, "key": key, "dtype": dtype, "llama_type": LLAMA_TYPES[dtype], "path": path,
           "path_reason": why, "weight_bytes": weight_bytes(model),
           "decode_tps": common.median([r["decode"] for r in ours]), "decode_runs": [r["decode"] for r in ours],
           "prefill_tps": common.median([r["prefill"] for r in ours]), "prefill_runs": [r["prefill"] for r in ours],
           "greedy": greedy, "greedy_as_float32": None if greedy is None else greedy == reference,
           "llama_file": None, "llama_file_bytes": None, "llama_build": None, "llama_tg_tps": None,
           "llama_tg_runs": [], "llama_pp_tps": None, "llama_pp_runs": []}
    theirs = runs.get("llama.cpp")
    if theirs:
        tg, pp = [r["tg_tps"] for r in theirs], [r["pp_tps"] for r in theirs]
        row |= {"llama_file": str(file), "llama_file_bytes": file.stat().st_size, "llama_build": theirs[0]["build"],
                "llama_tg_tps": common.median(tg), "llama_tg_runs": tg, "llama_pp_tps": common.median(pp),
                "llama_pp_runs": pp}
    return row


def run(settings: Settings, device: torch.device, *, log=print) -> dict:
    from selfattn.io.loading import load
    settings.check()
    info = common.machine(device)
    log(common.describe(info))
    threads = torch.get_num_threads()
    programs, missing = _programs()
    if missing:
        log(f"llama.cpp's rows are missing: {missing}")
    rows, checks = [], []
    for key in settings.models:
        model = MODELS[key]
        if not model.file.is_file():
            raise ValueError(f"{model.file} is missing: run `make models`")
        files = {}
        if programs is not None:  # every copy written before anything is timed
            wanted = dict.fromkeys((["float32"] if settings.check_tokens else []) + list(settings.dtypes))
            for dtype in wanted:
                out = copy_path(model, LLAMA_TYPES[dtype])
                if not out.is_file():
                    log(f"{model.name}: writing llama.cpp's {LLAMA_TYPES[dtype]} copy {out.name} (once)")
                files[dtype] = requantised(programs["llama-quantize"], model.file, out, LLAMA_TYPES[dtype], threads)
        loaded = load(model.file)
        base = loaded.model.to(device).eval()
        if base.max_positions is not None and max(settings.prompt, settings.new_tokens + 1) > base.max_positions:
            raise ValueError(f"{model.file.name}: prompt {settings.prompt} or {settings.new_tokens} + 1 tokens exceed "
                             f"its block_size={base.config.block_size}")
        found = check(loaded, base, None if programs is None else programs["llama-completion"], files.get("float32"),
                      settings.check_tokens, threads)
        checks.append({"model": model.name, **found})
        log(f"{model.name}: {base.num_params() / 1e6:.1f}M parameters; greedy check: ours {found['ours']!r}, "
            f"llama.cpp {found['llama_cpp']!r}")
        for dtype in settings.dtypes:
            row = _row(key, loaded, base, dtype, programs, files.get(dtype), settings, device, threads, found["ours"])
            rows.append(row)
            log(f"{model.name} {dtype} ({row['path']}): decode {row['decode_tps']:.1f} tok/s, prefill "
                f"{row['prefill_tps']:.1f} tok/s" + ("" if row["llama_tg_tps"] is None else
                                                    f"; llama.cpp {row['llama_type']}: tg {row['llama_tg_tps']:.1f}, "
                                                    f"pp {row['llama_pp_tps']:.1f} tok/s"))
        del loaded, base
    result = {"suite": "decode-llama", "machine": info, "settings": asdict(settings), "threads": threads,
              "llama_missing": missing, "checks": checks, "results": rows}
    result["targets"] = targets(result)
    return result


def _ratio(row: dict, kind: str) -> float | None:
    """Ours / llama.cpp's tokens/s of ``kind`` (decode: tg, prefill: pp), None where llama.cpp did not run."""
    theirs = row["llama_tg_tps" if kind == "decode" else "llama_pp_tps"]
    return None if theirs is None else row[f"{kind}_tps"] / theirs


def _dtype_label(row: dict) -> str:
    return f"{row['dtype']} vs {row['llama_type']}" if row["dtype"] == "int8" else row["dtype"]


def targets(result: dict) -> list[dict]:
    """Per model, dtype and kind: ours / llama.cpp's tokens/s against :data:`GOALS`, with the numbers."""
    s, out = result["settings"], []
    for r in result["results"]:
        for kind, test in (("decode", f"tg{s['new_tokens']}"), ("prefill", f"pp{s['prompt']}")):
            text = f"{r['model']} {_dtype_label(r)}: batch-1 {kind} >= {GOALS[kind]:g}x llama.cpp's {test} tokens/s"
            ratio = _ratio(r, kind)
            if ratio is None:
                out.append(common.target(text, None, f"llama.cpp not measured: {result['llama_missing']}"))
                continue
            theirs = r["llama_tg_tps" if kind == "decode" else "llama_pp_tps"]
            out.append(common.target(text, ratio >= GOALS[kind], f"{ratio:.2f}x ({r[f'{kind}_tps']:.1f} against "
                                                                 f"{theirs:.1f} tok/s, ours {r['path']})"))
    return out


def report(result: dict) -> str:
    s = result["settings"]
    lines = ["", f"decode-llama: batch 1, {result['threads']} threads each side; decode: {s['new_tokens']} tokens one "
                 f"at a time from a 1-token prompt (llama-bench tg{s['new_tokens']}), prefill: one forward of "
                 f"{s['prompt']} tokens (pp{s['prompt']}); medians of {s['reps']} interleaved repetitions"]

    def num(x, fmt="{:.1f}"):
        return "-" if x is None else fmt.format(x)

    for name in dict.fromkeys(r["model"] for r in result["results"]):
        rows = [r for r in result["results"] if r["model"] == name]
        body = [[_dtype_label(r), num(r["decode_tps"]), num(r["llama_tg_tps"]), num(_ratio(r, "decode"), "{:.2f}x"),
                 num(r["prefill_tps"]), num(r["llama_pp_tps"]), num(_ratio(r, "prefill"), "{:.2f}x"), r["path"]]
                for r in rows]
        lines += ["", name, common.table(["dtype", "ours decode tok/s", "llama.cpp tg tok/s", "ours / llama.cpp",
                                          "ours prefill tok/s", "llama.cpp pp tok/s", "ours / llama.cpp", "path"],
                                         body)]
        lines += [f"  {_dtype_label(r)}: {r['path']}, not the kernel: {r['path_reason']}" for r in rows
                  if r["path_reason"]]
    for c in result["checks"]:
        if c["ours"] is not None:
            lines.append(f"check, {c['model']}: greedy {c['tokens']} tokens after {c['prompt']!r}: ours {c['ours']!r}"
                         + ("" if c["llama_cpp"] is None else " = llama.cpp's on the F32 copy"))
    if result["llama_missing"]:
        lines.append(f"llama.cpp's rows are missing: {result['llama_missing']}")
    return "\n".join([*lines, "", common.format_targets(result["targets"])])


def plot(result: dict, path: Path) -> Path:
    rows = result["results"]
    fig = _plot.figure(figsize=(max(6, 1.2 * len(rows) + 3), 4))
    axes = fig.subplots(1, 2)
    x = range(len(rows))
    for ax, kind, theirs in ((axes[0], "decode", "llama_tg_tps"), (axes[1], "prefill", "llama_pp_tps")):
        ax.bar([i - 0.2 for i in x], [r[f"{kind}_tps"] for r in rows], 0.4, label="ours")
        ax.bar([i + 0.2 for i in x], [r[theirs] or 0 for r in rows], 0.4, label="llama.cpp")
        ax.set_xticks(list(x), [f"{r['key']}\n{r['dtype']}" for r in rows], fontsize=7)
        ax.set(ylabel="tokens/s", title=f"{kind} (goal {GOALS[kind]:g}x llama.cpp)")
        ax.legend(fontsize=8)
    fig.suptitle(f"python -m benchmarks decode-llama ({result['machine']['device']}, {result['threads']} threads)")
    fig.tight_layout()
    return _plot.save(fig, path, dpi=110)
