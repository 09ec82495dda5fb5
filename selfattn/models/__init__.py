"""Model families: a ``transformers`` folder's ``config.json`` and weight names mapped to a
:class:`~selfattn.model.GPTConfig` and the state dict of the one decoder, :class:`~selfattn.model.GPT`.

One small file per family. Each has
- ``MODEL_TYPES``: the ``model_type`` values of ``config.json`` it serves;
- ``config(hf, where) -> GPTConfig``: the decoder the ``config.json`` dict ``hf`` describes; a
  ValueError naming ``where`` (the file) and the key for anything the decoder cannot compute;
- ``sources(key, config) -> list[str]``: the names of the folder's tensors that make our tensor
  ``key``, concatenated along dim 0 when there are several (q, k, v into the fused ``qkv``);
- ``IGNORED``: a pattern of tensor names that carry no weights (buffers older files kept).

:func:`state_dict` does the rest for every family. GPT-2 folders are still read through
``transformers`` by :mod:`selfattn.hf`.
"""
from __future__ import annotations

import torch
from torch import Tensor

from selfattn._validate import listed
from selfattn.model import GPT
from selfattn.models import llama

FAMILIES = {model_type: family for family in (llama,) for model_type in family.MODEL_TYPES}


def state_dict(family, tensors: dict[str, Tensor], model: GPT, where: str) -> dict[str, Tensor]:
    """The state dict of ``model`` made of a folder's ``tensors`` as ``family`` names them.

    The model loads whole or not at all: a tensor missing, one left over (unless ``IGNORED``) or
    one of another shape than the config makes it is one ValueError naming them and ``where``.
    """
    state, used, missing, reshaped = {}, set(), set(), []
    for key, like in model.state_dict().items():
        names = family.sources(key, model.config)
        used.update(names)  # accounted for, present or not
        missing.update(name for name in names if name not in tensors)
        if any(name not in tensors for name in names):
            continue
        parts = [tensors[name] for name in names]
        if all(p.dim() == like.dim() and p.shape[1:] == like.shape[1:] for p in parts) and \
                sum(p.shape[0] for p in parts) == like.shape[0]:
            state[key] = torch.cat(parts) if len(parts) > 1 else parts[0]  # q, k, v: (H·D + 2·Hkv·D, C)
        else:
            shapes = " + ".join(str(tuple(p.shape)) for p in parts)
            reshaped.append(f"{' + '.join(names)} {shapes} instead of {tuple(like.shape)}")
    unexpected = [name for name in tensors if name not in used and not family.IGNORED.fullmatch(name)]
    wrong = [f"{kind} {listed(names)}" for kind, names in (("missing", missing), ("unexpected", unexpected),
                                                           ("of another shape", reshaped)) if names]
    if wrong:
        raise ValueError(f"the weights in {where} are not those its config.json describes: {'; '.join(wrong)}")
    return state
