"""The induction-head experiment: a two-layer attention-only transformer learns to copy.

Training data: sequences of T random tokens in which the first L tokens are repeated right
after themselves (``A A rest``), with L drawn uniformly from ``[min_repeat, T/2]`` for each
sequence. Because L varies, no fixed positional offset predicts the copy: the model has to
find the earlier occurrence of the current token by content and predict the token that
followed it. That is the induction circuit: a layer-0 head that looks one token back
(previous-token head) feeds a layer-1 head that attends to the token after the earlier
occurrence (induction head).

Positions are rotary (``pos="rope"``) by default. With learned absolute positions the model
can also lower the loss with position-dependent attention patterns that are not the induction
circuit, and at the default sizes it often does: seeds 1 and 2 (``--pos learned``) still had
no induction head after 4000 steps. Rotary positions leave no absolute position in the
residual stream and make "one token back" the same pattern at every position; with them the
induction circuit formed for every seed we tried.

Evaluation uses a fixed probe, ``repeated_tokens(V, T/2)``: T/2 distinct random tokens, then
the same T/2 again. Its "first half" loss averages the predictions of tokens 1..T/2-1, which
nothing in the context can predict (ln V is chance); its "repeated half" loss averages the
predictions of tokens T/2+1..T-1, each the copy of a token seen earlier. The gap between the
two is in-context learning.

The experiment runs twice with the same width C: with ``n_head`` heads of C/n_head channels and
with one head of C channels; both have the same 2·4·C² attention parameters. Runs are seeded
and single-threaded with deterministic algorithms, so a rerun on one machine is bitwise equal.
"""
from __future__ import annotations

import contextlib
import json
import math
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import Tensor

from selfattn._util import files as _files
from selfattn._util import plot as _plot
from selfattn._util.fields import described
from selfattn._util.validate import positive_ints
from selfattn.analysis.heads import attention_maps, head_scores, plot_attention_grid, repeated_tokens
from selfattn.config import GPTConfig
from selfattn.model import GPT

PROBE_ROWS = 64  # probe sequences for the two half losses
MAP_ROWS = 16  # of which the first ones are used for head scores (attention maps are kept for row 0)
LEARNED = 1.0  # nats: a repeated half below this counts as "learned" in the report


@dataclass
class InductionConfig:
    n_head: int = described(4, 'heads per layer of the multi-head run; the comparison run has 1 head of the same width')
    n_embd: int = described(64, 'C, the residual width; head_dim = C / n_head')
    vocab_size: int = described(64, 'V, random tokens 0..V-1')
    pos: str = described("rope", '"rope" (rotary) or "learned" (absolute: induction then forms for some seeds only)')
    seq_len: int = described(32, 'T, tokens per sequence (even); the probe is T/2 tokens twice')
    min_repeat: int = described(8, 'shortest repeated segment L; L is uniform in [min_repeat, T/2]')
    steps: int = described(1500, 'optimizer steps per run')
    batch_size: int = described(64, 'sequences per step')
    lr: float = described(1e-3, 'AdamW learning rate (after a linear warm-up over the first 100 steps)')
    eval_every: int = described(100, 'steps between probe evaluations (the training curve)')
    seed: int = described(0, 'seeds the weights, the training data and the probe')

    def __post_init__(self):
        positive_ints(**{name: getattr(self, name) for name in ("n_head", "n_embd", "vocab_size", "seq_len",
                                                                  "min_repeat", "steps", "batch_size", "eval_every")})
        if self.n_head < 2:
            raise ValueError(f"n_head must be >= 2 (the comparison run has 1 head), got {self.n_head}")
        if self.n_embd % self.n_head:
            raise ValueError(f"n_embd={self.n_embd} is not divisible by n_head={self.n_head}")
        if self.pos not in ("rope", "learned"):
            raise ValueError(f"pos must be 'rope' or 'learned', got {self.pos!r}")
        if self.seq_len % 2 or self.seq_len < 4:
            raise ValueError(f"seq_len must be even and >= 4 (the probe is seq_len/2 tokens twice), got {self.seq_len}")
        if self.min_repeat > self.seq_len // 2:
            raise ValueError(f"min_repeat={self.min_repeat} is longer than seq_len/2={self.seq_len // 2}")
        if self.seq_len // 2 > self.vocab_size:
            raise ValueError(f"the probe needs seq_len/2={self.seq_len // 2} distinct tokens, "
                             f"more than vocab_size={self.vocab_size}")
        if not isinstance(self.lr, (int, float)) or not 0 < self.lr < 1:
            raise ValueError(f"lr must be in (0, 1), got {self.lr!r}")


@dataclass
class InductionRun:
    """One trained model and what was measured on it."""
    n_head: int
    curve: list[dict] = field(default_factory=list)  # {"step", "train_loss" (None at 0), "first_half", "repeated_half"}
    scores: dict[str, Tensor] = field(default_factory=dict)  # head score name -> (2, n_head), on the probe
    maps: Tensor | None = None  # (2, n_head, T, T) attention of probe row 0
    n_params: int = 0
    seconds: float = 0.0

    @property
    def final(self) -> dict:
        return self.curve[-1]

    @property
    def prev_head(self) -> int:
        """The layer-0 head with the highest previous-token score."""
        return int(self.scores["previous-token"][0].argmax())

    @property
    def induction_head(self) -> int:
        """The layer-1 head with the highest induction score."""
        return int(self.scores["induction"][1].argmax())

    def learned_at(self) -> int | None:
        """The first evaluated step whose repeated-half loss is below :data:`LEARNED`."""
        return next((r["step"] for r in self.curve if r["repeated_half"] < LEARNED), None)


def sample_batch(cfg: InductionConfig, generator: torch.Generator) -> Tensor:
    """``(batch_size, seq_len)`` training sequences ``A A rest`` with ``len(A)`` uniform in
    ``[min_repeat, seq_len/2]`` per row, all tokens uniform over the vocabulary."""
    B, T = cfg.batch_size, cfg.seq_len
    x = torch.randint(cfg.vocab_size, (B, T), generator=generator)  # (B, T)
    L = torch.randint(cfg.min_repeat, T // 2 + 1, (B, 1), generator=generator)  # (B, 1)
    pos = torch.arange(T)[None]  # (1, T)
    source = torch.where((pos >= L) & (pos < 2 * L), pos - L, pos)  # (B, T): the copy reads position - L
    return x.gather(1, source)


def probe_batch(cfg: InductionConfig) -> Tensor:
    """The fixed evaluation sequences ``(PROBE_ROWS, seq_len)``: seq_len/2 distinct tokens, twice."""
    g = torch.Generator().manual_seed(cfg.seed + 1)
    return repeated_tokens(cfg.vocab_size, cfg.seq_len // 2, batch=PROBE_ROWS, generator=g)


@torch.no_grad()
def half_losses(model: GPT, probe: Tensor) -> tuple[float, float]:
    """Mean cross-entropy (nats) on the probe's first half and its repeated half (see module doc)."""
    L = probe.shape[1] // 2
    logits, _ = model(probe[:, :-1])  # (P, T-1, V): position t predicts token t+1
    loss = F.cross_entropy(logits.transpose(1, 2), probe[:, 1:], reduction="none")  # (P, T-1)
    return loss[:, : L - 1].mean().item(), loss[:, L:].mean().item()


def train(cfg: InductionConfig, n_head: int) -> InductionRun:
    """Train one two-layer attention-only GPT with ``n_head`` heads; measure it on the probe."""
    with _deterministic():
        torch.manual_seed(cfg.seed)  # inside _deterministic's fork of the global generator
        model = GPT(GPTConfig(vocab_size=cfg.vocab_size, block_size=cfg.seq_len, n_layer=2, n_head=n_head,
                              n_embd=cfg.n_embd, pos=cfg.pos, mlp=False))
        optimizer = torch.optim.AdamW(model.parameters(), lr=cfg.lr, betas=(0.9, 0.98), weight_decay=0.0)
        data = torch.Generator().manual_seed(cfg.seed)
        probe = probe_batch(cfg)
        run = InductionRun(n_head=n_head, n_params=model.num_params())
        start, recent = time.perf_counter(), []
        for step in range(cfg.steps + 1):
            if step % cfg.eval_every == 0 or step == cfg.steps:
                model.eval()
                first, repeated = half_losses(model, probe)
                model.train()
                train_loss = sum(recent) / len(recent) if recent else None
                run.curve.append({"step": step, "train_loss": train_loss, "first_half": first,
                                  "repeated_half": repeated})
                recent = []
            if step == cfg.steps:
                break
            for group in optimizer.param_groups:
                group["lr"] = cfg.lr * min(1.0, (step + 1) / 100)
            x = sample_batch(cfg, data)  # (B, T)
            _, loss = model(x[:, :-1], x[:, 1:])
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            recent.append(loss.item())
        run.seconds = time.perf_counter() - start
        model.eval()
        rows = probe[:MAP_ROWS]  # (R, T)
        att = attention_maps(model, rows)  # (2, R, H, T, T)
        run.scores = head_scores(att, rows)
        run.maps = att[:, 0]  # (2, H, T, T)
    return run


def run(cfg: InductionConfig) -> tuple[InductionRun, InductionRun]:
    """The experiment: ``cfg.n_head`` heads, then one head of the same width."""
    return train(cfg, cfg.n_head), train(cfg, 1)


def report(cfg: InductionConfig, runs: tuple[InductionRun, ...]) -> str:
    """The terminal summary: losses, the best heads and their scores, learning speed."""
    def col(run: InductionRun) -> str:
        return f"{_heads(run.n_head)} of D={cfg.n_embd // run.n_head}"

    width = 22
    lines = [f"Induction-head experiment: 2-layer attention-only GPT ({cfg.pos} positions), C={cfg.n_embd}, "
             f"V={cfg.vocab_size}, "
             f"T={cfg.seq_len}, repeats of {cfg.min_repeat}..{cfg.seq_len // 2} tokens, {cfg.steps} steps, "
             f"seed {cfg.seed}", "",
             (" " * 34 + "".join(col(r).ljust(width) for r in runs)).rstrip()]

    def row(name: str, cell) -> None:
        lines.append((f"  {name:<32}" + "".join(str(cell(r)).ljust(width) for r in runs)).rstrip())

    row("parameters", lambda r: f"{r.n_params:,}")
    row("loss, first half (nats)", lambda r: f"{r.final['first_half']:.3f}")
    row("loss, repeated half (nats)", lambda r: f"{r.final['repeated_half']:.3f}")
    row("in-context gain (nats)", lambda r: f"{r.final['first_half'] - r.final['repeated_half']:.3f}")
    row("best previous-token head", lambda r: f"L0H{r.prev_head} {r.scores['previous-token'][0, r.prev_head]:.3f}")
    row("best induction head", lambda r: f"L1H{r.induction_head} {r.scores['induction'][1, r.induction_head]:.3f}")
    row(f"first step with repeated < {LEARNED:g}", lambda r: r.learned_at() if r.learned_at() is not None else "never")
    row("training time (s)", lambda r: f"{r.seconds:.1f}")
    lines += ["", f"  chance is ln V = {math.log(cfg.vocab_size):.3f} nats; the repeated half is predictable "
                  f"only by copying from context"]
    for r in runs:
        lines.append(f"  {col(r)}: previous-token scores of layer 0 {_fmt(r.scores['previous-token'][0])}, "
                     f"induction scores of layer 1 {_fmt(r.scores['induction'][1])}")
    return "\n".join(lines)


def save_outputs(cfg: InductionConfig, runs: tuple[InductionRun, ...], out: Path) -> list[Path]:
    """Write the training curve, the two key heads of each run, every head's map and a JSON."""
    out.mkdir(parents=True, exist_ok=True)
    paths = [out / "curve.png", out / "key_heads.png"]
    _plot_curve(cfg, runs, paths[0])
    _plot_key_heads(runs, paths[1])
    for r in runs:
        path = out / f"heads_{r.n_head}.png"
        plot_attention_grid(r.maps, path, title=f"{_heads(r.n_head)} per layer; probe: {cfg.seq_len // 2} "
                                                f"random tokens, repeated")
        paths.append(path)
    result = {"config": asdict(cfg), "runs": [
        {"n_head": r.n_head, "n_params": r.n_params, "curve": r.curve, "seconds": r.seconds,
         "previous_token_head": [0, r.prev_head], "induction_head": [1, r.induction_head], "learned_at": r.learned_at(),
         "scores": {name: s.tolist() for name, s in r.scores.items()}} for r in runs]}
    paths.append(out / "induction.json")
    _files.write_text(paths[-1], json.dumps(result, indent=1))
    return paths


@contextlib.contextmanager
def _deterministic():
    """One thread, deterministic algorithms and a forked global generator inside; the
    previous settings and random state restored after."""
    threads, strict = torch.get_num_threads(), torch.are_deterministic_algorithms_enabled()
    torch.set_num_threads(1)
    torch.use_deterministic_algorithms(True)
    try:
        with torch.random.fork_rng(devices=[]):
            yield
    finally:
        torch.set_num_threads(threads)
        torch.use_deterministic_algorithms(strict)


def _heads(n: int) -> str:
    return f"{n} head" + ("s" if n > 1 else "")


def _fmt(scores: Tensor) -> str:
    return "[" + " ".join(f"{v:.2f}" for v in scores.tolist()) + "]"


def _plot_curve(cfg: InductionConfig, runs: tuple[InductionRun, ...], path: Path) -> None:
    fig = _plot.figure(figsize=(7, 4.2))
    ax = fig.subplots()
    for r, color in zip(runs, ("tab:blue", "tab:orange", "tab:green")):
        steps = [c["step"] for c in r.curve]
        label = _heads(r.n_head)
        ax.plot(steps, [c["repeated_half"] for c in r.curve], color=color, label=f"{label}: repeated half")
        ax.plot(steps, [c["first_half"] for c in r.curve], color=color, ls="--", label=f"{label}: first half")
    ax.axhline(math.log(cfg.vocab_size), color="grey", lw=0.8, ls=":", label="chance, ln V")
    ax.set_xlabel("step")
    ax.set_ylabel("probe loss (nats)")
    ax.set_title("In-context learning: loss on the repeated half vs the first half")
    ax.legend(fontsize=8)
    fig.tight_layout()
    _plot.save(fig, path, dpi=100)


def _plot_key_heads(runs: tuple[InductionRun, ...], path: Path) -> None:
    fig = _plot.figure(figsize=(8, 4 * len(runs)))
    axes = fig.subplots(len(runs), 2, squeeze=False)
    for r, row in zip(runs, axes):
        for ax, layer, head, name in ((row[0], 0, r.prev_head, "previous-token"),
                                      (row[1], 1, r.induction_head, "induction")):
            ax.imshow(r.maps[layer, head].numpy(), cmap="viridis", vmin=0.0, vmax=1.0)
            ax.set_title(f"{_heads(r.n_head)}: layer {layer} head {head}\n{name} score "
                         f"{r.scores[name][layer, head]:.2f}", fontsize=9)
            ax.set_xlabel("key position")
            ax.set_ylabel("query position")
            for axis in (ax.xaxis, ax.yaxis):
                axis.get_major_locator().set_params(integer=True)
    fig.tight_layout()
    _plot.save(fig, path, dpi=100)
