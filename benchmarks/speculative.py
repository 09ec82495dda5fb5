"""``python -m benchmarks speculative``: speculative decoding on a real model, against plain decoding.

On one model (default: SmolLM2-135M-Instruct's GGUF file, ``make models``), greedy, batch 1, two
workloads, each a chat-templated request: ``chat``, an open-ended answer, and ``edit``, a Python
file of about 400 tokens with the instruction to rewrite it with one change (the answer repeats
most of the prompt). Rows, in one run:

- ``plain``: our ``generate``; ``lookup``: prompt lookup; ``self:N``: the model's first N blocks
  draft (:mod:`selfattn.generation.speculative`); each eager, and compiled (``compiled`` true: a copy of the
  model after ``compile_decode()``, whose untimed first runs compile its graphs);
- ``hf-plain`` and ``hf-lookup``: ``transformers``' ``generate`` on the same weights (SDPA
  attention), plain and with ``prompt_lookup_num_tokens``.

Every row stops at the model's end-of-answer token (or after ``new_tokens``) and is timed over
``reps`` interleaved runs, prefill included; tokens/s = tokens generated / median time. A
speculative row must give plain greedy's tokens exactly (a CorrectnessError otherwise); the
peers' agreement with ours is recorded. Per row: tokens/s, x plain, tokens per verification
forward (tokens / forwards after the prefill), and the fraction of the memory roofline: plain
decoding reads the weights plus the cache once per token (:func:`benchmarks.decode.roofline`),
so bytes per token x tokens/s over the streaming bandwidth measured in this run; a speculative
row can pass 1.0, which is the point. The prompt's forward (each run's time to its first token) is
the same work in every row of ours and speculation cannot shorten it; our rows also give the
decoding alone: the tokens after the first over the median of each run's time after its first
token (``decode x plain``).
"""
from __future__ import annotations

import copy
import functools
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from benchmarks import common
from benchmarks.decode import DEFAULT_CKPT, hf_twin, roofline
from selfattn._util import plot as _plot
from selfattn._util import validate as _validate
from selfattn.config import GPTConfig
from selfattn.generation import compile_decode, decode_layout, generate
from selfattn.generation.speculative import Speculative
from selfattn.model import GPT

OURS = ("plain", "lookup", "self")
PEERS = ("hf-plain", "hf-lookup")
EDIT_SOURCE = '''import math
from dataclasses import dataclass


@dataclass
class Stats:
    count: int
    mean: float
    stdev: float
    low: float
    high: float


def moving_average(values, window):
    """The mean of each run of `window` consecutive values."""
    if window <= 0:
        raise ValueError(f"window must be positive, got {window}")
    if len(values) < window:
        return []
    total = sum(values[:window])
    out = [total / window]
    for i in range(window, len(values)):
        total += values[i] - values[i - window]
        out.append(total / window)
    return out


def describe(values):
    """Count, mean, standard deviation, minimum and maximum of `values`."""
    if not values:
        raise ValueError("describe needs at least one value")
    n = len(values)
    mean = sum(values) / n
    var = sum((v - mean) ** 2 for v in values) / (n - 1) if n > 1 else 0.0
    return Stats(count=n, mean=mean, stdev=math.sqrt(var), low=min(values), high=max(values))


def normalise(values):
    """Values shifted and scaled to mean 0 and standard deviation 1."""
    stats = describe(values)
    if stats.stdev == 0:
        return [0.0 for _ in values]
    return [(v - stats.mean) / stats.stdev for v in values]


def histogram(values, bins):
    """Counts of `values` in `bins` equal intervals between their minimum and maximum."""
    stats = describe(values)
    width = (stats.high - stats.low) / bins or 1.0
    counts = [0] * bins
    for v in values:
        counts[min(int((v - stats.low) / width), bins - 1)] += 1
    return counts
'''
WORKLOADS = {
    "chat": "Write a short story about a lighthouse keeper who finds a message in a bottle.",
    "edit": "Rewrite this Python file, renaming the function moving_average to rolling_mean everywhere. "
            "Reply with the whole file and nothing else.\n\n```python\n" + EDIT_SOURCE + "```",
}


@dataclass
class Settings:
    ckpt: str | None = DEFAULT_CKPT  # the model; None: a small random Llama-shaped one (no chat template)
    dtype: str = "float32"
    workloads: tuple[str, ...] = ("chat", "edit")
    new_tokens: int = 256  # at most, per row: each stops at the model's end of answer
    self_layers: int = 0  # N of self:N; 0 = a quarter of the model's blocks
    lookup_tokens: int = 10  # transformers' prompt_lookup_num_tokens
    reps: int = 3  # timed runs per row, interleaved; the median leaves a slow run out (one took 9.84 s, 8.15 the other)
    bandwidth_mib: int = 1024  # size of the streaming-bandwidth test

    def check(self) -> None:
        _validate.positive_ints(new_tokens=self.new_tokens, lookup_tokens=self.lookup_tokens, reps=self.reps,
                                bandwidth_mib=self.bandwidth_mib)
        _validate.count("self_layers", self.self_layers)
        unknown = [w for w in self.workloads if w not in WORKLOADS]
        if not self.workloads or unknown:
            raise ValueError(f"workloads must be some of {', '.join(WORKLOADS)}, got {list(self.workloads)}")
        if self.dtype not in common.DTYPES:
            raise ValueError(f"dtype must be one of {', '.join(common.DTYPES)}, got {self.dtype!r}")


FULL = Settings()
QUICK = Settings(ckpt=None, new_tokens=24, reps=1, bandwidth_mib=64)


def _model(settings: Settings) -> tuple[GPT, object, tuple[int, ...], str]:
    """(model in eval mode, what writes a workload's prompt as token ids, end-of-answer tokens, its name)."""
    if settings.ckpt is None:
        torch.manual_seed(0)
        model = GPT(GPTConfig(vocab_size=256, block_size=1024, n_layer=4, n_head=4, n_embd=64, n_kv_head=2,
                              pos="rope", norm="rmsnorm", mlp_kind="swiglu", tie_embeddings=False))
        return model.eval(), lambda text: list(text.encode())[:300], (), "random Llama-shaped (4 layers, C=64)"
    from selfattn.io.loading import load
    loaded = load(settings.ckpt)
    tokenizer, chat = loaded.require_tokenizer(), loaded.require_chat()
    encode = lambda text: tokenizer.encode(chat.render([{"role": "user", "content": text}]))
    return loaded.model.eval(), encode, loaded.eos, str(loaded.source)


def run(settings: Settings, device: torch.device, *, log=print) -> dict:
    settings.check()
    info = common.machine(device)
    log(common.describe(info))
    model, encode, eos, name = _model(settings)
    model = decode_layout(model.to(device=device, dtype=common.DTYPES[settings.dtype]))  # as `selfattn sample`
    hf, hf_missing = hf_twin(model)
    N = settings.self_layers or max(1, model.config.n_layer // 4)
    bandwidth = common.stream_bandwidth(device, settings.bandwidth_mib << 20)
    log(f"model: {name}, {model.num_params() / 1e6:.1f}M parameters, {settings.dtype}; "
        f"streaming bandwidth {bandwidth['gbps']:.1f} GB/s")
    models = {"": model, " compiled": compile_decode(copy.deepcopy(model))}
    rows, checks = [], []
    for workload in settings.workloads:
        idx = torch.tensor([encode(WORKLOADS[workload])], device=device)  # (1, P)
        rows_w, check = _workload(models, hf, hf_missing, idx, eos, N, settings, device, bandwidth)
        log(f"{workload} (prompt {idx.shape[1]} tokens, {check['tokens']} generated): "
            + ", ".join(f"{_name(r)} {r['tokens_per_s']:.1f} tok/s" for r in rows_w if r["status"] == "ok"))
        rows += [dict(r, workload=workload) for r in rows_w]
        checks.append(dict(check, workload=workload))
    result = {"suite": "speculative", "machine": info, "settings": asdict(settings), "model": name,
              "self_layers": N, "bandwidth": bandwidth, "checks": checks, "results": rows}
    result["targets"] = targets(result)
    return result


def _workload(models: dict[str, GPT], hf, hf_missing, idx, eos, N: int, settings: Settings, device, bandwidth):
    """Rows of one prompt, and what was checked: every row of ours gives plain's tokens.
    ``models``: ``{"": the model, " compiled": its compiled copy}``, the row names' suffixes."""
    n, stop = settings.new_tokens, eos[0] if eos else None
    fns, specs, rows_of = {}, {}, {}  # by row name: the run, its Speculative, (impl, compiled)
    firsts = {}  # by row name of ours: each run's seconds to its first token, the prompt's forward

    def ours(name, model, spec):
        out, start = [], time.perf_counter()
        for tok in generate(model, idx, n, temperature=0, eos_token=stop, speculative=spec):
            if not out:
                common.sync(device)
                firsts[name].append(time.perf_counter() - start)
            out.append(tok)
        return torch.stack(out, 1)  # (1, n or fewer)

    for suffix, model in models.items():
        for impl, how in (("plain", None), ("lookup", "lookup"), (f"self:{N}", f"self:{N}")):
            spec = None if how is None else Speculative(how)
            fns[impl + suffix] = functools.partial(ours, impl + suffix, model, spec)
            firsts[impl + suffix] = []
            specs[impl + suffix], rows_of[impl + suffix] = spec, (impl, bool(suffix))
    if hf is not None:
        def theirs(**kw):
            out = hf.generate(idx, attention_mask=torch.ones_like(idx), max_new_tokens=n, do_sample=False,
                              eos_token_id=stop, pad_token_id=0, **kw)
            return out[:, idx.shape[1]:]
        fns["hf-plain"] = theirs
        fns["hf-lookup"] = lambda: theirs(prompt_lookup_num_tokens=settings.lookup_tokens)
    plain, outs = fns["plain"](), {}  # the warm-up, and the tokens every row of ours must give
    for name, fn in fns.items():  # the warm-up of every row: the compiled ones compile here
        got = outs[name] = fn()
        if name in rows_of and not torch.equal(got, plain):
            raise common.CorrectnessError(f"{name}: {got.tolist()} are not plain greedy decoding's tokens "
                                          f"{plain.tolist()}")
    for spec in specs.values():
        if spec is not None:
            spec.stats = type(spec.stats)()  # count the timed runs only
    times, _ = common.interleaved(fns, device, warmup=0, reps=settings.reps)
    prefill = {name: ts[-settings.reps:] for name, ts in firsts.items()}  # the timed runs' times to a token
    after = {name: common.median([t - f for t, f in zip(times[name], prefill[name])])
             for name in rows_of}  # each timed run's seconds after its first token
    tokens = plain.shape[1]
    per_token = roofline(models[""], 1, idx.shape[1], max(tokens, 2))["bytes_per_step"]
    rate = {name: tokens / common.median(ts) for name, ts in times.items()}
    decode_rate = {name: (tokens - 1) / after[name] for name in rows_of}
    rows = []
    for name, ts in times.items():
        impl, compiled = rows_of.get(name, (name, False))
        base = "plain compiled" if compiled else "plain"  # x plain: against plain decoding run alike
        row = {"impl": impl, "compiled": compiled, "status": "ok", "prompt": idx.shape[1], "tokens": tokens,
               "time_s": common.median(ts), "times_s": ts, "tokens_per_s": rate[name],
               "x_plain": rate[name] / rate[base], "bytes_per_token": per_token,
               "roofline_fraction": per_token * rate[name] / (bandwidth["gbps"] * 1e9)}
        if name in rows_of:  # the tokens after the first, over the time after our prefill
            row |= {"prefill_s": common.median(prefill[name]), "decode_tokens_per_s": decode_rate[name],
                    "decode_x_plain": decode_rate[name] / decode_rate[base]}
        if specs.get(name) is not None:
            stats = specs[name].stats
            rounds = stats.forwards - settings.reps  # each run's prefill is one forward
            row |= {"tokens_per_forward": stats.tokens / max(rounds, 1), "acceptance_rate": stats.acceptance_rate}
        if name in PEERS:
            row["same_tokens"] = bool(torch.equal(outs[name], plain))
        rows.append(row)
    for name in PEERS:
        if hf is None:
            rows.append({"impl": name, "compiled": False, "status": "unavailable", "reason": hf_missing})
    return rows, {"tokens": tokens, "speculative_rows_give_plain_tokens": True}


def targets(result: dict) -> list[dict]:
    """The issue's targets, each on our faster row of an impl (eager or compiled)."""
    best = {}  # (workload, impl) -> the faster row
    for r in result["results"]:
        if r["status"] == "ok":
            held = best.get((r["workload"], r["impl"]))
            best[r["workload"], r["impl"]] = r if held is None or r["tokens_per_s"] > held["tokens_per_s"] else held
    out = []
    if ("edit", "lookup") in best:
        edit, plain = best["edit", "lookup"], best["edit", "plain"]
        ratio = edit["tokens_per_s"] / plain["tokens_per_s"]
        decode = edit["decode_tokens_per_s"] / plain["decode_tokens_per_s"]
        out.append(common.target("edit: prompt lookup >= 2.5x our plain greedy tokens/s", ratio >= 2.5,
                                 f"{ratio:.2f}x ({_name(edit)} against {_name(plain)}; decoding alone "
                                 f"{decode:.2f}x, the prompt's forward {edit['prefill_s']:.2f} s of plain's "
                                 f"{plain['time_s']:.2f})"))
        peer = best.get(("edit", "hf-lookup"))
        out.append(common.target("edit: prompt lookup >= 1.5x transformers' prompt lookup",
                                 None if peer is None else edit["tokens_per_s"] / peer["tokens_per_s"] >= 1.5,
                                 "not measured" if peer is None else
                                 f"{edit['tokens_per_s'] / peer['tokens_per_s']:.2f}x"))
    chat = [r for r in result["results"] if r["status"] == "ok" and r["workload"] == "chat"
            and r["impl"] not in PEERS and r["impl"] != "plain"]
    if chat:
        worst = min(chat, key=lambda r: r["x_plain"])
        out.append(common.target("chat: no speculative row slower than plain by more than 5%",
                                 worst["x_plain"] >= 0.95, f"worst {_name(worst)} {worst['x_plain']:.2f}x"))
    return out


def _name(row: dict) -> str:
    return row["impl"] + (" compiled" if row.get("compiled") else "")


def report(result: dict) -> str:
    body = []
    for r in result["results"]:
        if r["status"] != "ok":
            body.append([r["workload"], _name(r), "n/a", "", "", "", "", r["reason"]])
            continue
        note = "" if r.get("same_tokens") in (None, True) else "other tokens than ours"
        body.append([r["workload"], _name(r), f"{r['tokens_per_s']:.1f}", f"{r['x_plain']:.2f}",
                     f"{r['decode_x_plain']:.2f}" if "decode_x_plain" in r else "",
                     f"{r['tokens_per_forward']:.2f}" if "tokens_per_forward" in r else "",
                     f"{r['roofline_fraction']:.2f}", note])
    prompts = ", ".join(f"{c['workload']} {c['tokens']} tokens" for c in result["checks"])
    return "\n".join([
        "", f"speculative: greedy, batch 1, {result['model']}, {result['settings']['dtype']}, self:N with "
            f"N={result['self_layers']}; generated: {prompts}; bandwidth {result['bandwidth']['gbps']:.1f} GB/s",
        common.table(["workload", "impl", "tok/s", "x plain", "decode x plain", "tok/forward", "roofline", "note"],
                     body),
        "x plain: against plain decoding run alike (eager or compiled), the prompt's forward included; decode x "
        "plain: without it. Every row of ours gave plain greedy's tokens", "",
        common.format_targets(result["targets"])])


def plot(result: dict, path: Path) -> Path:
    rows = [r for r in result["results"] if r["status"] == "ok"]
    workloads = list(dict.fromkeys(r["workload"] for r in rows))
    impls = list(dict.fromkeys(_name(r) for r in rows))
    fig = _plot.figure(figsize=(9, 4.5))
    ax = fig.subplots()
    width = 0.8 / len(impls)
    for i, impl in enumerate(impls):
        vals = [next((r["tokens_per_s"] for r in rows if _name(r) == impl and r["workload"] == w), 0.0)
                for w in workloads]
        ax.bar([j + i * width for j in range(len(workloads))], vals, width, label=impl)
    ax.set_xticks([j + width * (len(impls) - 1) / 2 for j in range(len(workloads))], workloads)
    ax.set(ylabel="tokens/s", title=f"python -m benchmarks speculative ({result['machine']['device']})")
    ax.legend()
    fig.tight_layout()
    return _plot.save(fig, path, dpi=110)
