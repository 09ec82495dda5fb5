"""``python -m benchmarks int8``: what weight-only int8 (:mod:`selfattn.generation.int8`) costs in accuracy,
and buys in decode speed, on a real model (default: SmolLM2-135M-Instruct's GGUF file).

:func:`accuracy`: on windows of the built-in corpus (Python's ``pydoc_data`` topics, the text
``selfattn train`` uses), tokenized by the model's own tokenizer, the float model's and the int8
model's perplexity, and how often their next-token choices (argmax) agree, the windows read
through the cache a few tokens at a time as decoding reads them (the int8 products of a few rows
take another kernel than a prompt's).
:func:`decode_speed`: batch-1 greedy decode time per token of both, each eager and compiled
(``compile_decode``), and the bytes of their weights; where the model is a GGUF file and
``llama_cpp`` is importable, llama.cpp's decode time on the same file and prompt
(:mod:`benchmarks.llama_cpp`), all interleaved in one run.
"""
from __future__ import annotations

import copy
import functools
import math
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

from benchmarks import common, llama_cpp
from benchmarks.decode import DEFAULT_CKPT
from selfattn._util import plot as _plot
from selfattn._util import validate as _validate
from selfattn.generation import compile_decode, decode_layout, generate
from selfattn.generation.int8 import KERNEL_ROWS, quantize_int8
from selfattn.model import GPT
from selfattn.training.data import read_corpus


def int8_twin(model: GPT) -> GPT:
    """A weight-only int8 copy of ``model`` (the model itself untouched)."""
    return quantize_int8(copy.deepcopy(model)).eval()


@torch.inference_mode()
def accuracy(model: GPT, twin: GPT, encode, *, windows: int = 8, length: int = 256) -> dict:
    """Perplexity of ``model`` and its int8 ``twin`` over ``windows`` windows of ``length`` tokens
    of the built-in corpus (``encode``: text -> token ids), and their top-1 agreement."""
    text, _ = read_corpus(None)
    ids = torch.tensor(encode(text[: windows * length * 8]))  # 8 characters a token is plenty
    if ids.numel() < windows * (length + 1):
        raise ValueError(f"the corpus gave {ids.numel()} tokens, fewer than {windows} windows of {length + 1}")
    rows = ids[: windows * (length + 1)].view(windows, length + 1).to(model.wte.weight.device)  # (W, L + 1)
    out = {"windows": windows, "length": length}
    picks = {}
    for name, m in (("float", model), ("int8", twin)):
        logits = _as_decoded(m, rows[:, :-1]).float()  # (W, L, V)
        out[f"perplexity_{name}"] = math.exp(F.cross_entropy(logits.flatten(0, 1), rows[:, 1:].flatten()).item())
        picks[name] = logits.argmax(-1)  # (W, L)
    out["top1_agreement"] = (picks["float"] == picks["int8"]).float().mean().item()
    return out


def _as_decoded(model: GPT, idx: torch.Tensor) -> torch.Tensor:
    """The logits of ``idx`` (W, L) read through the cache a few tokens at a time, so that every
    product has the few rows of decoding (:data:`~selfattn.generation.int8.KERNEL_ROWS` at most): the
    int8 model is measured on the path it decodes on, not on its prompt path."""
    W, L = idx.shape
    step = max(1, KERNEL_ROWS // W)
    cache = model.new_cache(W, L)
    return torch.cat([model(idx[:, i:i + step], cache=cache)[0] for i in range(0, L, step)], dim=1)  # (W, L, V)


def weight_bytes(model: GPT) -> int:
    """Bytes of every parameter and buffer, each once."""
    seen, total = set(), 0
    for t in [*model.parameters(), *model.buffers()]:
        if id(t) not in seen:
            seen.add(id(t))
            total += t.numel() * t.element_size()
    return total


def decode_speed(model: GPT, twin: GPT, idx: torch.Tensor, new_tokens: int, device, reps: int,
                 peer: Callable[[int], object] | None = None) -> dict:
    """Seconds per decoded token (prefill excluded: the time of generating ``new_tokens`` minus
    generating one) of ``model`` and ``twin``, each eager and compiled (a copy after
    ``compile_decode()``, compiled by the untimed first round), and of ``peer`` (n -> n tokens
    after the same prompt: llama.cpp) where given, all interleaved over ``reps`` rounds."""
    models = {"float": model, "int8": twin, "float_compiled": compile_decode(copy.deepcopy(model)),
              "int8_compiled": compile_decode(copy.deepcopy(twin))}

    def gen(m, n):
        return lambda: list(generate(m, idx, n, temperature=0))

    fns = {f"{name}-{n}": gen(m, n) for name, m in models.items() for n in (1, new_tokens)}
    names = list(models)
    if peer is not None:
        names.append("llama_cpp")
        fns |= {f"llama_cpp-{n}": functools.partial(peer, n) for n in (1, new_tokens)}
    times, _ = common.interleaved(fns, device, warmup=1, reps=reps)
    out = {f"{name}_s_per_token": (common.median(times[f"{name}-{new_tokens}"]) - common.median(times[f"{name}-1"]))
           / (new_tokens - 1) for name in names}
    out["int8_speedup"] = out["float_s_per_token"] / out["int8_s_per_token"]
    out["int8_compiled_speedup"] = out["float_compiled_s_per_token"] / out["int8_compiled_s_per_token"]
    out["weight_bytes_float"], out["weight_bytes_int8"] = weight_bytes(model), weight_bytes(twin)
    return out


@dataclass
class Settings:
    ckpt: str | None = DEFAULT_CKPT  # the model; None: a small random Llama-shaped one, byte tokens
    dtype: str = "float32"  # the float model's (and the int8 model's activations')
    prompt: int = 64  # tokens before the timed decode
    new_tokens: int = 64
    reps: int = 3
    windows: int = 8  # corpus windows the accuracy is measured on
    length: int = 256  # tokens per window

    def check(self) -> None:
        _validate.positive_ints(prompt=self.prompt, new_tokens=self.new_tokens, reps=self.reps, windows=self.windows,
                                length=self.length)
        if self.new_tokens < 2:
            raise ValueError(f"new_tokens must be at least 2 (decode time = n tokens - 1 token), got {self.new_tokens}")
        if self.dtype not in common.DTYPES:
            raise ValueError(f"dtype must be one of {', '.join(common.DTYPES)}, got {self.dtype!r}")


FULL = Settings()
QUICK = Settings(ckpt=None, prompt=16, new_tokens=8, reps=1, windows=2, length=64)


def _model(settings: Settings):
    if settings.ckpt is None:
        from selfattn.config import GPTConfig
        torch.manual_seed(0)
        model = GPT(GPTConfig(vocab_size=256, block_size=512, n_layer=4, n_head=4, n_embd=128, n_kv_head=2,
                              pos="rope", norm="rmsnorm", mlp_kind="swiglu", tie_embeddings=False))
        return model.eval(), lambda text: list(text.encode()), "random Llama-shaped (4 layers, C=128)"
    from selfattn.io.loading import load
    loaded = load(settings.ckpt)
    return loaded.model.eval(), loaded.require_tokenizer().encode, str(loaded.source)


def run(settings: Settings, device: torch.device, *, log=print) -> dict:
    settings.check()
    info = common.machine(device)
    log(common.describe(info))
    model, encode, name = _model(settings)
    model = decode_layout(model.to(device=device, dtype=common.DTYPES[settings.dtype]))  # as `selfattn sample`
    twin = int8_twin(model)
    log(f"model: {name}, {model.num_params() / 1e6:.1f}M parameters, {settings.dtype} and weight-only int8")
    acc = accuracy(model, twin, encode, windows=settings.windows, length=settings.length)
    idx = torch.randint(model.config.vocab_size, (1, settings.prompt), generator=torch.Generator().manual_seed(0))
    why = llama_cpp.unavailable(settings.ckpt)
    run_peer, peer = None, {"status": "unavailable", "reason": why}
    if why is None:
        log("llama.cpp: decoding the same file, timed among our rows")
        run_peer, ran = llama_cpp.greedy(settings.ckpt, idx[0].tolist(), settings.new_tokens)
        peer = {"status": "ok", "file_bytes": Path(settings.ckpt).stat().st_size, **ran}
    speed = decode_speed(model, twin, idx.to(device), settings.new_tokens, device, settings.reps, run_peer)
    if run_peer is not None:
        peer["s_per_token"] = speed.pop("llama_cpp_s_per_token")
    result = {"suite": "int8", "machine": info, "settings": asdict(settings), "model": name,
              "accuracy": acc, "speed": speed, "llama_cpp": peer}
    speedups = f"{speed['int8_speedup']:.2f}x eager, {speed['int8_compiled_speedup']:.2f}x compiled"
    result["targets"] = [common.target("int8 decodes faster than the float model (batch 1)",
                                       min(speed["int8_speedup"], speed["int8_compiled_speedup"]) > 1.0, speedups)]
    if why is None:
        ours, theirs = min(speed["int8_s_per_token"], speed["int8_compiled_s_per_token"]), peer["s_per_token"]
        result["targets"].append(common.target("int8 decodes at least as fast as llama.cpp on the same file "
                                               "(batch 1, moonshot)", theirs >= ours,
                                               f"{theirs / ours:.2f}x ({ours * 1e3:.1f} against {theirs * 1e3:.1f} "
                                               f"ms a token)"))
    return result


def report(result: dict) -> str:
    a, s = result["accuracy"], result["speed"]
    body = [["float", f"{a['perplexity_float']:.3f}", "", f"{s['float_s_per_token'] * 1e3:.1f}",
             f"{s['weight_bytes_float'] / 1e6:.0f}"],
            ["int8", f"{a['perplexity_int8']:.3f}", f"{a['top1_agreement']:.3f}", f"{s['int8_s_per_token'] * 1e3:.1f}",
             f"{s['weight_bytes_int8'] / 1e6:.0f}"],
            ["float, compiled", "", "", f"{s['float_compiled_s_per_token'] * 1e3:.1f}", ""],
            ["int8, compiled", "", "", f"{s['int8_compiled_s_per_token'] * 1e3:.1f}", ""]]
    peer = result.get("llama_cpp", {"status": "unavailable", "reason": "not measured"})
    if peer["status"] == "ok":
        body.append([f"llama.cpp {peer['version']} (the file)", "", "", f"{peer['s_per_token'] * 1e3:.1f}",
                     f"{peer['file_bytes'] / 1e6:.0f}"])
    return "\n".join([
        "", f"int8: {result['model']}, {result['settings']['dtype']}; perplexity on {a['windows']} x {a['length']} "
            f"tokens of the built-in corpus, batch-1 decode ms/token (prefill excluded)",
        common.table(["weights", "perplexity", "top-1 = float", "ms/token", "weight MB"], body),
        *([f"llama.cpp: not measured, {peer['reason']}"] if peer["status"] != "ok" else []),
        "", common.format_targets(result["targets"])])


def plot(result: dict, path: Path) -> Path:
    s = result["speed"]
    fig = _plot.figure(figsize=(7, 4))
    ax = fig.subplots()
    bars = {"float": s["float_s_per_token"], "int8": s["int8_s_per_token"],
            "float\ncompiled": s["float_compiled_s_per_token"], "int8\ncompiled": s["int8_compiled_s_per_token"]}
    if result.get("llama_cpp", {}).get("status") == "ok":
        bars["llama.cpp"] = result["llama_cpp"]["s_per_token"]
    ax.bar(list(bars), [t * 1e3 for t in bars.values()])
    ax.set(ylabel="ms per decoded token", title=f"python -m benchmarks int8 ({result['machine']['device']})")
    fig.tight_layout()
    return _plot.save(fig, path, dpi=110)
