"""A ``peft`` LoRA adapter folder, written and read: ``adapter_config.json`` and ``adapter_model.safetensors``.

The adapters of a model with LoRA (:mod:`selfattn.lora`) under the names ``peft`` gives
them on a family's ``transformers`` model: each part of our linear ``key`` is the module the
family names (``family.sources``: ``blocks.0.attn.qkv.weight`` -> ``model.layers.0.self_attn.q_proj.weight``,
``k_proj``, ``v_proj``), and its adapter is ``base_model.model.<module>.lora_A.weight`` ``(r, in)``
and ``...lora_B.weight`` ``(rows, r)``. Our ``lora_A`` is the parts' A stacked, our ``lora_B`` their
B stacked, its rows in our order: a family that reorders a weight's rows (``arrange``: BLOOM's
q, k, v per head) reorders B's the same way. ``target_modules`` are the modules' last names
(``["q_proj", "k_proj", "v_proj", "o_proj"]``), as peft matches them.

Plain data in and out, as every format here (formats sit below training): :func:`to_peft` and
:func:`from_peft` rename an adapter state given the rows of each adapted linear's parts, :func:`write`
and :func:`read` move peft-named tensors to and from a folder. A model's own ``save_peft`` and
``load_peft`` are :mod:`selfattn.lora`'s. ``PeftModel.from_pretrained(base, folder)`` on the
family's ``transformers`` model of the same base weights computes what our model with LoRA computes.
"""
from __future__ import annotations

import json
import os
from collections.abc import Mapping, Sequence
from pathlib import Path

import torch
from torch import Tensor

from selfattn._util.files import atomic_path, writable_folder, write_text
from selfattn._util.jsonfile import json_object
from selfattn._util.validate import listed
from selfattn.config import GPTConfig
from selfattn.families import FAMILIES
from selfattn.formats.checkpoint import import_safetensors

CONFIG, WEIGHTS = "adapter_config.json", "adapter_model.safetensors"
PREFIX = "base_model.model."  # peft's name of the wrapped transformers model
# settings of a peft folder that change what its adapters compute, and the value each must have here
_PLAIN = dict(bias="none", fan_in_fan_out=False, use_rslora=False, use_dora=False, lora_bias=False, rank_pattern={},
              alpha_pattern={}, modules_to_save=None)


def write(folder: str | os.PathLike, tensors: Mapping[str, Tensor], *, rank: int, alpha: float, dropout: float,
          base_model: str) -> Path:
    """Write the adapter ``tensors`` (peft's names, from :func:`to_peft`) of ``rank``, ``alpha`` and
    ``dropout`` as a peft folder for the model ``base_model`` (its ``base_model_name_or_path``: a hub
    name or a path). The folder is created if missing; each file is replaced atomically, the weights
    first, so a folder whose config is new has its weights. Returns the folder."""
    targets = list(dict.fromkeys(name.removeprefix(PREFIX).split(".lora_")[0].rsplit(".", 1)[-1] for name in tensors))
    config = dict(peft_type="LORA", task_type="CAUSAL_LM", base_model_name_or_path=base_model, r=rank,
                  lora_alpha=alpha, lora_dropout=dropout, target_modules=targets, inference_mode=True,
                  init_lora_weights=True, **_PLAIN)
    folder = writable_folder(folder)
    folder.mkdir(parents=True, exist_ok=True)
    with atomic_path(folder / WEIGHTS) as tmp:
        import_safetensors().torch.save_file(dict(tensors), str(tmp), metadata={"format": "pt"})
    write_text(folder / CONFIG, json.dumps(config, indent=2) + "\n")
    return folder


def read(folder: str | os.PathLike) -> tuple[dict, dict[str, Tensor]]:
    """(``{"rank", "alpha", "dropout"}``, the adapter tensors under peft's names) of the peft folder
    ``folder``. A ValueError naming the file for a config that is not LoRA or has a setting that
    changes what the adapters compute beyond ``alpha / rank`` (rsLoRA, DoRA, biases, per-module ranks)."""
    path = Path(folder) / CONFIG
    config = json_object(path)
    wanted = dict(peft_type="LORA", **_PLAIN)
    wrong = {k: config.get(k, v) for k, v in wanted.items() if config.get(k, v) != v}
    if wrong:
        raise ValueError(f"{path}: {wrong}; only plain LoRA is read here, {({k: wanted[k] for k in wrong})}")
    settings = dict(rank=config.get("r"), alpha=config.get("lora_alpha"), dropout=config.get("lora_dropout", 0.0))
    return settings, import_safetensors().torch.load_file(str(Path(folder) / WEIGHTS))


def to_peft(state: Mapping[str, Tensor], parts: Mapping[str, Sequence[int]], config: GPTConfig,
            model_type: str) -> dict[str, Tensor]:
    """Our adapter ``state`` (``blocks.0.attn.qkv.lora_A`` ``(P·r, in)`` and ``lora_B`` ``(out, r)``,
    or their gradients) under peft's names for ``model_type``: each part its own A and B, copies.
    ``parts``: the rows of each part of every adapted linear, by module name (``blocks.0.attn.qkv``)."""
    out = {}
    for name, modules, rows, order in _plan(parts, config, model_type):
        A, B = state[f"{name}.lora_A"], state[f"{name}.lora_B"][order.argsort()]  # B's rows in the folder's order
        for theirs, a, b in zip(modules, A.split(A.shape[0] // len(rows)), B.split(rows)):
            out[f"{PREFIX}{theirs}.lora_A.weight"] = a.detach().clone()  # (r, in)
            out[f"{PREFIX}{theirs}.lora_B.weight"] = b.detach().clone()  # (rows, r)
    return out


def from_peft(tensors: Mapping[str, Tensor], parts: Mapping[str, Sequence[int]], config: GPTConfig,
              model_type: str) -> dict[str, Tensor]:
    """peft's adapter ``tensors`` for ``model_type`` (as its ``adapter_model.safetensors`` names
    them) under our adapter keys (the reverse of :func:`to_peft`). A ValueError naming the tensors
    missing or left over."""
    state, used = {}, set()
    for name, modules, _, order in _plan(parts, config, model_type):
        names = {ab: [f"{PREFIX}{theirs}.lora_{ab}.weight" for theirs in modules] for ab in "AB"}
        missing = [n for n in names["A"] + names["B"] if n not in tensors]
        if missing:
            raise ValueError(f"no adapter for {name}: missing {listed(missing)}")
        used.update(names["A"] + names["B"])
        state[f"{name}.lora_A"] = torch.cat([tensors[n] for n in names["A"]])  # (P·r, in)
        state[f"{name}.lora_B"] = torch.cat([tensors[n] for n in names["B"]])[order]  # (out, r) in our row order
    unexpected = tensors.keys() - used
    if unexpected:
        raise ValueError(f"adapters of modules this model has none on: {listed(unexpected)}")
    return state


def _plan(parts: Mapping[str, Sequence[int]], config: GPTConfig,
          model_type: str) -> list[tuple[str, list[str], list[int], Tensor]]:
    """(our module name, the family's module names of its parts, their rows, the row order: our B is
    the folder's B stacked, then indexed by it) for every adapted linear of ``parts``."""
    if model_type not in FAMILIES:
        raise ValueError(f"unknown model_type {model_type!r}; choose one of {', '.join(FAMILIES)}")
    family, plan = FAMILIES[model_type], []
    arrange = getattr(family, "arrange", lambda key, tensor, config: tensor)
    for name, rows in parts.items():
        modules = [source.removesuffix(".weight") for source in family.sources(f"{name}.weight", config)]
        if len(modules) != len(rows):
            raise ValueError(f"{model_type} names {name} as {len(modules)} modules but its adapters have "
                             f"{len(rows)} parts: add_lora(..., family={model_type!r})")
        order = arrange(f"{name}.weight", torch.arange(sum(rows)), config)  # (out,)
        plan.append((name, modules, list(rows), order))
    return plan
