"""Our decoder as a family's ``transformers`` folder: the reverse of the family mappings.

:data:`ARCHS` are the families a model can be written as, and a training run can choose the
block of (``selfattn train --arch``: :func:`block`); :data:`WRITTEN` adds those whose ``config.json``
is written for a GGUF file only (Phi-3, BLOOM, GPT-2's generic one, gpt-oss). :func:`folder_config` finds the
family whose ``config.json`` says everything a :class:`~selfattn.model.GPTConfig` computes (:func:`says`:
it writes one with the family's ``hf_config`` and reads it back with the family's ``config``; a family
that cannot say some field reads back another decoder and is passed over). :func:`folder_tensors` names
our tensors as that family does, splitting the fused ones (q, k, v; gate and up) where it keeps them
apart and putting back in the folder's order the rows the family's ``arrange`` reorders (BLOOM's q, k, v
per head). A model without biases is the same function as one whose biases are all zero
(:func:`with_biases`, :func:`with_zero_biases`), for a family that has them.
"""
from __future__ import annotations

import dataclasses

import torch
from torch import Tensor

from selfattn.config import GPTConfig
from selfattn.families import FAMILIES
from selfattn.model import GPT

ARCHS = ("llama", "mistral", "qwen2", "qwen3", "gemma2", "gemma3_text", "olmo2")  # in the order tried
WRITTEN = (*ARCHS, "phi3", "bloom", "gpt2", "gpt_oss")  # the families whose config.json is written, in order


def block(arch: str, sizes: dict) -> dict:
    """The GPTConfig fields of ``arch``'s block over ``sizes`` (the preset's and flags' values)."""
    if arch not in ARCHS:
        raise ValueError(f"unknown arch {arch!r}; choose one of {', '.join(ARCHS)}")
    return FAMILIES[arch].arch(arch, sizes)


def folder_config(config: GPTConfig, archs: tuple[str, ...] = ARCHS) -> tuple[str, dict] | None:
    """(model_type, config.json dict) of the first of ``archs`` (of :data:`ARCHS`) that says all of
    ``config``; None when none does."""
    for model_type in archs:
        hf = says(config, model_type)
        if hf is not None:
            return model_type, hf
    return None


def says(config: GPTConfig, model_type: str) -> dict | None:
    """The ``config.json`` dict of ``model_type`` (a family with an ``hf_config``) that says all of ``config``;
    None when the family reads it back as another decoder, or refuses it."""
    family = FAMILIES[model_type]
    hf = family.hf_config(config, model_type)
    try:
        back = family.config(hf, model_type)
    except (TypeError, ValueError):
        return None
    return hf if computes(back) == computes(config) else None


def with_biases(config: GPTConfig) -> GPTConfig:
    """``config`` with a bias on every Linear and LayerNorm (where it had none, they will be zeros)."""
    return dataclasses.replace(config, bias=True, qkv_bias=None, proj_bias=None)


def with_zero_biases(gpt: GPT) -> GPT:
    """``gpt`` itself when it has every bias, else the same function with every bias present and zero (a new
    model on ``gpt``'s device, of its dtype and mode; the caller's random numbers left as they were)."""
    config = with_biases(gpt.config)
    if config == gpt.config:
        return gpt
    w = gpt.wte.weight
    with torch.random.fork_rng(devices=[]):  # building the model draws initial weights
        twin = GPT(config).to(device=w.device, dtype=w.dtype)
    missing = twin.load_state_dict(gpt.state_dict(), strict=False).missing_keys
    with torch.no_grad():
        for name in missing:  # exactly the biases: every other tensor was loaded
            twin.get_parameter(name).zero_()
    return twin.train(gpt.training)


def folder_tensors(model_type: str, model: GPT) -> dict[str, Tensor]:
    """``model``'s tensors under the folder names of ``model_type`` (a tied head stored once)."""
    family, config, out = FAMILIES[model_type], model.config, {}
    for key, tensor in model.state_dict().items():
        names = family.sources(key, config)
        tensor = _folder_order(family, key, tensor, config)
        if len(names) == 1:
            out.setdefault(names[0], tensor)
            continue
        attn = model.blocks[0].attn
        sizes = [attn.n_head * attn.head_dim] + [attn.n_kv_head * attn.head_dim] * 2 if len(names) == 3 else \
            [tensor.shape[0] // 2] * 2  # q, k, v rows; gate and up rows
        out |= dict(zip(names, tensor.split(sizes)))
    return {name: t.contiguous() for name, t in out.items()}


def _folder_order(family, key: str, tensor: Tensor, config: GPTConfig) -> Tensor:
    """``tensor`` (our ``key``) with its rows in the folder's order: the inverse of the family's ``arrange``
    (a permutation of rows, found by arranging their indices), or ``tensor`` itself without one."""
    arrange = getattr(family, "arrange", None)
    if arrange is None:
        return tensor
    order = arrange(key, torch.arange(tensor.shape[0]), config)  # (rows,): the folder's row of each of ours
    return tensor[order.argsort()]


def computes(config: GPTConfig) -> dict:
    """What ``config`` computes, each layer's window and RoPE spelled out, defaults filled in, the
    fields that change no result (backend, dropout) left out."""
    c = config
    head_dim = c.head_dim or c.n_embd // c.n_head
    fields = dataclasses.asdict(c) | dict(
        head_dim=head_dim, n_kv_head=c.n_kv_head or c.n_head, intermediate_size=c.intermediate_size or 4 * c.n_embd,
        attn_scale=c.attn_scale or head_dim ** -0.5, window=[c.layer_window(i) for i in range(c.n_layer)],
        rope_base=[c.layer_rope(i) for i in range(c.n_layer)], qkv_bias=c.bias if c.qkv_bias is None else c.qkv_bias,
        proj_bias=c.bias if c.proj_bias is None else c.proj_bias)
    for name in ("backend", "dropout", "window_layers", "window_rope_base", "rope_scaling"):
        fields.pop(name)
    return fields
