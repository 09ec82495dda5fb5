"""Train a GPT on text (the built-in corpus or --data); torchrun for DDP/FSDP2; --resume.

``selfattn train --preset tiny --out runs/tiny`` trains on the built-in corpus (Python's own
documentation) and writes the run folder described in :mod:`selfattn.training.loop`. The sizes and
the training knobs people tune are flags; ``--set FIELD=VALUE`` sets any other field of ``GPTConfig``
or ``TrainConfig``; ``--preset`` and ``--config FILE.json`` set other defaults. Under ``torchrun``
only rank 0 prints.
"""
from __future__ import annotations

import argparse
import os
import shlex
import sys
from pathlib import Path

from selfattn._util import progress as _progress
from selfattn.cli import INTERRUPTED, flags
from selfattn.config import GPTConfig
from selfattn.families.writing import ARCHS
from selfattn.training import checkpoint, lock, parallel
from selfattn.training.checkpoint import BEST
from selfattn.training.config import TrainConfig
from selfattn.training.loop import Diverged, TrainResult, train
from selfattn.training.presets import PRESETS
from selfattn.training.resume import resolve_configs

EXAMPLE = "selfattn train --preset tiny --out runs/tiny"


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--out", default=argparse.SUPPRESS, metavar="FOLDER",
                   help="run folder to write (or --resume) [runs/<preset>, or runs/default]")
    p.add_argument("--preset", choices=sorted(PRESETS), default=None, help="model and training sizes to start from")
    p.add_argument("--arch", choices=ARCHS, default=None,
                   help="the block of a model family (over the preset's sizes); selfattn export then writes "
                        "that family's transformers folder")
    p.add_argument("--config", default=None, metavar="FILE.json",
                   help='JSON {"model": {GPTConfig fields}, "train": {TrainConfig fields}} over the preset')
    p.add_argument("--resume", action="store_true",
                   help="continue the run in --out from its newest checkpoint, with its configs; "
                        "flags given here change training fields")
    flags.add_base(p)
    flags.add_flags(p, GPTConfig, only=MODEL_FLAGS, title="the model (--set, presets and --config set the rest)")
    flags.add_flags(p, TrainConfig, only=TRAIN_FLAGS, title="training (--set, presets and --config set the rest)")
    flags.add_set(p, GPTConfig, TrainConfig)


# the fields a user reaches for as flags; every other one is --set FIELD=VALUE
MODEL_FLAGS = ("n_layer", "n_head", "n_embd", "n_kv_head", "block_size", "dropout", "bias")
TRAIN_FLAGS = ("data", "init_from", "tokenizer", "seq_len", "pack", "batch_size", "grad_accum", "max_steps", "lr",
               "min_lr", "warmup_steps", "weight_decay", "grad_clip", "eval_every", "save_every", "seed", "device",
               "bf16", "compile", "checkpoint_activations", "fsdp", "context_parallel", "lora_rank", "lora_alpha",
               "lora_dropout", "lora_mlp")


def main(args: argparse.Namespace) -> int:
    status = _train(args)
    if parallel.launched():  # the process group is left by now
        _exit_now(status)
    return status


def _exit_now(status: int) -> None:
    """End a run on a process group without interpreter finalisation. gloo's threads can outlive
    ``destroy_process_group``, and a rank then aborted at exit ("terminate called without an active
    exception", status -6) after its work was done and saved (a two-process FSDP test of a full
    suite on a loaded 2-core machine). Everything the run writes is closed (checkpoints atomically)
    before this; standard output and error are flushed."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(status)


def _train(args: argparse.Namespace) -> int:
    flags.check_set(args, GPTConfig, TrainConfig)
    model_flags, train_flags = flags.given(args, GPTConfig), flags.given(args, TrainConfig)  # before any folder
    out = Path(getattr(args, "out", None) or f"runs/{args.preset or 'default'}")
    with lock.hold(out):  # before the configs are read: another run may be saving (and pruning) there
        model_cfg, train_cfg, resume_from, source = resolve_configs(
            out, preset=args.preset, config=args.config, resume=args.resume, arch=args.arch,
            model_flags=model_flags, train_flags=train_flags)
        progress = _Progress()
        try:
            with progress:  # the bar is closed before anything else is printed
                result = train(model_cfg, train_cfg, out, resume_from=resume_from, on_event=progress, source=source,
                               **flags.base_of(args))
            parallel.barrier()  # every rank is done before any tears the process group down
            if parallel.rank() == 0:
                print(_summary(result, train_cfg))
            return 0
        except KeyboardInterrupt:  # Ctrl-C: where the run stands and how it goes on
            if parallel.rank() == 0:
                print(f"selfattn train: {interrupted(out, progress.step)}", file=sys.stderr, flush=True)
            return INTERRUPTED
        except Diverged as e:
            if parallel.rank() == 0:
                print(f"selfattn train: error: {e}", file=sys.stderr, flush=True)
            return 1
        finally:
            parallel.shutdown()


def interrupted(out: Path, step: int | None) -> str:
    """What Ctrl-C at ``step`` (None: before the first) of the run in ``out`` leaves: its last checkpoint,
    and the command that continues from it (or starts again, when there is none)."""
    at = "before the first step" if step is None else f"at step {step}"
    saved = checkpoint.checkpoints(Path(out))
    if not saved:
        return f"interrupted {at}; no checkpoint was saved yet, so there is nothing to resume: run the command again"
    last, path = saved[-1]
    return (f"interrupted {at}; the last checkpoint is step {last} ({path}): continue with: "
            f"selfattn train --resume --out {shlex.quote(str(out))}")


class _Progress:
    """The terminal view of a run (rank 0 only gets events): a header, a tqdm bar, eval lines; ``step``,
    the last step done (None: none yet)."""

    def __init__(self) -> None:
        self.bar, self.step = None, None

    def __enter__(self) -> _Progress:
        self.bar = None
        return self

    def __exit__(self, *exc) -> None:
        if self.bar is not None:
            self.bar.close()

    def __call__(self, kind: str, r: dict) -> None:
        if kind == "start":
            n = r["context_parallel"]
            ranks = f"{r['world']} rank(s)" + (f" ({r['world'] // n} x {n}: each sequence over {n})" if n > 1 else "")
            trained = "" if r["trained"] == r["params"] else f" ({r['trained'] / 1e6:.2f}M trained: LoRA adapters)"
            print(f"selfattn train: {r['params'] / 1e6:.2f}M parameters{trained}, {r['data']}, "
                  f"{r['train_tokens']:,} train / {r['val_tokens']:,} val tokens, {ranks} on {r['device']}, "
                  f"run folder {r['out']}"
                  + (f", resuming at step {r['start']}" if r["start"] else ""), flush=True)
            if r["start"] < r["max_steps"]:
                self.bar = _tqdm()(total=r["max_steps"], initial=r["start"], unit="step", dynamic_ncols=True,
                                   mininterval=0.5, disable=not _progress.enabled())  # eval lines print all the same
        elif kind == "step":
            self.step = r["step"]
            self.bar.set_postfix_str(f"loss {r['loss']:.3f}, {r['tokens_per_s']:,.0f} tok/s", refresh=False)
            self.bar.update(1)
        elif kind == "eval":
            self.bar.write(f"step {r['step']}: " + ("" if r["loss"] is None else f"train loss {r['loss']:.4f}, ")
                           + f"val loss {r['val_loss']:.4f}"
                           + ("" if r["general_loss"] is None else f", general loss {r['general_loss']:.4f}")
                           + (" (the best so far)" if r["best_step"] == r["step"] else ""))
            for warning in r["warnings"]:
                self.bar.write(f"warning: {warning}")


def _summary(result: TrainResult, cfg: TrainConfig) -> str:
    if result.trained == 0:
        return (f"selfattn train: nothing to do, {result.out} already reached max_steps={cfg.max_steps}; "
                f"pass --max-steps N to train further")
    watch = result.watch
    return (f"selfattn train: done, step {result.step}, val loss {result.val_loss:.4f}, "
            f"{result.tokens_per_s:,.0f} tokens/s; checkpoint {result.checkpoint}, loss curve "
            f"{result.out / 'loss.png'}\nthe best val loss, {watch.best_val:.4f} at step {watch.best_step}, is "
            f"{result.out / BEST}: the run folder means it to sample, eval, export and serve (the last: "
            f"--ckpt {result.checkpoint})"
            + ("" if watch.start_general is None else f"\nthe general loss: {watch.start_general:.4f} before "
               f"training, {watch.last_general:.4f} at the end ({watch.last_general - watch.start_general:+.4f})")
            + f"\nsample from it: selfattn sample --ckpt {result.out}")


def _tqdm():
    try:
        from tqdm import tqdm
    except ImportError as e:
        raise ImportError("the progress bar needs 'tqdm': pip install 'selfattn[train]'") from e
    return tqdm
