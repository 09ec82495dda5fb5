"""``python -m benchmarks finetune``: a fine-tuning step, ours vs ``transformers`` (+ ``peft`` for LoRA).

The model is SmolLM2-135M-Instruct (its GGUF file, dequantised to float32; ``--quick``: a small random
Llama-shaped model) and its ``transformers`` twin holding the same tensors
(:func:`benchmarks.decode.hf_twin`, ``LlamaForCausalLM`` with its default SDPA attention). Rows: full
fine-tuning and LoRA (rank 16 on the attention projections, alpha 32: ours :mod:`selfattn.lora`,
theirs ``peft.get_peft_model``), in float32 and under bfloat16 autocast (weights and AdamW state in
float32 for both). A step is ``zero_grad``, forward with the loss, backward and an AdamW update of the
trainable parameters, on one fixed batch of random tokens; tokens/s = B·T / median step time over
interleaved repetitions, after warm-up steps (the first allocates AdamW's state). Peak memory: what
one step adds to the resident set (or the accelerator's allocator), activations, gradients and the
loss's logits included, the weights and optimizer state already allocated left out
(:class:`benchmarks.common.PeakMemory`).

Before timing, for each row: the two losses agree, and so do the gradients of every trainable tensor
(LoRA: our adapters copied into peft's, B randomised so that every gradient is non-zero).

Targets (the fine-tuning issue): ours at least 1.3x their tokens/s in every row; our peak memory at
most 0.8x theirs for LoRA.
"""
from __future__ import annotations

import copy
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from benchmarks import common
from benchmarks.decode import DEFAULT_CKPT, hf_twin
from selfattn import lora
from selfattn._util import plot as _plot
from selfattn._util import validate as _validate
from selfattn.config import GPTConfig
from selfattn.formats import peft as peft_format
from selfattn.model import GPT

IMPLS = ("selfattn", "transformers")
MODES = ("full", "lora")
SPEEDUP, LORA_MEMORY = 1.3, 0.8  # the targets: tokens/s ratio at least, LoRA peak memory ratio at most


@dataclass
class Settings:
    ckpt: str | None = DEFAULT_CKPT  # the model; None: a small random Llama-shaped one
    seq_len: int = 512  # T per row
    batch_size: int = 2  # B rows per step
    rank: int = 16  # LoRA's rank (alpha = 2 * rank)
    dtypes: tuple[str, ...] = ("float32", "bfloat16")  # float32, or bfloat16 autocast over float32 weights
    warmup: int = 1  # untimed steps of each row
    reps: int = 3  # timed steps of each row (median reported)
    memory: bool = True  # measure each step's peak memory

    def check(self) -> None:
        _validate.positive_ints(seq_len=self.seq_len, batch_size=self.batch_size, rank=self.rank, warmup=self.warmup,
                                reps=self.reps)
        if not self.dtypes or any(d not in ("float32", "bfloat16") for d in self.dtypes):
            raise ValueError(f"dtypes must be some of float32, bfloat16, got {list(self.dtypes)}")


FULL = Settings()
QUICK = Settings(ckpt=None, seq_len=64, batch_size=2, rank=4, reps=2)


def _base(settings: Settings) -> tuple[GPT, str]:
    """(our model in float32, training mode, its name)."""
    if settings.ckpt is None:
        torch.manual_seed(0)
        config = GPTConfig(vocab_size=512, block_size=256, n_layer=2, n_head=4, n_embd=64, n_kv_head=2, pos="rope",
                           norm="rmsnorm", mlp_kind="swiglu", intermediate_size=128, bias=False, tie_embeddings=True)
        return GPT(config).train(), "random Llama-shaped (2 layers, C=64)"
    if not Path(settings.ckpt).is_file():
        raise ValueError(f"{settings.ckpt} is missing" + (": run `make models`" if settings.ckpt == DEFAULT_CKPT
                                                          else ""))
    from selfattn.io.loading import load
    loaded = load(settings.ckpt)
    return loaded.model.float().train(), str(loaded.source)


class _Pair:
    """Our model and the transformers twin for one mode (full or LoRA), with their optimizers."""

    def __init__(self, base: GPT, mode: str, rank: int, device: torch.device):
        ours = copy.deepcopy(base).to(device)
        theirs, why = hf_twin(ours)
        if theirs is None:
            raise ValueError(f"finetune: no transformers twin of the model: {why}")
        theirs.train()
        theirs.config.use_cache = False
        if mode == "lora":
            import peft
            torch.manual_seed(1)
            lora.add_lora(ours, rank, family="llama")
            modules = ["q_proj", "k_proj", "v_proj", "o_proj"]
            theirs = peft.get_peft_model(theirs, peft.LoraConfig(r=rank, lora_alpha=2 * rank, target_modules=modules,
                                                                 lora_dropout=0.0))
            with torch.no_grad():
                for module in lora.lora_modules(ours).values():
                    module.lora_B.normal_(std=0.02)  # non-zero B: every adapter gets a gradient to compare
                named = dict(theirs.named_parameters())
                parts = {name: m.parts for name, m in lora.lora_modules(ours).items()}
                for name, tensor in peft_format.to_peft(lora.adapter_state(ours), parts, ours.config, "llama").items():
                    named[name.replace(".weight", ".default.weight")].copy_(tensor)
        self.models = {"selfattn": ours, "transformers": theirs}
        self.optimizers = {name: torch.optim.AdamW([p for p in m.parameters() if p.requires_grad], lr=1e-5)
                           for name, m in self.models.items()}

    def loss(self, name: str, x: torch.Tensor, y: torch.Tensor, dtype: str) -> torch.Tensor:
        with torch.autocast(x.device.type, dtype=torch.bfloat16, enabled=dtype == "bfloat16"):
            if name == "selfattn":
                return self.models[name](x, y)[1]
            return self.models[name](input_ids=x, labels=y, shift_labels=y).loss

    def step(self, name: str, x: torch.Tensor, y: torch.Tensor, dtype: str) -> None:
        self.optimizers[name].zero_grad(set_to_none=True)
        self.loss(name, x, y, dtype).backward()
        self.optimizers[name].step()

    def check(self, x: torch.Tensor, y: torch.Tensor, dtype: str, what: str) -> dict:
        """Same loss, same gradients of every trainable tensor, before anything is timed."""
        losses, grads = {}, {}
        for name, m in self.models.items():
            m.zero_grad(set_to_none=True)
            loss = self.loss(name, x, y, dtype)
            loss.backward()
            losses[name] = loss.detach().float()
            grads[name] = [p.grad.float() for p in m.parameters() if p.requires_grad]
            m.zero_grad(set_to_none=True)
        tolerance = common.TOLERANCE[torch.float32 if dtype == "float32" else torch.bfloat16]
        loss_err = common.rel_error(losses["transformers"], losses["selfattn"])
        norms = {name: torch.cat([g.flatten() for g in gs]).norm() for name, gs in grads.items()}
        grad_err = common.rel_error(norms["transformers"], norms["selfattn"])
        if not (loss_err <= tolerance and grad_err <= tolerance * 10):
            raise common.CorrectnessError(f"{what}: transformers vs ours: loss relative error {loss_err:.1e}, "
                                          f"gradient norm relative error {grad_err:.1e} (tolerance {tolerance:g})")
        return {"loss": losses["selfattn"].item(), "loss_err": loss_err, "grad_norm_err": grad_err}


def run(settings: Settings, device: torch.device, *, log=print) -> dict:
    settings.check()
    info = common.machine(device)
    log(common.describe(info))
    base, name = _base(settings)
    g = torch.Generator().manual_seed(0)
    B, T, V = settings.batch_size, settings.seq_len, base.config.vocab_size
    x = torch.randint(V, (B, T), generator=g).to(device)  # (B, T)
    y = torch.randint(V, (B, T), generator=g).to(device)  # (B, T)
    log(f"model: {name}, {base.num_params() / 1e6:.1f}M parameters; B={B}, T={T}")
    peak = common.PeakMemory(device)
    rows, checks = [], []
    for mode in MODES:
        pair = _Pair(base, mode, settings.rank, device)
        for dtype in settings.dtypes:
            checks.append({"mode": mode, "dtype": dtype, **pair.check(x, y, dtype, f"finetune {mode} {dtype}")})
            fns = {impl: (lambda i=impl, p=pair, d=dtype: p.step(i, x, y, d)) for impl in IMPLS}
            times, _ = common.interleaved(fns, device, warmup=settings.warmup, reps=settings.reps)
            for impl in IMPLS:
                memory = peak.growth(fns[impl])[0] if settings.memory else None
                rows.append({"mode": mode, "dtype": dtype, "impl": impl, "time_s": common.median(times[impl]),
                             "times_s": times[impl], "tokens_per_s": B * T / common.median(times[impl]),
                             "peak_bytes": memory})
            log(", ".join(f"{mode} {dtype} {r['impl']} {r['tokens_per_s']:.0f} tok/s" for r in rows[-2:]))
    return {"suite": "finetune", "machine": info, "settings": asdict(settings), "model": name,
            "params": base.num_params(), "checks": checks, "results": rows, "targets": _targets(rows)}


def _pairs(rows: list[dict]) -> list[tuple[dict, dict]]:
    """(ours, theirs) for every mode and dtype."""
    return [(rows[i], rows[i + 1]) for i in range(0, len(rows), 2)]


def _targets(rows: list[dict]) -> list[dict]:
    targets = []
    for ours, theirs in _pairs(rows):
        speed = ours["tokens_per_s"] / theirs["tokens_per_s"]
        what = f"{ours['mode']} {ours['dtype']}"
        targets.append(common.target(f"{what}: tokens/s at least {SPEEDUP}x transformers'", speed >= SPEEDUP,
                                     f"{speed:.2f}x"))
        if ours["mode"] == "lora" and ours["peak_bytes"] and theirs["peak_bytes"]:
            memory = ours["peak_bytes"] / theirs["peak_bytes"]
            targets.append(common.target(f"{what}: peak memory at most {LORA_MEMORY}x peft's", memory <= LORA_MEMORY,
                                         f"{memory:.2f}x"))
    return targets


def report(result: dict) -> str:
    s = result["settings"]
    mib = lambda b: "-" if b is None else f"{b / 2 ** 20:.0f}"
    body = [[ours["mode"], ours["dtype"], f"{ours['tokens_per_s']:.0f}", f"{theirs['tokens_per_s']:.0f}",
             f"{ours['tokens_per_s'] / theirs['tokens_per_s']:.2f}", mib(ours["peak_bytes"]), mib(theirs["peak_bytes"])]
            for ours, theirs in _pairs(result["results"])]
    checks = "; ".join(f"{c['mode']} {c['dtype']} loss {c['loss']:.4f} (err {c['loss_err']:.0e}, gradient norm err "
                       f"{c['grad_norm_err']:.0e})" for c in result["checks"])
    return "\n".join([
        "", f"finetune: {result['model']}, {result['params'] / 1e6:.1f}M parameters, B={s['batch_size']}, "
            f"T={s['seq_len']}, LoRA rank {s['rank']} on q, k, v, o; AdamW step",
        common.table(["mode", "dtype", "ours tok/s", "theirs tok/s", "ours/theirs", "ours peak MiB",
                      "theirs peak MiB"], body),
        f"checks: {checks}", common.format_targets(result["targets"])])


def plot(result: dict, path: Path) -> Path:
    pairs = _pairs(result["results"])
    labels = [f"{ours['mode']}\n{ours['dtype']}" for ours, _ in pairs]
    fig = _plot.figure(figsize=(7, 4))
    ax = fig.subplots()
    at = range(len(pairs))
    ax.bar([i - 0.2 for i in at], [o["tokens_per_s"] for o, _ in pairs], width=0.4, label="selfattn")
    ax.bar([i + 0.2 for i in at], [t["tokens_per_s"] for _, t in pairs], width=0.4, label="transformers (+ peft)")
    ax.set_xticks(list(at), labels)
    ax.set(ylabel="tokens/s", title=f"python -m benchmarks finetune ({result['machine']['device']}, "
                                    f"{result['params'] / 1e6:.0f}M params)")
    ax.legend()
    fig.tight_layout()
    return _plot.save(fig, path, dpi=110)
