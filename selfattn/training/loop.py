"""Train a GPT on a text corpus; one process, or many under ``torchrun`` (DDP or FSDP2).

:func:`train` runs the loop over a run folder: checkpoints (``ckpt-*.safetensors``),
``config.json`` (and ``tokenizer.json`` for BPE), ``log.jsonl`` (one record per step and per
evaluation), ``loss.png``, the token cache ``tokens/`` and, while a process trains there, its
lock ``.lock`` (a second process is refused, naming the first's PID). Resuming continues from
the newest checkpoint exactly: on CPU in float32 the losses equal, step for step, those of a
run that never stopped, however often it was killed. :func:`resolve_configs` layers the configs
a run starts from and refuses, on resume, flags that would change its model shape or its tokens.

Determinism by construction: the rows of step s and its dropout masks come from seeds derived
from (seed, step, rank), never from a stream consumed by earlier steps, so a checkpoint needs
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
from selfattn._util.fields import described
from selfattn._util.seeds import stream_seed
from selfattn.config import GPTConfig
from selfattn.distributed import SequenceShard
from selfattn.families import writing
from selfattn.loss import IGNORE
from selfattn.model import GPT
from selfattn.training import chat, checkpoint, data, finetune, lock, parallel


@dataclass
class TrainConfig:
    data: str | None = described(None, "text file or folder of text files; none = the built-in corpus (Python's docs)")
    init_from: str | None = described(None, "start from a model selfattn loads (a run, a transformers folder, a GGUF "
                                            "file): its weights, its config (flags change it) and its tokenizer")
    tokenizer: str = described("byte", '"byte" (vocabulary 256, any text) or "bpe" (trained locally on the corpus)')
    bpe_vocab: int = described(2048, 'BPE vocabulary size (256 bytes + merges), with tokenizer "bpe"')
    val_fraction: float = described(0.1, 'the last fraction of the tokens, held out for evaluation')
    seq_len: int | None = described(None, "tokens per training row; none = the model's block_size (fine-tuning a "
                                          "long-context model on shorter rows keeps its context)")
    batch_size: int = described(32, 'sequences per optimizer step, over all ranks and micro-steps together')
    grad_accum: int = described(1, 'micro-steps per optimizer step: each runs batch_size / (ranks * grad_accum) rows')
    max_steps: int = described(2000, 'optimizer steps; the cosine decay ends here')
    lr: float = described(1e-3, 'peak learning rate, reached after the warmup')
    min_lr: float = described(1e-4, 'learning rate at the end of the cosine decay')
    warmup_steps: int = described(100, 'linear warmup from 0 to lr over these steps')
    weight_decay: float = described(0.1, 'AdamW weight decay, on matrices only (not on biases and LayerNorm gains)')
    beta1: float = described(0.9, 'AdamW beta1')
    beta2: float = described(0.99, 'AdamW beta2')
    grad_clip: float = described(1.0, 'clip the global gradient norm to this; 0 = no clipping')
    eval_every: int = described(200, 'steps between evaluations on the val split (also redraws loss.png)')
    eval_batches: int = described(20, 'batches per evaluation, the same batches every time')
    save_every: int = described(500, 'steps between checkpoints; the last step is always saved')
    keep: int = described(2, 'checkpoints kept in the run folder, the newest ones')
    seed: int = described(0, 'seeds the initial weights, the batches and the dropout masks')
    device: str = described("auto", '"auto" (CUDA if available, else CPU) or a torch device: "cpu", "cuda", "mps"')
    bf16: bool = described(False, 'bfloat16 autocast for forward and backward; weights and AdamW state stay float32')
    lora_rank: int | None = described(None, "with --init-from: train LoRA adapters of this rank on the attention "
                                            "projections, every weight of the model frozen; none = train all weights")
    lora_alpha: float | None = described(None, "LoRA's scale is alpha / rank; none = 2 * rank")
    lora_dropout: float = described(0.0, "dropout on the LoRA adapters' input")
    lora_mlp: bool = described(False, "LoRA adapters on the MLP's projections too")
    pack: bool = described(False, "chat data: pack conversations into rows as separate documents (positions "
                                  "restart, no attention across them) instead of one padded row each")
    compile: bool = described(False, 'torch.compile the model')
    checkpoint_activations: bool = described(False, "recompute each block's activations in the backward instead of "
                                                    "keeping them: less memory for one more forward of the blocks")
    fsdp: bool = described(False, 'under torchrun: shard the model with FSDP2 instead of replicating it with DDP')
    context_parallel: int = described(1, 'under torchrun: split each sequence over this many ranks (ring attention)')

    def __post_init__(self):
        _validate.positive_ints(**{name: getattr(self, name) for name in (
            "batch_size", "grad_accum", "max_steps", "eval_every", "eval_batches", "save_every", "keep", "bpe_vocab",
            "context_parallel")})
        if self.context_parallel > 1 and (self.fsdp or self.compile):
            raise ValueError(f"context_parallel={self.context_parallel} runs with DDP, eagerly: not with "
                             f"{'fsdp' if self.fsdp else 'compile'}")
        _validate.count("warmup_steps", self.warmup_steps)
        if self.seq_len is not None:
            _validate.positive_int("seq_len", self.seq_len)
        if self.pack and self.context_parallel > 1:
            raise ValueError("pack and context_parallel: packed documents are not split over ranks")
        if self.lora_rank is not None:
            _validate.positive_int("lora_rank", self.lora_rank)
        if self.lora_alpha is not None:
            _validate.positive_number("lora_alpha", self.lora_alpha)
        _validate.probability("lora_dropout", self.lora_dropout)
        if self.init_from is None and (self.lora_rank is not None or self.lora_mlp):
            raise ValueError("LoRA adapts a loaded model: give --init-from with --lora-rank")
        if self.lora_rank is None and (self.lora_alpha is not None or self.lora_mlp or self.lora_dropout):
            raise ValueError("lora_alpha, lora_dropout and lora_mlp set LoRA's adapters: give --lora-rank too")
        if self.tokenizer not in ("byte", "bpe"):
            raise ValueError(f"tokenizer must be 'byte' or 'bpe', got {self.tokenizer!r}")
        if self.init_from is not None and (not isinstance(self.init_from, str) or not self.init_from):
            raise ValueError(f"init_from must be a path, got {self.init_from!r}")
        for name in ("lr", "min_lr", "weight_decay", "grad_clip"):
            if not getattr(self, name) >= 0:
                raise ValueError(f"{name} must be >= 0, got {getattr(self, name)!r}")
        if not (0 <= self.beta1 < 1 and 0 <= self.beta2 < 1):
            raise ValueError(f"beta1 and beta2 must be in [0, 1), got {self.beta1!r}, {self.beta2!r}")



# name -> (GPTConfig fields, TrainConfig fields); flags and --config override them.
PRESETS = {
    # 0.64M parameters: writes English-looking words in about a minute on 2 cores (README: its run)
    "tiny": (dict(block_size=128, n_layer=3, n_head=4, n_embd=128),
             dict(batch_size=16, max_steps=700, lr=3e-3, min_lr=3e-4, warmup_steps=50, eval_every=100,
                  eval_batches=8, save_every=350)),
    # nanoGPT's character-level Shakespeare size (~10.7M): minutes on one GPU
    "small": (dict(block_size=256, n_layer=6, n_head=6, n_embd=384, dropout=0.2),
              dict(batch_size=64, max_steps=5000, lr=1e-3, min_lr=1e-4, warmup_steps=100, eval_every=250,
                   save_every=1000, bf16=True)),
    # GPT-2 small's shape (124M) with a locally trained BPE: a large --data corpus, 8 GPUs under torchrun
    "gpt2": (dict(block_size=1024, n_layer=12, n_head=12, n_embd=768),
             dict(tokenizer="bpe", bpe_vocab=16384, batch_size=512, grad_accum=4, max_steps=5000, lr=6e-4,
                  min_lr=6e-5, warmup_steps=700, beta2=0.95, eval_every=250, save_every=1000, bf16=True)),
}
_MODEL_FIELDS_CHANGEABLE_ON_RESUME = ("backend", "dropout")  # they change no parameter shape
_DATA_FIELDS_KEPT_ON_RESUME = {  # TrainConfig field -> why a resumed run keeps it (the corpus: by its fingerprint)
    "tokenizer": "the model's vocabulary and the token cache come from it",
    "bpe_vocab": "the model's vocabulary and the token cache come from it",
    "val_fraction": "another split would move trained tokens into validation",
    "init_from": "the run's tokenizer, and so its tokens, came from it",
    "lora_rank": "the run's trained weights are adapters of this rank (or the whole model)",
    "lora_alpha": "the adapters were trained at this scale",
    "lora_mlp": "the run's adapters sit where they were put",
}


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


# on_event(kind, record), on rank 0 only: kind "start" (the run described), "step" (a log.jsonl
# record of one optimizer step) or "eval" (a validation record, with the last train loss).
OnEvent = Callable[[str, dict], None]


def resolve_configs(out: str | os.PathLike, *, preset: str | None = None, config: str | None = None,
                    resume: bool = False, model_flags: dict | None = None, train_flags: dict | None = None,
                    arch: str | None = None) -> tuple[GPTConfig, TrainConfig, Path | None]:
    """(model config, train config, checkpoint to resume from or None), layered: dataclass
    defaults < ``preset`` < ``arch`` (a family's block, :func:`selfattn.families.writing.block`) <
    the JSON file ``config`` < the flags; on ``resume``: the newest checkpoint's configs < the
    flags (training fields, and model fields that change no shape). A resume may repeat the
    original command's ``preset``, ``arch`` and ``config`` when every field they set agrees with the run
    (or a flag given sets it)."""
    out, model_flags, train_flags = Path(out), model_flags or {}, train_flags or {}
    if resume:
        found = checkpoint.read_latest(out)
        if found is None:
            raise ValueError(f"--resume: no checkpoint (ckpt-*.safetensors) in {str(out)!r}")
        ckpt, meta = found[0], found[2]["meta"]
        _check_resume_flags(ckpt, meta, model_flags, train_flags)
        if preset or config or arch:
            _check_resume_layers(meta, _layers(preset, arch, config, model_flags), model_flags, train_flags,
                                 " ".join(f"--{k} {v}" for k, v in (("preset", preset), ("arch", arch),
                                                                    ("config", config)) if v))
        train_cfg = TrainConfig(**{**meta["train"], **train_flags})
        _check_resume_launch(ckpt, train_cfg, train_flags)
        return GPTConfig(**{**meta["model"], **model_flags}), train_cfg, ckpt
    if checkpoint.latest(out) is not None:
        raise ValueError(f"{str(out)!r} already holds checkpoints; pass --resume to continue it, or another --out")
    model_vals, train_vals = _layers(preset, arch, config, model_flags)
    train_cfg = TrainConfig(**{**train_vals, **train_flags})
    if train_cfg.init_from is not None:
        if preset or arch or model_vals:
            raise ValueError("--init-from starts from the model's own config: drop --preset, --arch and a --config "
                             "model part (flags and --set change single fields)")
        if {"tokenizer", "bpe_vocab"} & {*train_flags, *train_vals}:
            raise ValueError("--init-from trains with the model's own tokenizer: drop --tokenizer and bpe_vocab")
        return finetune.changed_config(finetune.source(train_cfg.init_from).model, model_flags,
                                       train_cfg.init_from), train_cfg, None
    return GPTConfig(**{**model_vals, **model_flags}), train_cfg, None


def _layers(preset: str | None, arch: str | None, config: str | None, model_flags: dict) -> tuple[dict, dict]:
    """The model and train fields ``preset`` < ``arch`` < the JSON file ``config`` set (not the flags)."""
    if preset is not None and preset not in PRESETS:
        raise ValueError(f"unknown preset {preset!r}; choose one of {sorted(PRESETS)}")
    model_vals, train_vals = PRESETS[preset] if preset else ({}, {})
    if arch is not None:
        model_vals = {**model_vals, **writing.block(arch, {**dataclasses.asdict(GPTConfig()), **model_vals,
                                                           **model_flags})}
    if config:
        model_vals, train_vals = _read_config_file(config, model_vals, train_vals)
    return model_vals, train_vals


def _check_resume_layers(meta: dict, layers: tuple[dict, dict], model_flags: dict, train_flags: dict,
                         given: str) -> None:
    """Refuse a resume whose repeated ``given`` (--preset, --arch, --config) sets a field otherwise than the
    run has it, where no flag given sets that field."""
    for (kind, flags), values in zip((("model", model_flags), ("train", train_flags)), layers):
        for key, value in values.items():
            if key not in flags and meta[kind].get(key) != value:
                raise ValueError(f"--resume: {given} sets {key}={value!r} but the run has {key}="
                                 f"{meta[kind].get(key)!r}; drop it, or resume with the run's own configs")


def _check_resume_flags(ckpt: Path, meta: dict, model_flags: dict, train_flags: dict) -> None:
    """Refuse flags that would change what a resumed run is: its model shape, its tokens."""
    missing = [key for key in ("model", "train", "data", "step") if key not in meta]
    if missing:
        raise ValueError(f"--resume: {ckpt} was not written by selfattn train (its meta has no {missing[0]!r})")
    changed = [(key, value, meta["model"][key], "a resumed run keeps its model shape")
               for key, value in model_flags.items()
               if key not in _MODEL_FIELDS_CHANGEABLE_ON_RESUME and value != meta["model"][key]]
    changed += [(key, train_flags[key], meta["train"].get(key), why) for key, why in _DATA_FIELDS_KEPT_ON_RESUME.items()
                if key in train_flags and train_flags[key] != meta["train"].get(key)]
    if changed:
        key, value, saved, why = changed[0]
        raise ValueError(f"--resume: {key}={value!r} differs from the checkpoint's {key}={saved!r}; {why}")


def _check_resume_launch(ckpt: Path, cfg: TrainConfig, train_flags: dict) -> None:
    """A resumed run takes its processes' settings from the checkpoint: when one process cannot
    serve them, say where the value comes from and both ways on."""
    if parallel.launched():  # under torchrun: parallel.setup checks the world it joined
        return
    for key, on, launch, alone in (
            ("context_parallel", cfg.context_parallel > 1, f"torchrun --nproc_per_node={cfg.context_parallel}",
             "--context-parallel 1"),
            ("fsdp", cfg.fsdp, "torchrun --nproc_per_node=N", "--no-fsdp")):
        if on and key not in train_flags:
            raise ValueError(f"--resume: the run's checkpoint {ckpt} has {key}={getattr(cfg, key)!r}, which needs "
                             f"several processes: launch with {launch}, or pass {alone} to continue in this one")


def _read_config_file(path: str, model_vals: dict, train_vals: dict) -> tuple[dict, dict]:
    try:
        content = json.loads(Path(path).read_text())
    except json.JSONDecodeError as e:
        raise ValueError(f"--config {path}: invalid JSON at line {e.lineno} column {e.colno}: {e.msg}") from None
    except UnicodeDecodeError as e:
        raise ValueError(f"--config {path}: not UTF-8 text (byte {e.start})") from None
    if not isinstance(content, dict) or set(content) - {"model", "train"}:
        extra = sorted(set(content) - {"model", "train"}) if isinstance(content, dict) else type(content).__name__
        raise ValueError(f"--config {path}: expected an object with keys 'model' and/or 'train', got {extra}")
    model = _validate.config_fields(GPTConfig, content.get("model", {}), f"--config {path}")
    if "vocab_size" in model:
        raise ValueError(f"--config {path}: model key 'vocab_size' is set by the tokenizer, leave it out")
    train = _validate.config_fields(TrainConfig, content.get("train", {}), f"--config {path}")
    return {**model_vals, **model}, {**train_vals, **train}


def train(model_cfg: GPTConfig, cfg: TrainConfig, out: str | os.PathLike, *, resume_from: Path | None = None,
          on_event: OnEvent | None = None) -> TrainResult:
    """Run the training loop in the run folder ``out``, holding its lock
    (:mod:`selfattn.training.lock`). Raises :class:`Diverged` on a NaN/inf loss; every refusal
    (a bad value, another corpus on resume) comes before anything in ``out`` is written."""
    with lock.hold(out):
        return _train(model_cfg, cfg, Path(out), resume_from, on_event)


def _train(model_cfg: GPTConfig, cfg: TrainConfig, out: Path, resume_from: Path | None,
           on_event: OnEvent | None) -> TrainResult:
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
        cfg.init_from, model_cfg, _adapters(cfg), saved and saved[1]["meta"])
    corpus = _prepare_data(out, cfg, seq_len, rank, trained_on, start_from)
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
    if start >= cfg.max_steps:
        return TrainResult(out, start, 0, log.last("val_loss"), None, checkpoint.latest(out))
    if start == 0:
        log.add({"step": 0, "val_loss": run.evaluate()})
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
            log.add({"step": step, "val_loss": run.evaluate()})
            log.plot()
            report("eval", {"step": step, "loss": loss, "val_loss": log.last("val_loss")})
        if step % cfg.save_every == 0 or step == cfg.max_steps:
            checkpoint.save(out, step, run.model, run.optimizer, meta={**meta, "step": step}, keep=cfg.keep)
    log.plot()
    timed = seconds[1:] or seconds  # the first step pays for warm-up (and compilation)
    rate = tokens_per_step * len(timed) / sum(timed)
    return TrainResult(out, cfg.max_steps, cfg.max_steps - start, log.last("val_loss"), rate, checkpoint.latest(out))


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
        torch.manual_seed(stream_seed(cfg.seed, "dropout", self.rank, step))
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
        self.model.eval()
        rows = self.cfg.batch_size // self.cfg.grad_accum
        total = torch.zeros((), device=self.device)
        for i in range(self.cfg.eval_batches):
            x, y, doc_ids = self.corpus.batch("val", seed=self.cfg.seed, step=i, batch_size=rows,
                                              part=self.rows.part, parts=self.rows.parts)
            with self.autocast:
                total += self._forward(x, y, doc_ids)[1].float()
        self.model.train()
        return parallel.mean_over_ranks(total / self.cfg.eval_batches, self.world).item()

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
