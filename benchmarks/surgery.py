"""``python -m benchmarks surgery``: attention surgery on a real model, measured (docs/finetune.md).

SmolLM2-135M-Instruct given a sliding window with sink tokens (StreamingLLM's recipe: each layer
sees the last ``window`` tokens and the first ``sink_tokens``): its perplexity on held-out text
read in long windows, before the change, right after it, and after a short fine-tune (``--tuned
RUN``: a run of ``selfattn train --init-from MODEL --set window=W --set sink_tokens=S``); and at a
long context its decode speed and the memory of its KV cache, before and after.

- Held-out text: the last ``val_fraction`` of the built-in corpus in the model's tokens, the part
  ``selfattn train`` holds out of its training on that corpus; read in disjoint windows of
  ``context`` tokens, each token predicted from the earlier ones of its window.
- Decode: ``new_tokens`` greedy tokens after a ``context``-token prompt, batch 1, float32, on one
  path for both (``generate``, eager steps through the caches: the decode kernel serves no window,
  so the best path of each would compare a kernel with graphs); tokens/s of the steps after the
  first. Cache: the bytes of the caches a decode of that length allocates (``new_cache``: a full
  one holds ``context + new_tokens`` positions per layer, a rolling one ``window + sink_tokens``).
"""
from __future__ import annotations

import dataclasses
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from benchmarks import common
from benchmarks.decode import DEFAULT_CKPT
from selfattn._util import plot as _plot
from selfattn._util import validate as _validate
from selfattn.generation import generate
from selfattn.io import carry
from selfattn.io.loading import load
from selfattn.model import GPT
from selfattn.training import data
from selfattn.training.evaluate import perplexity


@dataclass
class Settings:
    ckpt: str | None = DEFAULT_CKPT  # the model; None: a small random Llama-shaped one with byte tokens
    tuned: str | None = None  # a fine-tuned run of the changed model (None: that row is left out)
    window: int = 128
    sink_tokens: int = 4
    context: int = 2048  # tokens of an evaluation window, and of the decode's prompt
    windows: int = 4  # evaluation windows read (the held-out text's first ones)
    new_tokens: int = 32
    val_fraction: float = 0.1  # as selfattn train's default: the held-out part of the corpus
    reps: int = 2  # timed decodes of each model (median reported)

    def check(self) -> None:
        _validate.positive_ints(window=self.window, context=self.context, windows=self.windows,
                                new_tokens=self.new_tokens, reps=self.reps)
        _validate.count("sink_tokens", self.sink_tokens)
        if self.sink_tokens >= self.window or self.window >= self.context:
            raise ValueError(f"need sink_tokens < window < context, got {self.sink_tokens}, {self.window}, "
                             f"{self.context}")


FULL = Settings()
QUICK = Settings(ckpt=None, window=16, sink_tokens=2, context=96, windows=2, new_tokens=8, reps=1)


def _models(settings: Settings) -> tuple[dict[str, GPT], object, str]:
    """({"before", "after surgery"[, "after fine-tune"]}: models in float32 eval mode, the tokenizer, a name)."""
    if settings.ckpt is None:
        from selfattn.config import GPTConfig
        from selfattn.tokenizers import ByteTokenizer
        torch.manual_seed(0)
        base = GPT(GPTConfig(vocab_size=256, block_size=256, n_layer=2, n_head=4, n_embd=64, n_kv_head=2, pos="rope",
                             norm="rmsnorm", mlp_kind="swiglu", tie_embeddings=True))
        tokenizer, name = ByteTokenizer(), "random Llama-shaped (2 layers, C=64)"
    else:
        loaded = load(settings.ckpt)
        base, tokenizer, name = loaded.model, loaded.require_tokenizer(), str(loaded.source)
    changed = GPT.empty(dataclasses.replace(base.config, window=settings.window, sink_tokens=settings.sink_tokens))
    changed.load_state_dict(carry.carried(base, changed))
    models = {"before": base, "after surgery": changed}
    if settings.tuned is not None:
        tuned = load(settings.tuned)
        config = tuned.model.config
        if (config.window, config.sink_tokens) != (settings.window, settings.sink_tokens):
            raise ValueError(f"--tuned {settings.tuned} has window={config.window}, sink_tokens={config.sink_tokens}, "
                             f"not the {settings.window} and {settings.sink_tokens} measured here")
        models["after fine-tune"] = tuned.model
    return {k: m.float().eval() for k, m in models.items()}, tokenizer, name


def _held_out(tokenizer, settings: Settings) -> torch.Tensor:
    """The held-out tokens: the last ``val_fraction`` of the built-in corpus, ``windows`` windows of them."""
    text, _ = data.read_corpus(None)
    ids = torch.tensor(tokenizer.encode(text))  # (N,)
    held = ids[len(ids) - int(len(ids) * settings.val_fraction):]
    need = settings.windows * settings.context
    if len(held) < need:
        raise ValueError(f"the held-out text has {len(held)} tokens, fewer than {settings.windows} windows of "
                         f"{settings.context}")
    return held[:need]


def _decode(model: GPT, prompt: torch.Tensor, new_tokens: int) -> float:
    """Seconds of the decode steps after the first token (the prefill's), greedy, batch 1."""
    steps = generate(model, prompt[None], new_tokens, temperature=0)
    next(steps)  # the prefill and the first token
    start = time.perf_counter()
    for _ in steps:
        pass
    return time.perf_counter() - start


def _cache_bytes(model: GPT, length: int) -> int:
    return sum(t.numel() * t.element_size() for c in model.new_cache(1, length) for t in (c.k, c.v))


def run(settings: Settings, device: torch.device, *, log=print) -> dict:
    settings.check()
    if device.type != "cpu":
        raise ValueError("the surgery suite runs on the CPU (its decode is timed eagerly, step by step)")
    info = common.machine(device)
    log(common.describe(info))
    models, tokenizer, name = _models(settings)
    held = _held_out(tokenizer, settings)
    log(f"model: {name}; window {settings.window} + {settings.sink_tokens} sink tokens; "
        f"{settings.windows} windows of {settings.context} held-out tokens")
    rows = []
    for label, model in models.items():
        e = perplexity(model, held, context=settings.context)
        rows.append({"model": label, "perplexity": e.perplexity, "loss": e.loss, "tokens": e.tokens,
                     "cache_bytes": _cache_bytes(model, settings.context + settings.new_tokens)})
        log(f"{label}: perplexity {e.perplexity:.3f}")
    prompt = held[:settings.context]
    timed = {label: models[label] for label in ("before", "after surgery")}
    times, _ = common.interleaved({label: (lambda m=m: _decode(m, prompt, settings.new_tokens))
                                   for label, m in timed.items()}, device, warmup=1, reps=settings.reps)
    for row in rows:
        if row["model"] in times:  # the fine-tuned model decodes as the changed one: the same shapes
            row["decode_tokens_per_s"] = (settings.new_tokens - 1) / common.median(times[row["model"]])
    return {"suite": "surgery", "machine": info, "settings": asdict(settings), "model": name, "results": rows}


def report(result: dict) -> str:
    s = result["settings"]
    body = [[r["model"], f"{r['perplexity']:.3f}", f"{r['cache_bytes'] / 2 ** 20:.1f}",
             f"{r['decode_tokens_per_s']:.1f}" if "decode_tokens_per_s" in r else "as after surgery"]
            for r in result["results"]]
    return "\n".join([
        "", f"surgery: {result['model']}, window {s['window']} + {s['sink_tokens']} sink tokens; perplexity over "
            f"{s['windows']} x {s['context']} held-out tokens; decode of {s['new_tokens']} tokens after "
            f"{s['context']}, batch 1, float32, eager",
        common.table(["model", "perplexity", "KV cache MiB", "decode tok/s"], body)])


def plot(result: dict, path: Path) -> Path:
    rows = result["results"]
    fig = _plot.figure(figsize=(6, 4))
    ax = fig.subplots()
    ax.bar([r["model"] for r in rows], [r["perplexity"] for r in rows], color=["C0", "C1", "C2"][:len(rows)])
    ax.set(ylabel="perplexity (held-out text)", title=f"python -m benchmarks surgery: window "
                                                      f"{result['settings']['window']} + "
                                                      f"{result['settings']['sink_tokens']} sinks")
    fig.tight_layout()
    return _plot.save(fig, path, dpi=110)
