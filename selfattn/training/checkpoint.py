"""Training checkpoints written: one safetensors file per save (the format, and reading it:
:mod:`selfattn.formats.checkpoint`), written atomically, restored into a model and its optimizer.

Saving writes a temporary file in the same folder, fsyncs it, renames it over the final
name (atomic on POSIX) and fsyncs the folder, so a kill at any moment leaves every earlier
checkpoint intact; older checkpoints beyond ``keep`` are deleted only after the rename.

Under ``torch.distributed`` (DDP or FSDP2), :func:`save` and :func:`load` are collective:
every rank calls them, full weights and optimizer state are gathered, and rank 0 alone
writes. Every rank reads the same file on load, so the run folder must be visible to all.
"""
from __future__ import annotations

import json
import os
from pathlib import Path

import torch
from torch import nn

from selfattn._util import files as _files
from selfattn._util.validate import one_line
from selfattn.formats.checkpoint import (  # noqa: F401  (the format's names, public here too)
    BEST,
    FORMAT,
    CheckpointError,
    checkpoints,
    digest,
    import_safetensors,
    latest,
    path_for,
    read,
    read_latest,
    read_run,
    read_weights,
    weights_of,
)
from selfattn.training.parallel import rank, unwrap


def save(run_dir: str | os.PathLike, step: int, model: nn.Module, optimizer: torch.optim.Optimizer, *,
         meta: dict, keep: int, best: bool = False) -> Path:
    """Write ``ckpt-<step>.safetensors`` atomically (``run_dir`` is created if missing) and keep
    the newest ``keep`` checkpoints; with ``best``, write the run's best checkpoint instead
    (``best.safetensors``: its weights alone, for using, not resuming; replaced, never pruned).

    ``meta`` is any JSON-serialisable dict (configs, progress); it comes back from :func:`load`.
    ``model`` may be wrapped in DDP, FSDP2 or ``torch.compile``. Collective under distributed.
    Frozen parameters are not written (LoRA: the base model's, which the meta names by path and digest).
    """
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict

    model_sd, optim_sd = get_state_dict(model, optimizer,
                                        options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    if best:  # the best is for using, never for resuming: its weights alone
        optim_sd = {"state": {}, "param_groups": []}
    path = Path(run_dir) / BEST if best else path_for(run_dir, step)
    if rank() != 0:
        return path
    path.parent.mkdir(parents=True, exist_ok=True)
    frozen = frozen_names(model)
    aliases = {alias: name for alias, name in tied_names(model).items() if name not in frozen}
    tensors = {f"model/{k}": v for k, v in model_sd.items() if k not in aliases and k not in frozen}
    scalars = {}
    for name, state in optim_sd["state"].items():
        for key, value in state.items():
            if isinstance(value, torch.Tensor):
                tensors[f"optim/{name}/{key}"] = value
            else:
                scalars[f"{name}/{key}"] = value
    tensors = {k: v.detach().contiguous() for k, v in tensors.items()}
    header = json.loads(json.dumps({"format": FORMAT, "meta": meta, "aliases": aliases,  # as a reader parses it
                                    "param_groups": optim_sd["param_groups"], "optim_scalars": scalars}))
    header["sha256"] = digest(tensors, header)
    _write_atomic(path, tensors, json.dumps(header))
    if not best:
        _prune(Path(run_dir), keep)
    return path


def load(path: str | os.PathLike, model: nn.Module | None = None,
         optimizer: torch.optim.Optimizer | None = None) -> dict:
    """Read a checkpoint; load its weights into ``model`` and its state into ``optimizer``
    when given; return the ``meta`` dict it was saved with. Raises :class:`CheckpointError`."""
    tensors, header = read(path)
    if model is None:
        if optimizer is not None:
            raise ValueError("load: an optimizer can only be restored together with its model")
        return header["meta"]
    return restore(path, tensors, header, model, optimizer)


def restore(path: str | os.PathLike, tensors: dict[str, torch.Tensor], header: dict, model: nn.Module,
            optimizer: torch.optim.Optimizer | None = None) -> dict:
    """:func:`load` of a checkpoint already :func:`read` from ``path`` (named in errors): its
    weights into ``model``, its state into ``optimizer`` when given; returns its ``meta``."""
    model_sd = weights_of(tensors, header)
    frozen = frozen_names(model)
    expected = set(unwrap(model).state_dict()) - frozen
    if set(model_sd) != expected:  # checked here: a full-state-dict load would silently keep missing keys
        missing, unexpected = sorted(expected - set(model_sd)), sorted(set(model_sd) - expected)
        raise CheckpointError(f"checkpoint {path} does not fit this model: missing {missing[:4]}, "
                              f"unexpected {unexpected[:4]}")
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_state_dict

    optim_sd = {}
    if optimizer is not None:
        state: dict = {}
        for key, value in tensors.items():
            if key.startswith("optim/"):
                name, stat = key.removeprefix("optim/").rsplit("/", 1)
                state.setdefault(name, {})[stat] = value
        for key, value in header["optim_scalars"].items():
            name, stat = key.rsplit("/", 1)
            state.setdefault(name, {})[stat] = value
        optim_sd = {"state": state, "param_groups": header["param_groups"]}
    try:
        set_state_dict(model, optimizer if optimizer is not None else (), model_state_dict=model_sd,
                       optim_state_dict=optim_sd, options=StateDictOptions(full_state_dict=True, strict=not frozen))
    except (RuntimeError, KeyError, ValueError) as e:
        raise CheckpointError(f"checkpoint {path} does not fit this model/optimizer: {one_line(e)}") from None
    return header["meta"]


def tied_names(model: nn.Module) -> dict[str, str]:
    """{alias: name} for parameters reachable under several names (``lm_head.weight`` ->
    ``wte.weight``); names as in the unwrapped model's ``state_dict``."""
    first: dict[int, str] = {}
    aliases = {}
    for name, p in unwrap(model).named_parameters(remove_duplicate=False):
        if id(p) in first:
            aliases[name] = first[id(p)]
        else:
            first[id(p)] = name
    return aliases


def frozen_names(model: nn.Module) -> set[str]:
    """The state-dict names of the parameters that do not train (every name of a tied one)."""
    return {name for name, p in unwrap(model).named_parameters(remove_duplicate=False) if not p.requires_grad}


def _write_atomic(path: Path, tensors: dict, header_json: str) -> None:
    safetensors = import_safetensors()
    with _files.atomic_path(path) as tmp:
        safetensors.torch.save_file(tensors, str(tmp), metadata={"selfattn": header_json})


def remove_temporaries(run_dir: str | os.PathLike) -> None:
    """Delete what killed saves left in ``run_dir``: our temporaries ``.ckpt-*.safetensors.tmp-<pid>``
    and those of the safetensors writer itself (``.tmpXXXXXX``, renamed to ours when complete).
    Only where no save is in flight: one run saves in a run folder (its lock)."""
    _files.remove_temporaries(run_dir, "ckpt-*.safetensors")
    _files.remove_temporaries(run_dir, BEST)
    for tmp in Path(run_dir).glob(".tmp??????"):
        tmp.unlink(missing_ok=True)


def _prune(run_dir: Path, keep: int) -> None:
    """Delete checkpoints older than the newest ``keep``, and temporaries of killed saves."""
    found = checkpoints(run_dir)
    for _, p in found[:max(len(found) - keep, 0)]:
        p.unlink()
    remove_temporaries(run_dir)


