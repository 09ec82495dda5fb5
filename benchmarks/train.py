"""``python -m benchmarks train``: tokens per second of a training step, our GPT vs nanoGPT.

The peer is :class:`selfattn.peers.NanoGPT`, a nanoGPT-equivalent model of the same size
holding the same weights (GPT-2 style: biases, learned positions, tied head). A step is
``zero_grad``, forward with the loss, backward and an AdamW update, on a fixed batch;
tokens/s = B·T / median step time over interleaved repetitions after warm-up steps (the
first step also allocates AdamW's state).

Before timing: the two models' losses and every parameter gradient agree on one batch.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from benchmarks import common
from benchmarks.peers import NanoGPT
from selfattn._util import plot as _plot
from selfattn._util.validate import positive_ints
from selfattn.config import GPTConfig
from selfattn.model import GPT

IMPLS = ("selfattn", "nanogpt")


@dataclass
class Settings:
    vocab_size: int = 8192
    seq_len: int = 256  # T per row (the models' block_size)
    batch_size: int = 8  # B rows per step
    n_layer: int = 4
    n_head: int = 4
    n_embd: int = 256
    warmup: int = 2  # untimed steps of each model
    reps: int = 5  # timed steps of each model (median reported)

    def check(self) -> None:
        positive_ints(**asdict(self))
        if self.n_embd % self.n_head:
            raise ValueError(f"n_embd={self.n_embd} is not divisible by n_head={self.n_head}")


FULL = Settings()
QUICK = Settings(vocab_size=256, seq_len=64, batch_size=4, n_layer=2, n_head=2, n_embd=64, warmup=1, reps=3)


def models(settings: Settings, device: torch.device) -> dict[str, torch.nn.Module]:
    torch.manual_seed(0)
    ours = GPT(GPTConfig(vocab_size=settings.vocab_size, block_size=settings.seq_len, n_layer=settings.n_layer,
                         n_head=settings.n_head, n_embd=settings.n_embd, bias=True)).to(device)
    return {"selfattn": ours.train(), "nanogpt": NanoGPT.from_ours(ours).train()}


def run(settings: Settings, device: torch.device, *, log=print) -> dict:
    settings.check()
    info = common.machine(device)
    log(common.describe(info))
    nets = models(settings, device)
    g = torch.Generator().manual_seed(0)
    B, T, V = settings.batch_size, settings.seq_len, settings.vocab_size
    x = torch.randint(V, (B, T), generator=g).to(device)  # (B, T)
    y = torch.randint(V, (B, T), generator=g).to(device)  # (B, T)
    check = _check(nets, x, y)
    opts = {name: torch.optim.AdamW(m.parameters(), lr=3e-4) for name, m in nets.items()}

    def step(name: str) -> None:
        opts[name].zero_grad(set_to_none=True)
        nets[name](x, y)[1].backward()
        opts[name].step()

    times, _ = common.interleaved({name: (lambda n=name: step(n)) for name in nets}, device,
                                  warmup=settings.warmup, reps=settings.reps)
    rows = [{"impl": name, "status": "ok", "time_s": common.median(ts), "times_s": ts,
             "tokens_per_s": B * T / common.median(ts)} for name, ts in times.items()]
    fastest = max(r["tokens_per_s"] for r in rows)
    for r in rows:
        r["ratio_to_fastest"] = r["tokens_per_s"] / fastest
    log(", ".join(f"{r['impl']} {r['tokens_per_s']:.0f} tok/s" for r in rows))
    return {"suite": "train", "machine": info, "settings": asdict(settings),
            "params": nets["selfattn"].num_params(), "attention_backend": nets["selfattn"].config.backend,
            "check": check, "results": rows}


def _check(nets: dict, x: torch.Tensor, y: torch.Tensor) -> dict:
    """Same loss and same gradient for every parameter, before anything is timed."""
    losses, grads = {}, {}
    for name, m in nets.items():
        m.zero_grad(set_to_none=True)
        loss = m(x, y)[1]
        loss.backward()
        losses[name] = loss.detach()
        grads[name] = {k: p.grad for k, p in m.named_parameters()}
    ours, nano = grads["selfattn"], grads["nanogpt"]
    err = common.check_close("train: nanogpt loss vs ours", losses["nanogpt"], losses["selfattn"], torch.float32)
    grad_err = max(common.check_close(f"train: gradient of {k} (nanogpt {NanoGPT.key_for(k)} vs ours)",
                                      nano[NanoGPT.key_for(k)], g, torch.float32) for k, g in ours.items())
    for m in nets.values():
        m.zero_grad(set_to_none=True)
    return {"loss": losses["selfattn"].item(), "loss_err": err, "max_grad_err": grad_err}


def report(result: dict) -> str:
    s, c = result["settings"], result["check"]
    body = [[r["impl"], f"{r['time_s'] * 1e3:.1f}", f"{r['tokens_per_s']:.0f}", f"{r['ratio_to_fastest']:.2f}"]
            for r in result["results"]]
    ours, nano = (next(r for r in result["results"] if r["impl"] == n) for n in IMPLS)
    return "\n".join([
        "", f"train: AdamW step, B={s['batch_size']}, T={s['seq_len']}, {s['n_layer']} layers, C={s['n_embd']}, "
            f"H={s['n_head']}, V={s['vocab_size']}: {result['params'] / 1e6:.1f}M parameters",
        common.table(["impl", "ms/step", "tok/s", "x fastest"], body),
        f"selfattn / nanogpt throughput: {ours['tokens_per_s'] / nano['tokens_per_s']:.2f}x",
        f"check: loss {c['loss']:.4f}, relative error {c['loss_err']:.1e}, "
        f"largest gradient error {c['max_grad_err']:.1e}"])


def plot(result: dict, path: Path) -> Path:
    rows = result["results"]
    fig = _plot.figure(figsize=(6, 4))
    ax = fig.subplots()
    ax.bar([r["impl"] for r in rows], [r["tokens_per_s"] for r in rows], color=["C0", "C1"])
    ax.set(ylabel="tokens/s", title=f"python -m benchmarks train ({result['machine']['device']}, "
                                    f"{result['params'] / 1e6:.1f}M params)")
    fig.tight_layout()
    return _plot.save(fig, path, dpi=110)
