"""Model families: a ``transformers`` folder's ``config.json`` and weight names mapped to a
:class:`~selfattn.model.GPTConfig` and the state dict of the one decoder, :class:`~selfattn.model.GPT`.

One small file per family. Each has
- ``MODEL_TYPES``: the ``model_type`` values of ``config.json`` it serves;
- ``config(hf, where, blocks=None) -> GPTConfig``: the decoder the ``config.json`` dict ``hf``
  describes; a ValueError naming ``where`` (the file) and the key for anything the decoder cannot
  compute, or for more layers than the ``blocks`` the weights hold (when known);
- ``LAYER``: the folder's prefix of the tensors of layer i (``"model.layers.{i}."``);
- ``sources(key, config) -> list[str]``: the names of the folder's tensors that make our tensor
  ``key``, concatenated along dim 0 when there are several (q, k, v into the fused ``qkv``);
- optionally ``IGNORED``: a pattern of tensor names that carry no weights (buffers older files kept);
- optionally ``arrange(key, tensor, config) -> Tensor``: our tensor ``key`` made of its concatenated
  sources, rearranged (rows the folder interleaves otherwise, say); without it, as it is.

:func:`empty` builds the decoder once its sizes are checked against the tensors, then :func:`load`
(or :func:`state_dict`) fills it, for every family. GPT-2 folders are still read through
``transformers`` by :mod:`selfattn.io.hf` (their ``Conv1D`` weights are stored transposed); the
``gpt2`` mapping serves GGUF files and LoRA adapters (:mod:`selfattn.families.gpt2`).
"""
from __future__ import annotations

from collections.abc import Mapping

import torch
from torch import Tensor

from selfattn._util import progress
from selfattn._util.validate import listed
from selfattn.families import _names, bloom, gemma, gpt2, gpt_oss, llama, olmo2, phi3
from selfattn.model import GPT

FAMILIES = {model_type: family for family in (llama, gemma, phi3, olmo2, bloom, gpt_oss, gpt2)
            for model_type in family.MODEL_TYPES}
# llama.cpp's general.architecture -> the model_type it is, as the families declare (their GGUF names)
GGUF_ARCHITECTURES = {arch: model_type for family in (llama, gemma, phi3, olmo2, bloom, gpt_oss, gpt2)
                      for arch, model_type in family.GGUF.architectures.items()}


def empty(family, hf: dict, tensors: Mapping[str, Tensor], where: str, config_where: str) -> GPT:
    """The decoder ``hf`` describes (a ``config.json`` dict, read from ``config_where``), its weights
    allocated and left for :func:`load` to fill with ``tensors`` (those of ``where``).

    The file's sizes are checked against the tensors before anything is allocated, so a
    ``config.json`` that claims more than its weights hold is one ValueError naming it, never an
    allocation the machine cannot make: more layers than the tensors' names show (before anything
    is built per layer), an embedding of another shape than ``vocab_size`` x ``hidden_size``, then
    every tensor missing, left over or of another shape (:func:`state_dict`'s refusals), checked on
    the model built without storage (on the meta device).
    """
    config = family.config(hf, config_where, _names.layers(tensors, family.LAYER))
    embedding = family.sources("wte.weight", config)[0]
    if embedding in tensors and _shape(tensors, embedding) != (config.vocab_size, config.n_embd):
        raise ValueError(f"{config_where}: vocab_size {config.vocab_size} and hidden_size {config.n_embd} make "
                         f"{embedding} ({config.vocab_size}, {config.n_embd}), but {where} holds it as "
                         f"{_shape(tensors, embedding)}")
    try:
        with torch.device("meta"):
            sizes_only = GPT(config)
    except (TypeError, ValueError) as e:  # sizes the attention refuses (a window, rope_dims)
        raise type(e)(f"{config_where}: {e}") from None
    _plan(family, tensors, sizes_only, where)
    return GPT.empty(config)


def load(family, tensors: Mapping[str, Tensor], model: GPT, where: str) -> None:
    """Copy a folder's ``tensors``, as ``family`` names them, into ``model``'s parameters, in place.

    ``tensors`` may be lazy: a mapping that reads (or dequantises) a tensor when it is looked up,
    and says its shape without reading it through a ``shape(name)`` method when it has one. Every
    name and shape is checked before anything is read (see :func:`state_dict` for the refusals),
    then the tensors are read one at a time, each copied into its place and dropped, so loading
    holds at most one of them beside the model (two for a key the family's ``arrange`` rearranges). A
    parameter under several names (a tied head) is filled once.
    """
    done = set()
    plan = _plan(family, tensors, model, where)
    with torch.no_grad():
        for key, names, target in progress.track(plan, "loading the weights", unit="tensor"):
            if target.data_ptr() in done:
                continue
            done.add(target.data_ptr())
            row = 0
            for name in names:  # q, k, v into the rows of the fused qkv, one at a time
                part = tensors[name]
                target[row:row + part.shape[0]].copy_(part)
                row += part.shape[0]
                del part
            _arrange(family, key, target, model.config, where)


def state_dict(family, tensors: Mapping[str, Tensor], model: GPT, where: str) -> dict[str, Tensor]:
    """The state dict of ``model`` made of a folder's ``tensors`` as ``family`` names them
    (a copy of every tensor at once: :func:`load` fills the model with one at a time).

    The model loads whole or not at all: a tensor missing, one left over (unless ``IGNORED``) or
    one of another shape than the config makes it is one ValueError naming them and ``where``.
    """
    state = {}
    for key, names, target in _plan(family, tensors, model, where):
        parts = [tensors[name] for name in names]
        state[key] = torch.cat(parts) if len(parts) > 1 else parts[0]  # q, k, v: (H·D + 2·Hkv·D, C)
        if getattr(family, "arrange", None) is not None:
            state[key] = state[key].clone()
            _arrange(family, key, state[key], model.config, where)
    return state


def _plan(family, tensors: Mapping[str, Tensor], model: GPT, where: str) -> list[tuple[str, list[str], Tensor]]:
    """(our key, the folder's names that make it, the model's tensor) for every key of ``model``,
    once every name and shape is checked (shapes without reading, where ``tensors`` can say them)."""
    plan, used, missing, reshaped = [], set(), set(), []
    for key, like in model.state_dict(keep_vars=True).items():
        names = family.sources(key, model.config)
        used.update(names)  # accounted for, present or not
        missing.update(name for name in names if name not in tensors)
        if any(name not in tensors for name in names):
            continue
        shapes = [_shape(tensors, name) for name in names]
        if all(len(s) == like.dim() and s[1:] == like.shape[1:] for s in shapes) and \
                sum(s[0] for s in shapes) == like.shape[0]:
            plan.append((key, names, like.data))
        else:
            reshaped.append(f"{' + '.join(names)} {' + '.join(str(s) for s in shapes)} instead of {tuple(like.shape)}")
    ignored = getattr(family, "IGNORED", None)
    unexpected = [name for name in tensors if name not in used and not (ignored and ignored.fullmatch(name))]
    reshaped = list(dict.fromkeys(reshaped))  # a tied head is the embedding: said once
    wrong = [f"{kind} {listed(names)}" for kind, names in (("missing", missing), ("unexpected", unexpected),
                                                           ("of another shape", reshaped)) if names]
    if wrong:
        raise ValueError(f"the weights in {where} are not those its config.json describes: {'; '.join(wrong)}")
    return plan


def _shape(tensors: Mapping[str, Tensor], name: str) -> tuple[int, ...]:
    """The shape of ``tensors[name]``, without reading it when the mapping can say it."""
    return tuple(tensors.shape(name)) if hasattr(tensors, "shape") else tuple(tensors[name].shape)


def _arrange(family, key: str, target: Tensor, config, where: str) -> None:
    """Apply the family's optional hook ``arrange(key, tensor, config) -> Tensor`` (rows of a fused
    tensor in another order, say) to ``target``, in place; without the hook, nothing."""
    arrange = getattr(family, "arrange", None)
    if arrange is None:
        return
    arranged = arrange(key, target.clone(), config)  # a clone: the hook may return a view of its input
    if tuple(arranged.shape) != tuple(target.shape):
        raise ValueError(f"{where}: {family.__name__}.arrange made {key} of shape {tuple(arranged.shape)}, "
                         f"not {tuple(target.shape)}")
    target.copy_(arranged)
