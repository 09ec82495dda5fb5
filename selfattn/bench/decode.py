"""``selfattn bench decode``: tokens per second generating after a prompt, GPT-2 shaped.

Three ways to decode greedily with the same weights (random GPT-2-small-shaped weights
built offline: a ``GPT2Config``, a randomly initialised ``GPT2LMHeadModel``, converted by
:func:`selfattn.hf.from_hf`; nothing is downloaded):

- ``kv-cache``: our ``GPT.generate``: the prompt prefilled once, then one token per step
  against the preallocated KV cache, on a model prepared for inference as ``docs/gpt.md`` shows
  (``model.eval().decode_layout()``: the same values, weights in (in, out) memory order);
- ``no-cache``: our GPT without a cache: every step runs the whole sequence again;
- ``hf-generate``: ``transformers``' ``generate`` (greedy, its own cache).

tokens/s = new tokens / wall time, prefill included. ``kv-cache`` and ``hf-generate`` are
timed over interleaved repetitions after a short warm-up. A no-cache step costs what its
context length costs, so instead of running all (slow) steps, one step is timed at each
of ``no_cache_samples`` context lengths spaced evenly over the generation (midpoints of
equal slices) and the total is the midpoint-rule sum; the row says ``estimated``.

Before timing: our logits equal transformers' on the same tokens, and our cached,
token-by-token logits equal our full-sequence logits (teacher forcing).
"""
from __future__ import annotations

from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from selfattn import _plot
from selfattn._validate import positive_ints
from selfattn.bench import common
from selfattn.model import GPT, GPTConfig

IMPLS = ("kv-cache", "no-cache", "hf-generate")


@dataclass
class Settings:
    n_layer: int = 12  # GPT-2 small
    n_head: int = 12
    n_embd: int = 768
    vocab_size: int = 50257
    block_size: int = 1024
    prompts: tuple[int, ...] = (16, 768)  # prompt lengths; 768 + 256 new = 1024 tokens of context
    new_tokens: int = 256  # tokens generated after each prompt
    reps: int = 3  # timed generations per implementation (median reported)
    warmup_tokens: int = 8  # tokens of the untimed warm-up generation
    no_cache_samples: int = 8  # context lengths at which a no-cache step is timed
    check_tokens: int = 16  # teacher-forced positions in the correctness check

    def check(self) -> None:
        positive_ints(**{name: v for name, v in asdict(self).items() if name != "prompts"})
        too_long = [P for P in self.prompts if P <= 0 or P + self.new_tokens > self.block_size]
        if not self.prompts or too_long:
            raise ValueError(f"prompt lengths must be positive with prompt + new_tokens={self.new_tokens} <= "
                             f"block_size={self.block_size}; bad: {too_long or 'none given'}")


FULL = Settings()
QUICK = Settings(n_layer=2, n_head=2, n_embd=64, vocab_size=512, block_size=128, prompts=(8, 96), new_tokens=32,
                 no_cache_samples=4, check_tokens=8)


def models(settings: Settings, device: torch.device):
    """(ours, transformers' model or None, why None): the same random GPT-2 weights."""
    try:
        import transformers
    except ImportError as e:
        torch.manual_seed(0)
        ours = GPT(GPTConfig(vocab_size=settings.vocab_size, block_size=settings.block_size,
                             n_layer=settings.n_layer, n_head=settings.n_head, n_embd=settings.n_embd, bias=True))
        return ours.to(device).eval().decode_layout(), None, f"needs transformers ({e}): pip install 'selfattn[hf]'"
    from selfattn.hf import from_hf
    config = transformers.GPT2Config(vocab_size=settings.vocab_size, n_positions=settings.block_size,
                                     n_embd=settings.n_embd, n_layer=settings.n_layer, n_head=settings.n_head,
                                     attn_pdrop=0.0, resid_pdrop=0.0, embd_pdrop=0.0,
                                     bos_token_id=None, eos_token_id=None)  # no early stop: every run is full length
    torch.manual_seed(0)
    hf = transformers.GPT2LMHeadModel(config).to(device).eval()
    return from_hf(hf).eval().decode_layout(), hf, None


def run(settings: Settings, device: torch.device, *, log=print) -> dict:
    settings.check()
    info = common.machine(device)
    log(common.describe(info))
    ours, hf, hf_missing = models(settings, device)
    log(f"model: GPT-2 shaped, {settings.n_layer} layers, C={settings.n_embd}, H={settings.n_head}, "
        f"V={settings.vocab_size}: {ours.num_params() / 1e6:.1f}M parameters (random weights), "
        f"attention backend {ours.config.backend}")
    g = torch.Generator().manual_seed(0)
    rows, checks = [], []
    for P in settings.prompts:
        idx = torch.randint(settings.vocab_size, (1, P), generator=g).to(device)  # (1, P)
        check = _check(ours, hf, idx, settings)
        timed, check["greedy_warmup_tokens_agree"] = _time_prompt(ours, hf, hf_missing, idx, settings, device, log)
        checks.append(check)
        rows += timed
    result = {"suite": "decode", "machine": info, "settings": asdict(settings),
              "params": ours.num_params(), "checks": checks, "results": rows}
    result["targets"] = targets(result)
    return result


@torch.inference_mode()
def _check(ours: GPT, hf, idx: torch.Tensor, settings: Settings) -> dict:
    """Logits ours vs transformers (full sequence), and cached vs full (teacher forcing)."""
    P, k = idx.shape[1], settings.check_tokens
    seq = torch.cat([idx, torch.randint(settings.vocab_size, (1, k), device=idx.device)], dim=1)  # (1, P + k)
    full = ours(seq)[0]  # (1, P + k, V)
    out = {"prompt": P}
    if hf is not None:
        out["vs_hf_err"] = common.check_close(f"decode: our logits vs transformers' (prompt {P})",
                                              full, hf(seq).logits, torch.float32)
    cache = ours.new_cache(1, P + k)
    steps = [ours(seq[:, :P], cache=cache)[0][:, -1]]  # (1, V) after the prompt
    steps += [ours(seq[:, i:i + 1], cache=cache)[0][:, -1] for i in range(P, P + k - 1)]
    out["cache_err"] = common.check_close(f"decode: cached step logits vs full-sequence logits (prompt {P})",
                                          torch.stack(steps, 1), full[:, P - 1:P + k - 1], torch.float32)
    return out


def _generate(ours: GPT, idx: torch.Tensor, n: int) -> torch.Tensor:
    return torch.stack(list(ours.generate(idx, n, temperature=0.0)), dim=1)  # (1, n)


def _hf_generate(hf, idx: torch.Tensor, n: int) -> torch.Tensor:
    out = hf.generate(idx, attention_mask=torch.ones_like(idx), max_new_tokens=n, do_sample=False, use_cache=True)
    return out[:, idx.shape[1]:]  # (1, n)


@torch.inference_mode()
def _no_cache_step(ours: GPT, seq: torch.Tensor) -> torch.Tensor:
    return ours(seq)[0][:, -1].argmax(dim=-1)  # (1,) greedy, from the whole sequence again


def _time_prompt(ours, hf, hf_missing, idx, settings: Settings, device, log) -> tuple[list[dict], bool | None]:
    """Rows for one prompt, and whether our and transformers' greedy warm-up tokens agree."""
    P, N = idx.shape[1], settings.new_tokens
    fns = {"kv-cache": lambda: _generate(ours, idx, N)}
    if hf is not None:
        fns["hf-generate"] = lambda: _hf_generate(hf, idx, N)
    # warm-up: a short greedy generation each (whether the greedy tokens agree is recorded, not
    # required: a near-tie between two logits may break either way under other rounding)
    w = settings.warmup_tokens
    warm = {"kv-cache": _generate(ours, idx, w)}
    if hf is not None:
        warm["hf-generate"] = _hf_generate(hf, idx, w)
    _no_cache_step(ours, idx)
    agree = all(torch.equal(t, warm["kv-cache"]) for t in warm.values())
    times, _ = common.interleaved(fns, device, warmup=0, reps=settings.reps)
    rows = []
    for name, ts in times.items():
        t = common.median(ts)
        rows.append({"impl": name, "prompt": P, "context": P + N, "status": "ok", "new_tokens": N,
                     "time_s": t, "times_s": ts, "tokens_per_s": N / t, "estimated": False})
    # no-cache: one step at the midpoint of each of K equal slices of the N steps
    K = min(settings.no_cache_samples, N)
    gen = torch.Generator().manual_seed(P)
    full = torch.cat([idx, torch.randint(settings.vocab_size, (1, N), generator=gen).to(idx.device)], dim=1)
    lengths = [P + int((k + 0.5) * N / K) for k in range(K)]  # context length of each sampled step
    step_s = [common.timed(lambda L=L: _no_cache_step(ours, full[:, :L]), device)[0] for L in lengths]
    total = sum(step_s) * N / K
    rows.append({"impl": "no-cache", "prompt": P, "context": P + N, "status": "ok", "new_tokens": N,
                 "time_s": total, "times_s": step_s, "sampled_lengths": lengths, "tokens_per_s": N / total,
                 "estimated": True})
    if hf is None:
        rows.append({"impl": "hf-generate", "prompt": P, "context": P + N, "status": "unavailable",
                     "reason": hf_missing})
    fastest = max(r["tokens_per_s"] for r in rows if r["status"] == "ok")
    for r in rows:
        if r["status"] == "ok":
            r["ratio_to_fastest"] = r["tokens_per_s"] / fastest
    log(f"prompt {P}: " + ", ".join(f"{r['impl']} {r['tokens_per_s']:.1f} tok/s" for r in rows if r["status"] == "ok"))
    return rows, agree if hf is not None else None


def targets(result: dict) -> list[dict]:
    by = {(r["impl"], r["prompt"]): r for r in result["results"] if r["status"] == "ok"}
    prompts = sorted({r["prompt"] for r in result["results"]})
    vs_hf = [(by[("kv-cache", P)]["tokens_per_s"] / by[("hf-generate", P)]["tokens_per_s"], P)
             for P in prompts if ("hf-generate", P) in by]
    long = [P for P in prompts if by[("kv-cache", P)]["context"] >= 1024]
    vs_nc = [(by[("kv-cache", P)]["tokens_per_s"] / by[("no-cache", P)]["tokens_per_s"], P) for P in long]
    return [
        common.target("kv-cache decoding >= 2x transformers' generate (same weights)",
                      None if not vs_hf else min(r for r, _ in vs_hf) >= 2.0,
                      "not measured" if not vs_hf else ", ".join(f"{r:.2f}x (prompt {P})" for r, P in vs_hf)),
        common.target("kv-cache decoding >= 10x no-cache at 1024 tokens of context",
                      None if not vs_nc else min(r for r, _ in vs_nc) >= 10.0,
                      "not measured (no context >= 1024 in this run)" if not vs_nc
                      else ", ".join(f"{r:.1f}x (prompt {P} + {result['settings']['new_tokens']})" for r, P in vs_nc)),
    ]


def report(result: dict) -> str:
    s = result["settings"]
    body = []
    for r in result["results"]:
        if r["status"] == "ok":
            body.append([r["impl"], str(r["prompt"]), str(r["context"]), f"{r['tokens_per_s']:.1f}",
                         f"{r['ratio_to_fastest']:.2f}", "estimated from sampled steps" if r["estimated"] else ""])
        else:
            body.append([r["impl"], str(r["prompt"]), str(r["context"]), "n/a", "", r["reason"]])
    checks = "; ".join(f"prompt {c['prompt']}: cached vs full {c['cache_err']:.1e}"
                       + (f", ours vs transformers {c['vs_hf_err']:.1e}" if "vs_hf_err" in c else "")
                       for c in result["checks"])
    return "\n".join([
        "", f"decode: greedy, batch 1, {s['new_tokens']} new tokens, {result['params'] / 1e6:.1f}M parameters; "
            f"tokens/s (higher is better) and x the fastest",
        common.table(["impl", "prompt", "context", "tok/s", "x fastest", "note"], body),
        f"checks (relative logit error): {checks}", "", common.format_targets(result["targets"])])


def plot(result: dict, path: Path) -> Path:
    rows = [r for r in result["results"] if r["status"] == "ok"]
    prompts = sorted({r["prompt"] for r in rows})
    fig = _plot.figure(figsize=(8, 4.5))
    ax = fig.subplots()
    width = 0.8 / len(IMPLS)
    for i, name in enumerate(IMPLS):
        vals = [next((r["tokens_per_s"] for r in rows if r["impl"] == name and r["prompt"] == P), 0.0)
                for P in prompts]
        ax.bar([j + i * width for j in range(len(prompts))], vals, width, label=name)
    ax.set_xticks([j + width * (len(IMPLS) - 1) / 2 for j in range(len(prompts))],
                  [f"prompt {P} + {result['settings']['new_tokens']}" for P in prompts])
    ax.set(yscale="log", ylabel="tokens/s", title=f"selfattn bench decode ({result['machine']['device']})")
    ax.legend()
    fig.tight_layout()
    return _plot.save(fig, path, dpi=110)
