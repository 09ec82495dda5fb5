"""Which configs a run starts from, and what a resumed run keeps (:func:`resolve_configs`).

A new run layers the dataclass defaults < a preset < an architecture (a family's block) < a JSON
file < the flags (or takes the model's own config with ``--init-from``); a resumed run layers the
newest checkpoint's configs < the flags, refusing flags that would change its model shape or its
tokens, a repeated preset, architecture or file that disagrees with the run, and a launch (one
process, or torchrun) that cannot serve the run's settings.
"""
from __future__ import annotations

import dataclasses
import json
import os
from pathlib import Path

from selfattn._util import validate as _validate
from selfattn.config import GPTConfig
from selfattn.families import writing
from selfattn.training import checkpoint, finetune, parallel
from selfattn.training.config import TrainConfig
from selfattn.training.presets import PRESETS

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


def resolve_configs(out: str | os.PathLike, *, preset: str | None = None, config: str | None = None,
                    resume: bool = False, model_flags: dict | None = None, train_flags: dict | None = None,
                    arch: str | None = None) -> tuple[GPTConfig, TrainConfig, Path | None, finetune.Source | None]:
    """(model config, train config, checkpoint to resume from or None, the ``--init-from`` model loaded for a
    new run to take, :class:`~selfattn.training.finetune.Source`, or None), layered: dataclass
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
        return GPTConfig(**{**meta["model"], **model_flags}), train_cfg, ckpt, None
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
        given = finetune.Source(train_cfg.init_from)
        return finetune.changed_config(given.loaded.model, model_flags, given.path), train_cfg, None, given
    return GPTConfig(**{**model_vals, **model_flags}), train_cfg, None, None


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
