"""The checkpoint format of ``selfattn train``, read: one safetensors file per save, no pickles.

A checkpoint ``RUN/ckpt-0000200.safetensors`` holds

- ``model/<name>``: the weights, a tied weight stored once (its other names are listed in
  the metadata and restored on load);
- ``optim/<param name>/<key>``: the optimizer state (AdamW's ``step``, ``exp_avg``, ``exp_avg_sq``);
- metadata (JSON): the configs, the step and anything else the trainer passes, the optimizer's
  ``param_groups``, and a SHA-256 digest of everything else in the file (:func:`digest`): every
  tensor's name, dtype, shape and bytes, and the header's canonical JSON (``sort_keys``) without the
  digest. It is checked on every read, so a one-digit edit of ``"step"`` or ``"lr"`` is refused.

Beside them, ``RUN/best.safetensors`` (:data:`BEST`) is the checkpoint of the evaluation with the
lowest val loss; a run folder given to a command that loads it means that one (:func:`read_run`).

A truncated, corrupted or foreign file is a :class:`CheckpointError` naming the file; when the
newest checkpoint of a run folder is damaged, :func:`read_latest` also names the newest older
one that is intact and how to continue from it. Writing them (atomically, and pruning) is
:mod:`selfattn.training.checkpoint`'s.
"""
from __future__ import annotations

import hashlib
import json
import os
import re
from pathlib import Path

import torch

from selfattn._util.validate import one_line

FORMAT = "selfattn-checkpoint-2"
_OLDER = {"selfattn-checkpoint-1": "its digest covers the tensors but not the header"}  # formats this one replaced
_HEADER_KEYS = ("meta", "aliases", "param_groups", "optim_scalars", "sha256")
_NAME = re.compile(r"^ckpt-(\d+)\.safetensors$")
BEST = "best.safetensors"  # a run's checkpoint of the lowest val loss, kept apart from the newest ones


class CheckpointError(ValueError):
    """A checkpoint that cannot be read; the message is one line naming the file."""


def path_for(run_dir: str | os.PathLike, step: int) -> Path:
    return Path(run_dir) / f"ckpt-{step:07d}.safetensors"


def latest(run_dir: str | os.PathLike) -> Path | None:
    """The checkpoint with the highest step in ``run_dir``, or None."""
    found = checkpoints(Path(run_dir))
    return found[-1][1] if found else None


def read_run(run_dir: str | os.PathLike) -> tuple[Path, dict[str, torch.Tensor], dict] | None:
    """(path, tensors, header) of the checkpoint a run folder gives the commands that load it: its
    best by val loss (:data:`BEST`) when it has one, else its newest (:func:`read_latest`); None when
    it has none. Resuming reads the newest, never this."""
    best = Path(run_dir) / BEST
    return (best, *read(best)) if best.is_file() else read_latest(run_dir)


def read_latest(run_dir: str | os.PathLike) -> tuple[Path, dict[str, torch.Tensor], dict] | None:
    """(path, tensors, header) of the newest checkpoint in ``run_dir``, or None when it has none.
    When the newest is damaged, the :class:`CheckpointError` also says which older one is
    intact and how to continue from it."""
    found = checkpoints(Path(run_dir))
    if not found:
        return None
    newest = found[-1][1]
    try:
        return newest, *read(newest)
    except CheckpointError as e:
        if not newest.exists():  # pruned by the run saving there since we listed the folder
            return read_latest(run_dir)
        raise CheckpointError(f"{e}; {_intact_before(found[:-1], newest)}") from None


def read(path: str | os.PathLike) -> tuple[dict[str, torch.Tensor], dict]:
    """(tensors, header) of a checkpoint file, integrity-checked; all tensors on the CPU."""
    path = Path(path)
    if not path.is_file():
        raise CheckpointError(f"checkpoint {path} does not exist")
    safetensors = import_safetensors()
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
    if digest(tensors, header) != header["sha256"]:
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


def checkpoints(run_dir: Path) -> list[tuple[int, Path]]:
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


def digest(tensors: dict[str, torch.Tensor], header: dict) -> str:
    """SHA-256 of all a checkpoint holds but this digest: the header's canonical JSON without
    ``sha256``, then every tensor's name, dtype, shape and bytes."""
    h = hashlib.sha256(json.dumps({k: v for k, v in header.items() if k != "sha256"}, sort_keys=True).encode())
    for name in sorted(tensors):
        t = tensors[name]
        h.update(f"{name}|{t.dtype}|{tuple(t.shape)}|".encode())
        h.update(t.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy())  # the raw bytes, no copy
    return h.hexdigest()


def import_safetensors():
    try:
        import safetensors
        import safetensors.torch
    except ImportError as e:
        raise ImportError("checkpoints need the 'safetensors' package: pip install 'selfattn[train]'") from e
    return safetensors
