"""Training checkpoints: one safetensors file per save, no pickles, written atomically.

A checkpoint ``RUN/ckpt-0000200.safetensors`` holds

- ``model/<name>``: the weights, a tied weight stored once (its other names are listed in
  the metadata and restored on load);
- ``optim/<param name>/<key>``: the optimizer state (AdamW's ``step``, ``exp_avg``, ``exp_avg_sq``);
- metadata (JSON): the configs, the step and anything else the trainer passes, the optimizer's
  ``param_groups``, and a SHA-256 digest of all tensor bytes, checked on every load.

Saving writes a temporary file in the same folder, fsyncs it, renames it over the final
name (atomic on POSIX) and fsyncs the folder, so a kill at any moment leaves every earlier
checkpoint intact; older checkpoints beyond ``keep`` are deleted only after the rename.

Under ``torch.distributed`` (DDP or FSDP2), :func:`save` and :func:`load` are collective:
every rank calls them, full weights and optimizer state are gathered, and rank 0 alone
writes. Every rank reads the same file on load, so the run folder must be visible to all.
A truncated, corrupted or foreign file is a :class:`CheckpointError` naming the file.
"""
from __future__ import annotations

import hashlib
import json
import os
import re
from pathlib import Path

import torch
from torch import nn

from selfattn import _files
from selfattn._validate import one_line
from selfattn.training.parallel import rank, unwrap

FORMAT = "selfattn-checkpoint-1"
_NAME = re.compile(r"^ckpt-(\d+)\.safetensors$")


class CheckpointError(ValueError):
    """A checkpoint that cannot be read; the message is one line naming the file."""


def path_for(run_dir: str | os.PathLike, step: int) -> Path:
    return Path(run_dir) / f"ckpt-{step:07d}.safetensors"


def latest(run_dir: str | os.PathLike) -> Path | None:
    """The checkpoint with the highest step in ``run_dir``, or None."""
    found = [(int(m.group(1)), p) for p in Path(run_dir).glob("ckpt-*.safetensors") if (m := _NAME.match(p.name))]
    return max(found)[1] if found else None


def save(run_dir: str | os.PathLike, step: int, model: nn.Module, optimizer: torch.optim.Optimizer, *,
         meta: dict, keep: int) -> Path:
    """Write ``ckpt-<step>.safetensors`` atomically and keep the newest ``keep`` checkpoints.

    ``meta`` is any JSON-serialisable dict (configs, progress); it comes back from :func:`load`.
    ``model`` may be wrapped in DDP, FSDP2 or ``torch.compile``. Collective under distributed.
    """
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict

    model_sd, optim_sd = get_state_dict(model, optimizer,
                                        options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    path = path_for(run_dir, step)
    if rank() != 0:
        return path
    aliases = tied_names(model)
    tensors = {f"model/{k}": v for k, v in model_sd.items() if k not in aliases}
    scalars = {}
    for name, state in optim_sd["state"].items():
        for key, value in state.items():
            if isinstance(value, torch.Tensor):
                tensors[f"optim/{name}/{key}"] = value
            else:
                scalars[f"{name}/{key}"] = value
    tensors = {k: v.detach().contiguous() for k, v in tensors.items()}
    header = {"format": FORMAT, "meta": meta, "aliases": aliases, "param_groups": optim_sd["param_groups"],
              "optim_scalars": scalars, "sha256": _digest(tensors)}
    _write_atomic(path, tensors, json.dumps(header))
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
    model_sd = {k.removeprefix("model/"): v for k, v in tensors.items() if k.startswith("model/")}
    for alias, source in header["aliases"].items():
        model_sd[alias] = model_sd[source]
    expected = set(unwrap(model).state_dict())
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
                       optim_state_dict=optim_sd, options=StateDictOptions(full_state_dict=True))
    except (RuntimeError, KeyError, ValueError) as e:
        raise CheckpointError(f"checkpoint {path} does not fit this model/optimizer: {one_line(e)}") from None
    return header["meta"]


def read(path: str | os.PathLike) -> tuple[dict[str, torch.Tensor], dict]:
    """(tensors, header) of a checkpoint file, integrity-checked; all tensors on the CPU."""
    path = Path(path)
    if not path.is_file():
        raise CheckpointError(f"checkpoint {path} does not exist")
    safetensors = _import_safetensors()
    try:
        with safetensors.safe_open(str(path), framework="pt") as f:
            header = json.loads((f.metadata() or {}).get("selfattn", "null"))
            tensors = {k: f.get_tensor(k) for k in f.keys()}
    except Exception as e:  # the Rust reader raises its own types for malformed files
        raise CheckpointError(f"checkpoint {path} is truncated or corrupted ({one_line(e)})") from None
    if not isinstance(header, dict) or header.get("format") != FORMAT:
        raise CheckpointError(f"checkpoint {path} is not a selfattn checkpoint (no {FORMAT!r} header)")
    if _digest(tensors) != header["sha256"]:
        raise CheckpointError(f"checkpoint {path} is corrupted (SHA-256 of its tensors does not match)")
    return tensors, header


def read_weights(path: str | os.PathLike) -> tuple[dict[str, torch.Tensor], dict | None]:
    """(model weights with tied names restored, the checkpoint's meta). Besides our checkpoints
    this reads a state dict saved with ``torch.save`` (``.pt``/``.pth``/``.bin``; meta None)
    with ``weights_only=True``, so a pickle that would run code is refused, never executed."""
    path = Path(path)
    if path.suffix in (".pt", ".pth", ".bin"):
        if not path.is_file():
            raise CheckpointError(f"checkpoint {path} does not exist")
        try:
            state = torch.load(path, map_location="cpu", weights_only=True)
        except Exception as e:  # UnpicklingError for unsafe payloads, others for truncation
            raise CheckpointError(f"checkpoint {path} was refused or is corrupted ({one_line(e)})") from None
        if not isinstance(state, dict) or not all(isinstance(v, torch.Tensor) for v in state.values()):
            raise CheckpointError(f"checkpoint {path} is not a state dict of tensors")
        return state, None
    tensors, header = read(path)
    weights = {k.removeprefix("model/"): v for k, v in tensors.items() if k.startswith("model/")}
    for alias, source in header["aliases"].items():
        weights[alias] = weights[source]
    return weights, header["meta"]


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


def _write_atomic(path: Path, tensors: dict, header_json: str) -> None:
    safetensors = _import_safetensors()
    with _files.atomic_path(path) as tmp:
        safetensors.torch.save_file(tensors, str(tmp), metadata={"selfattn": header_json})


def _prune(run_dir: Path, keep: int) -> None:
    """Delete checkpoints older than the newest ``keep``, and temporaries of killed saves."""
    found = sorted((int(m.group(1)), p) for p in run_dir.glob("ckpt-*.safetensors") if (m := _NAME.match(p.name)))
    for _, p in found[:max(len(found) - keep, 0)]:
        p.unlink()
    for tmp in run_dir.glob(".ckpt-*.safetensors.tmp-*"):
        tmp.unlink(missing_ok=True)  # only rank 0 of one run saves here, so no save is in flight


def _digest(tensors: dict[str, torch.Tensor]) -> str:
    h = hashlib.sha256()
    for name in sorted(tensors):
        t = tensors[name]
        h.update(f"{name}|{t.dtype}|{tuple(t.shape)}|".encode())
        h.update(t.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy())  # the raw bytes, no copy
    return h.hexdigest()


def _import_safetensors():
    try:
        import safetensors
        import safetensors.torch
    except ImportError as e:
        raise ImportError("checkpoints need the 'safetensors' package: pip install 'selfattn[train]'") from e
    return safetensors
