"""Train a GPT on a text corpus; one process, or many under ``torchrun`` (DDP or FSDP2).

:func:`train` runs the loop over a run folder: checkpoints (``ckpt-*.safetensors``),
``config.json`` (and ``tokenizer.json`` for BPE), ``log.jsonl`` (one record per step and per
evaluation), ``loss.png``, the token cache ``tokens/`` and, while a process trains there, its
lock ``.lock`` (a second process is refused, naming the first's PID). Resuming continues from
the newest checkpoint exactly: on CPU in float32 the losses equal, step for step, those of a
run that never stopped, however often it was killed.
The configs a run starts from are :mod:`selfattn.training.resume`'s (:func:`~selfattn.training.resume.resolve_configs`),
whose :class:`~selfattn.training.config.TrainConfig` is :mod:`selfattn.training.config`'s.

Determinism by construction: the rows of step s and its dropout masks come from seeds derived
from (seed, step, rank), never from a generator consumed by earlier steps, so a checkpoint needs
no RNG state beyond the integers (seed, step), and any world size reads the same global batch.

Distributed (:mod:`selfattn.training.parallel`): the same call under ``torchrun
--nproc_per_node=N`` (multi-node through torchrun's own rendezvous flags) runs DDP over gloo on
CPU or NCCL on GPUs; ``fsdp=True`` shards parameters, gradients and optimizer state with FSDP2
``fully_shard`` instead. Each rank reads its own slice of every batch; rank 0 alone reports and
writes. ``context_parallel=N`` splits each sequence over N ranks instead (ring attention,
:mod:`selfattn.distributed`), with DDP over the rings: world = data-parallel x N. Across
machines the run folder must be on a disk every rank sees (checkpoints are written by rank 0
and read by all).
"""
from __future__ import annotations

import dataclasses
import functools
import json
import math
import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import Tensor, nn

from selfattn._util import files as _files
from selfattn._util import plot as _plot
from selfattn._util import validate as _validate
from selfattn._util.seeds import seed_for
from selfattn.config import GPTConfig
from selfattn.distributed import SequenceShard
from selfattn.loss import IGNORE
from selfattn.model import GPT
from selfattn.training import chat, checkpoint, data, finetune, forgetting, lock, parallel
from selfattn.training.config import TrainConfig


class Diverged(RuntimeError):
    """The loss or the gradient norm became NaN or infinite; nothing was saved for that step."""


@dataclass
class TrainResult:
    """What a call of :func:`train` did."""
    out: Path  # the run folder
    step: int  # the run's last step
    trained: int  # steps this call ran (0: the run had already reached max_steps)
    val_loss: float  # the last validation loss
    tokens_per_s: float | None  # mean training rate of this call (the first step, warm-up, left out)
    checkpoint: Path | None  # the newest checkpoint
    watch: forgetting.Watch  # the evaluations: the best val loss and its step (best.safetensors), the start's


# on_event(kind, record), on rank 0 only: kind "start" (the run described), "step" (a log.jsonl
# record of one optimizer step) or "eval" (an evaluation: step, val_loss, general_loss (None: no
# general check), the last train loss (None at step 0), best_step and the warnings it raises).
OnEvent = Callable[[str, dict], None]


def train(model_cfg: GPTConfig, cfg: TrainConfig, out: str | os.PathLike, *, resume_from: Path | None = None,
          on_event: OnEvent | None = None, base: str | os.PathLike | None = None,
          source: finetune.Source | None = None) -> TrainResult:
    """Train a model of ``model_cfg`` as ``cfg`` says, in the run folder ``out``.

    Args:
        model_cfg: the model's :class:`~selfattn.config.GPTConfig` (its ``vocab_size`` is the tokenizer's).
        cfg: the run's :class:`~selfattn.training.config.TrainConfig`.
        out: the run folder (the module docstring lists what it holds), locked while the call runs
            (:mod:`selfattn.training.lock`).
        resume_from: the checkpoint to continue from (:func:`~selfattn.training.resume.resolve_configs`
            finds it); None starts the run.
        on_event: called on rank 0 with each event, ``on_event(kind, record)`` (:data:`OnEvent`).
        base: a resumed LoRA run's base model at its new place, when it moved (its digest is checked);
            None: where the run names it.
        source: ``cfg.init_from``'s model as :func:`~selfattn.training.resume.resolve_configs` loaded it,
            taken by the run (so the file is read once); None: loaded here.

    Returns:
        a :class:`TrainResult`: the run folder, its last step, the steps this call ran, the last
        validation loss, the training rate and the newest checkpoint.

    Raises :class:`Diverged` on a NaN/inf loss; every refusal (a bad value, another corpus on
    resume) comes before anything in ``out`` is written."""
    with lock.hold(out):
        return _train(model_cfg, cfg, Path(out), resume_from, on_event, base, source)


def _train(model_cfg: GPTConfig, cfg: TrainConfig, out: Path, resume_from: Path | None,
           on_event: OnEvent | None, base: str | os.PathLike | None, source: finetune.Source | None) -> TrainResult:
    _check_context_parallel(model_cfg, cfg.context_parallel)
    seq_len = cfg.seq_len or model_cfg.block_size
    if seq_len > model_cfg.block_size:
        raise ValueError(f"seq_len={seq_len} is longer than the model's block_size={model_cfg.block_size}")
    rank, world, device = parallel.setup(_validate.device(cfg.device), cfg.fsdp, cfg.context_parallel)
    shard, dp_rank, dp_world = parallel.context_parallel(cfg.context_parallel, rank, world, seq_len,
                                                         model_cfg.window)
    if cfg.batch_size % (dp_world * cfg.grad_accum):
        raise ValueError(f"batch_size={cfg.batch_size} must be a multiple of data-parallel ranks * grad_accum = "
                         f"{dp_world} * {cfg.grad_accum}")
    report = on_event if on_event is not None and rank == 0 else lambda kind, record: None
    if rank == 0:  # the folder is locked: every temporary in it is a killed writer's
        for folder in (out, out / "tokens"):
            _files.remove_temporaries(folder)
        checkpoint.remove_temporaries(out)
    saved = checkpoint.read(resume_from) if resume_from is not None else None  # (tensors, header), verified
    trained_on = saved[1]["meta"]["data"]["fingerprint"] if saved else None
    torch.manual_seed(cfg.seed)  # the same initial weights (and adapters) on every rank
    start_from = None if cfg.init_from is None else finetune.begin(
        cfg.init_from, model_cfg, _adapters(cfg), saved and saved[1]["meta"], base, source)
    corpus = _prepare_data(out, cfg, seq_len, rank, trained_on, start_from)
    general = None if start_from is None or not cfg.general_tokens else forgetting.general_rows(
        corpus.tokenizer, cfg.general_data, cfg.general_tokens, seq_len)  # (R, seq_len + 1)
    if start_from is None:
        model_cfg = dataclasses.replace(model_cfg, vocab_size=corpus.tokenizer.vocab_size)
    raw = (GPT(model_cfg) if start_from is None else start_from.model).to(device)
    raw.checkpointing = cfg.checkpoint_activations
    run = _Run(parallel.wrap(raw, compile=cfg.compile, fsdp=cfg.fsdp, world=world, device=device),
               corpus, cfg, rank, world, device, _Rows(shard, dp_rank, dp_world))
    start, records = 0, []
    if saved is not None:
        start = checkpoint.restore(resume_from, *saved, run.model, run.optimizer)["step"]
        saved = None  # the model and the optimizer hold copies: free these
        records = [r for r in _read_log(out) if r["step"] <= start]  # drop steps the checkpoint never saw
    log = _Log(out, records, rank)
    if rank == 0:
        log.write_config(model_cfg, cfg, corpus.tokenizer)
    report("start", {"params": raw.num_params(), "trained": sum(p.numel() for p in raw.parameters() if p.requires_grad),
                     "data": corpus.description, "train_tokens": corpus.n_train,
                     "val_tokens": corpus.n_val, "world": world, "context_parallel": cfg.context_parallel,
                     "device": str(device), "out": str(out),
                     "start": start, "max_steps": cfg.max_steps})
    meta = {"model": dataclasses.asdict(model_cfg), "train": dataclasses.asdict(cfg),
            "tokenizer": corpus.tokenizer.spec(),
            "data": {"fingerprint": corpus.fingerprint, "description": corpus.description}}
    if start_from is not None:
        meta |= start_from.meta
    watch = forgetting.Watch.of(records)
    if start >= cfg.max_steps:
        return TrainResult(out, start, 0, log.last("val_loss"), None, checkpoint.latest(out), watch)

    def evaluate(step: int, loss: float | None) -> None:
        val = run.evaluate()
        general_loss = None if general is None else run.loss_on(general)
        log.add({"step": step, "val_loss": val} | ({} if general_loss is None else {"general_loss": general_loss}))
        warnings = watch.add(step, val, general_loss)
        if watch.best_step == step:
            checkpoint.save(out, step, run.model, run.optimizer, meta={**meta, "step": step}, keep=cfg.keep, best=True)
        report("eval", {"step": step, "loss": loss, "val_loss": val, "general_loss": general_loss,
                        "best_step": watch.best_step, "warnings": warnings})

    if start == 0:
        evaluate(0, None)
    tokens_per_step = cfg.batch_size * seq_len
    seconds = []  # per step, for the mean rate
    for step in range(start + 1, cfg.max_steps + 1):
        t0 = time.perf_counter()
        loss, norm = run.step(step)
        if not (math.isfinite(loss) and math.isfinite(norm)):
            last = checkpoint.latest(out)
            what = f"loss is {loss}" if not math.isfinite(loss) else f"gradient norm is {norm}"
            raise Diverged(f"{what} at step {step}; stopped without saving, the last good checkpoint is "
                           f"{last if last else 'none (no checkpoint was written yet)'}")
        seconds.append(time.perf_counter() - t0)
        record = {"step": step, "loss": loss, "lr": lr_at(step, cfg), "grad_norm": norm,
                  "tokens_per_s": tokens_per_step / seconds[-1]}
        log.add(record)
        report("step", record)
        if step % cfg.eval_every == 0 or step == cfg.max_steps:
            evaluate(step, loss)
            log.plot()
        if step % cfg.save_every == 0 or step == cfg.max_steps:
            checkpoint.save(out, step, run.model, run.optimizer, meta={**meta, "step": step}, keep=cfg.keep)
    log.plot()
    timed = seconds[1:] or seconds  # the first step pays for warm-up (and compilation)
    rate = tokens_per_step * len(timed) / sum(timed)
    return TrainResult(out, cfg.max_steps, cfg.max_steps - start, log.last("val_loss"), rate, checkpoint.latest(out),
                       watch)


def _adapters(cfg: TrainConfig) -> dict | None:
    """LoRA's settings (:func:`selfattn.lora.add_lora`'s keywords), or None for a full fine-tune."""
    if cfg.lora_rank is None:
        return None
    return dict(rank=cfg.lora_rank, alpha=cfg.lora_alpha, dropout=cfg.lora_dropout, mlp=cfg.lora_mlp)


def _check_context_parallel(model_cfg: GPTConfig, n: int) -> None:
    """Ring attention serves causal attention with a window; refuse the rest before any work."""
    if n == 1:
        return
    refused = [f"{name}={getattr(model_cfg, name)!r}" for name, off in (
        ("dropout", 0.0), ("alibi", False), ("softcap", None), ("sinks", False), ("sink_tokens", None))
        if getattr(model_cfg, name) != off]
    if refused:
        raise ValueError(f"--context-parallel {n}: ring attention serves causal attention with a sliding window, not "
                         f"{', '.join(refused)}")


@dataclass
class _Rows:
    """Which rows of each batch a rank reads, and which part of their sequences."""
    shard: SequenceShard | None  # the rank's part of every sequence (None: whole sequences)
    part: int  # the data-parallel rank: ranks of one ring share rows
    parts: int  # data-parallel ranks

    def split(self, x: Tensor) -> Tensor:
        return x if self.shard is None else self.shard.split(x)


class _Run:
    """The model (wrapped), its optimizer and data, as one rank sees them: one step, one evaluation."""

    def __init__(self, model: nn.Module, corpus: data.Corpus | chat.ChatCorpus, cfg: TrainConfig, rank: int,
                 world: int, device: torch.device, rows: _Rows):
        self.model, self.corpus, self.cfg = model, corpus, cfg
        self.rank, self.world, self.device, self.rows = rank, world, device, rows
        self.optimizer = _optimizer(model, cfg)
        self.autocast = torch.autocast(device.type, dtype=torch.bfloat16, enabled=cfg.bf16)

    def step(self, step: int) -> tuple[float, float]:
        """Optimizer step ``step`` (1-based); (mean loss over all ranks, gradient norm before clipping).
        On a non-finite loss or norm the weights are left untouched."""
        cfg, world = self.cfg, self.world
        for group in self.optimizer.param_groups:
            group["lr"] = lr_at(step, cfg)
        torch.manual_seed(seed_for(cfg.seed, "dropout", self.rank, step))
        rows = self.rows
        micros = [self.corpus.batch("train", seed=cfg.seed, step=step, batch_size=cfg.batch_size,
                                    part=micro * rows.parts + rows.part, parts=rows.parts * cfg.grad_accum)
                  for micro in range(cfg.grad_accum)]  # (x, y, doc_ids) each
        counts = [int((y != IGNORE).sum()) for _, y, _ in micros]  # targets of each micro-batch
        share = parallel.mean_over_ranks(torch.tensor(float(sum(counts)), device=self.device), world).item()
        loss_sum = torch.zeros((), device=self.device)
        for micro, (x, y, doc_ids) in enumerate(micros):  # every target weighs the same in the step's gradient
            with parallel.grad_sync(self.model, micro == cfg.grad_accum - 1), self.autocast:
                _, loss = self._forward(x, y, doc_ids)
            (loss / (share / counts[micro])).backward()  # text: share / count = grad_accum, exactly
            loss_sum += loss.detach() * (counts[micro] / share)
        loss = parallel.mean_over_ranks(loss_sum, world).item()
        norm = parallel.clip_grad_norm(self.model, cfg.grad_clip)
        if math.isfinite(loss) and math.isfinite(norm):
            self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        return loss, norm

    @torch.no_grad()
    def evaluate(self) -> float:
        """Mean loss over ``eval_batches`` fixed batches of the val split, rows shared among ranks."""
        rows = self.cfg.batch_size // self.cfg.grad_accum
        return self._mean_loss((*self.corpus.batch("val", seed=self.cfg.seed, step=i, batch_size=rows,
                                                   part=self.rows.part, parts=self.rows.parts), 1)
                               for i in range(self.cfg.eval_batches))

    @torch.no_grad()
    def loss_on(self, rows: Tensor) -> float:
        """Mean loss on ``rows`` ``(R, T + 1)`` of tokens (each row's first T read, its last T predicted),
        every rank reading them all, a micro-step's rows at a time."""
        chunks = rows.split(max(self.cfg.batch_size // self.cfg.grad_accum, 1))
        return self._mean_loss((c[:, :-1], c[:, 1:], None, len(c)) for c in chunks)

    def _mean_loss(self, batches) -> float:
        """The mean of the model's loss over ``batches`` of (x, y, doc_ids, weight), in eval mode, over all ranks."""
        self.model.eval()
        total, weights = torch.zeros((), device=self.device), 0
        for x, y, doc_ids, weight in batches:
            with self.autocast:
                total += self._forward(x, y, doc_ids)[1].float() * weight
            weights += weight
        self.model.train()
        return parallel.mean_over_ranks(total / weights, self.world).item()

    def _forward(self, x: Tensor, y: Tensor, doc_ids: Tensor | None) -> tuple[None, Tensor]:
        """The model on this rank's part of rows x, targets y (packed documents: doc_ids): every
        rank holds as many positions, so the mean of the ranks' losses is the loss of the whole batch."""
        x, y = self.rows.split(x).to(self.device), self.rows.split(y).to(self.device)
        if doc_ids is not None:
            return self.model(x, y, doc_ids=doc_ids.to(self.device))
        return self.model(x, y) if self.rows.shard is None else self.model(x, y, shard=self.rows.shard)


def lr_at(step: int, cfg: TrainConfig) -> float:
    """The learning rate of step ``step`` (1-based): linear warmup to ``lr``, then cosine to ``min_lr``."""
    if step <= cfg.warmup_steps:
        return cfg.lr * step / cfg.warmup_steps
    progress = min((step - cfg.warmup_steps) / max(cfg.max_steps - cfg.warmup_steps, 1), 1.0)
    return cfg.min_lr + 0.5 * (cfg.lr - cfg.min_lr) * (1.0 + math.cos(math.pi * progress))


def _prepare_data(out: Path, cfg: TrainConfig, block_size: int, rank: int, trained_on: str | None,
                  start_from: finetune.Start | None) -> data.Corpus | chat.ChatCorpus:
    """The run's corpus in rows of ``block_size``: text (the tokenizer ``cfg.tokenizer`` names, or
    the model's own when fine-tuning) or, for a ``.jsonl`` file, the conversations of chat data,
    written with the model's chat template (:mod:`selfattn.training.chat`). Rank 0 tokenizes (or
    finds the cache) first; then the first rank of every other machine (a cache hit on a shared
    disk, else built on its own); then everyone opens the cache."""
    if chat.is_chat_data(cfg.data):
        if start_from is None or start_from.chat is None:
            raise ValueError(f"--data {cfg.data}: chat data (.jsonl) is written with a model's chat template: "
                             + ("give --init-from a chat model" if start_from is None else
                                f"--init-from {cfg.init_from} has none"))
        prepare = functools.partial(chat.prepare_chat, data=cfg.data, tokenizer=start_from.tokenizer,
                                    template=start_from.chat, pack=cfg.pack)
    elif cfg.pack:
        raise ValueError("--pack packs the conversations of chat data (a .jsonl file) as separate documents; "
                         "text is read in windows")
    else:
        prepare = functools.partial(data.prepare, data=cfg.data, bpe_vocab=cfg.bpe_vocab,
                                    tokenizer=start_from.tokenizer if start_from else cfg.tokenizer)
    kwargs = dict(val_fraction=cfg.val_fraction, block_size=block_size, trained_on=trained_on)
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    corpus = None
    for turn in (rank == 0, rank != 0 and local_rank == 0):
        if turn:
            corpus = prepare(out / "tokens", **kwargs)
        parallel.barrier()
    return corpus or prepare(out / "tokens", **kwargs)


def _optimizer(model: nn.Module, cfg: TrainConfig) -> torch.optim.AdamW:
    """AdamW, decaying matrices (weights, embeddings) but not vectors (biases, LayerNorm gains)."""
    params = [p for p in model.parameters() if p.requires_grad]
    groups = [{"params": [p for p in params if p.dim() >= 2], "weight_decay": cfg.weight_decay},
              {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0}]
    return torch.optim.AdamW(groups, lr=cfg.lr, betas=(cfg.beta1, cfg.beta2))


class _Log:
    """``log.jsonl`` and ``loss.png`` in the run folder; rank 0 writes, the others keep nothing."""

    def __init__(self, out: Path, records: list[dict], rank: int):
        self.out, self.records, self.active = out, records, rank == 0
        if self.active:  # rewrite: a resumed run forgets the steps after its checkpoint
            _files.write_text(out / "log.jsonl", "".join(json.dumps(r) + "\n" for r in records))

    def write_config(self, model_cfg: GPTConfig, cfg: TrainConfig, tokenizer) -> None:
        """``config.json`` (both configs) and, for BPE, ``tokenizer.json``: the run described
        for people and for tools that read weights without our checkpoint header."""
        text = json.dumps({"model": dataclasses.asdict(model_cfg), "train": dataclasses.asdict(cfg)}, indent=2)
        _files.write_text(self.out / "config.json", text + "\n")
        if tokenizer.spec()["kind"] == "bpe":
            _files.write_text(self.out / "tokenizer.json", tokenizer.spec()["json"])

    def add(self, record: dict) -> None:
        if self.active:
            self.records.append(record)
            _files.append_text(self.out / "log.jsonl", json.dumps(record) + "\n")

    def last(self, key: str) -> float:
        return next((r[key] for r in reversed(self.records) if key in r), float("nan"))

    def plot(self) -> None:
        if not self.active:
            return
        train = [(r["step"], r["loss"]) for r in self.records if "loss" in r]
        val = [(r["step"], r["val_loss"]) for r in self.records if "val_loss" in r]
        fig = _plot.figure(figsize=(7, 4))
        ax = fig.add_subplot()
        if train:
            ax.plot(*zip(*train), lw=0.8, alpha=0.6, label="train loss (per step)")
        if val:
            ax.plot(*zip(*val), "o-", label="val loss")
        ax.set(xlabel="step", ylabel="cross-entropy (nats/token)", title=f"{self.out.name}: loss")
        ax.grid(alpha=0.3)
        ax.legend()
        _plot.save(fig, self.out / "loss.png", dpi=110, bbox_inches="tight")


def _read_log(out: Path) -> list[dict]:
    path = out / "log.jsonl"
    if not path.exists():
        return []
    records = []
    for line in path.read_text().splitlines():
        try:
            records.append(json.loads(line))
        except json.JSONDecodeError:
            break  # a line cut short by a kill: it and anything after it are not trusted
    return records
