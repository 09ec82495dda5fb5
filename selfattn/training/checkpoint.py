"""Training checkpoints: one safetensors file per save, no pickles, written atomically.

A checkpoint ``RUN/ckpt-0000200.safetensors`` holds

- ``model/<name>``: the weights, a tied weight stored once (its other names are listed in
  the metadata and restored on load);
- ``optim/<param name>/<key>``: the optimizer state (AdamW's ``step``, ``exp_avg``, ``exp_avg_sq``);
- metadata (JSON): the configs, the step and anything else the trainer passes, the optimizer's
  ``param_groups``, and a SHA-256 digest of everything else in the file: every tensor's name,
  dtype, shape and bytes, and the header's canonical JSON (``sort_keys``) without the digest.
  It is checked on every read, so a one-digit edit of ``"step"`` or ``"lr"`` is refused.

Saving writes a temporary file in the same folder, fsyncs it, renames it over the final
name (atomic on POSIX) and fsyncs the folder, so a kill at any moment leaves every earlier
checkpoint intact; older checkpoints beyond ``keep`` are deleted only after the rename.

Under ``torch.distributed`` (DDP or FSDP2), :func:`save` and :func:`load` are collective:
every rank calls them, full weights and optimizer state are gathered, and rank 0 alone
writes. Every rank reads the same file on load, so the run folder must be visible to all.
A truncated, corrupted or foreign file is a :class:`CheckpointError` naming the file; when the
newest checkpoint of a run folder is damaged, :func:`read_latest` also names the newest older
one that is intact and how to continue from it.
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

FORMAT = "selfattn-checkpoint-2"
_OLDER = {"selfattn-checkpoint-1": "its digest covers the tensors but not the header"}  # formats this one replaced
_HEADER_KEYS = ("meta", "aliases", "param_groups", "optim_scalars", "sha256")
_NAME = re.compile(r"^ckpt-(\d+)\.safetensors$")


class CheckpointError(ValueError):
    """A checkpoint that cannot be read; the message is one line naming the file."""


def path_for(run_dir: str | os.PathLike, step: int) -> Path:
    return Path(run_dir) / f"ckpt-{step:07d}.safetensors"


def latest(run_dir: str | os.PathLike) -> Path | None:
    """The checkpoint with the highest step in ``run_dir``, or None."""
    found = _checkpoints(Path(run_dir))
    return found[-1][1] if found else None


def read_latest(run_dir: str | os.PathLike) -> tuple[Path, dict[str, torch.Tensor], dict] | None:
    """(path, tensors, header) of the newest checkpoint in ``run_dir``, or None when it has none.
    When the newest is damaged, the :class:`CheckpointError` also says which older one is
    intact and how to continue from it."""
    found = _checkpoints(Path(run_dir))
    if not found:
        return None
    newest = found[-1][1]
    try:
        return newest, *read(newest)
    except CheckpointError as e:
        if not newest.exists():  # pruned by the run saving there since we listed the folder
            return read_latest(run_dir)
        raise CheckpointError(f"{e}; {_intact_before(found[:-1], newest)}") from None


def save(run_dir: str | os.PathLike, step: int, model: nn.Module, optimizer: torch.optim.Optimizer, *,
         meta: dict, keep: int) -> Path:
    """Write ``ckpt-<step>.safetensors`` atomically (``run_dir`` is created if missing) and keep
    the newest ``keep`` checkpoints.

    ``meta`` is any JSON-serialisable dict (configs, progress); it comes back from :func:`load`.
    ``model`` may be wrapped in DDP, FSDP2 or ``torch.compile``. Collective under distributed.
    """
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict

    model_sd, optim_sd = get_state_dict(model, optimizer,
                                        options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    path = path_for(run_dir, step)
    if rank() != 0:
        return path
    path.parent.mkdir(parents=True, exist_ok=True)
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
    header = json.loads(json.dumps({"format": FORMAT, "meta": meta, "aliases": aliases,  # as a reader parses it
                                    "param_groups": optim_sd["param_groups"], "optim_scalars": scalars}))
    header["sha256"] = _digest(tensors, header)
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
    return restore(path, tensors, header, model, optimizer)


def restore(path: str | os.PathLike, tensors: dict[str, torch.Tensor], header: dict, model: nn.Module,
            optimizer: torch.optim.Optimizer | None = None) -> dict:
    """:func:`load` of a checkpoint already :func:`read` from ``path`` (named in errors): its
    weights into ``model``, its state into ``optimizer`` when given; returns its ``meta``."""
    model_sd = weights_of(tensors, header)
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
    if not isinstance(header, dict) or not str(header.get("format", "")).startswith("selfattn-checkpoint-"):
        raise CheckpointError(f"checkpoint {path} is not a selfattn checkpoint (no {FORMAT!r} header)")
    if header["format"] != FORMAT:
        why = _OLDER.get(header["format"], "it was written by a newer selfattn")
        raise CheckpointError(f"checkpoint {path} has format {header['format']!r}, which this selfattn does not "
                              f"read ({why}); it reads {FORMAT!r}")
    missing = [key for key in _HEADER_KEYS if key not in header]
    if missing:
        raise CheckpointError(f"checkpoint {path} is corrupted (its header lacks {', '.join(missing)})")
    if _digest(tensors, header) != header["sha256"]:
        raise CheckpointError(f"checkpoint {path} is corrupted (SHA-256 of its tensors and header does not match)")
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
    return weights_of(tensors, header), header["meta"]


def weights_of(tensors: dict[str, torch.Tensor], header: dict) -> dict[str, torch.Tensor]:
    """The model weights of a checkpoint :func:`read` returned, tied names restored."""
    weights = {k.removeprefix("model/"): v for k, v in tensors.items() if k.startswith("model/")}
    for alias, source in header["aliases"].items():
        weights[alias] = weights[source]
    return weights


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


def _checkpoints(run_dir: Path) -> list[tuple[int, Path]]:
    """(step, path) of every checkpoint in ``run_dir``, oldest first."""
    return sorted((int(m.group(1)), p) for p in run_dir.glob("ckpt-*.safetensors") if (m := _NAME.match(p.name)))


def _intact_before(older: list[tuple[int, Path]], damaged: Path) -> str:
    """Which of the ``older`` checkpoints (oldest first) is the newest intact one, and what to do."""
    for step, path in reversed(older):
        try:
            read(path)
        except CheckpointError:
            continue
        return (f"the older {path.name} (step {step}) is intact: move the damaged file away "
                f"(mv {damaged} {damaged}.damaged) to continue from it")
    return "no older checkpoint is intact" if older else "it is the run's only checkpoint"


def remove_temporaries(run_dir: str | os.PathLike) -> None:
    """Delete what killed saves left in ``run_dir``: our temporaries ``.ckpt-*.safetensors.tmp-<pid>``
    and those of the safetensors writer itself (``.tmpXXXXXX``, renamed to ours when complete).
    Only where no save is in flight: one run saves in a run folder (its lock)."""
    _files.remove_temporaries(run_dir, "ckpt-*.safetensors")
    for tmp in Path(run_dir).glob(".tmp??????"):
        tmp.unlink(missing_ok=True)


def _prune(run_dir: Path, keep: int) -> None:
    """Delete checkpoints older than the newest ``keep``, and temporaries of killed saves."""
    found = _checkpoints(run_dir)
    for _, p in found[:max(len(found) - keep, 0)]:
        p.unlink()
    remove_temporaries(run_dir)


def _digest(tensors: dict[str, torch.Tensor], header: dict) -> str:
    """SHA-256 of all a checkpoint holds but this digest: the header's canonical JSON without
    ``sha256``, then every tensor's name, dtype, shape and bytes."""
    h = hashlib.sha256(json.dumps({k: v for k, v in header.items() if k != "sha256"}, sort_keys=True).encode())
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
