"""What each part of the residual stream says about the logits: the logit lens and direct logit attribution.

The residual stream is a sum. Entering the final norm it is ``blocks.0.hook_resid_pre`` (the
embeddings: ``hook_embed + hook_pos_embed``, or their norm's output where the model has one) plus every
layer's ``hook_attn_out`` and ``hook_mlp_out``; without a norm after the attention, ``hook_attn_out``
is the heads' writes (``hook_result``, ``z_h @ W_O[h]``) plus the projection's bias. A norm after a
sublayer (sandwich and post-norm models: ``ln1_post``, ``ln2_post``) is an affine map once its scale
is frozen at the value of the run (``hook_scale``): ``hook_attn_out`` is then the heads' writes
through it plus the bias's, each divided by the same scale. The final norm, frozen the same way,
maps the sum onto the head's input term by term; so each part's logit, dotted with the un-embedding,
adds up to the logit (before a final soft-cap) up to rounding.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor, nn

from selfattn.interp.sites import _gpt
from selfattn.taps import affine


def _cached(cache: dict, name: str) -> Tensor:
    if not isinstance(cache, dict):
        raise TypeError(f"cache must be the dict of run_with_cache, got {type(cache).__name__}")
    if name not in cache:
        raise ValueError(f"the cache holds no {name!r}: run run_with_cache(model, idx) with the default names=None, "
                         f"or names that include it")
    return cache[name]


@torch.no_grad()
def logit_lens(model, cache: dict) -> Tensor:
    """The logits each layer's residual stream would give: ``(L, B, T, V)``.

    Layer l's ``hook_resid_post`` goes through the final norm with its own statistics (never the
    last layer's scale, TransformerLens's #1076) and the head, soft-cap included; so the last
    layer's lens is the model's logits, bitwise for a cache kept in the model's dtype and device.
    """
    model = _gpt(model)
    return torch.stack([model.logits(model.ln_f(_cached(cache, f"blocks.{i}.hook_resid_post")))
                        for i in range(len(model.blocks))])


@dataclass(frozen=True)
class Attribution:
    """Direct logit attribution: ``values`` ``(N, B, T)``, one row per part of the residual stream,
    named by ``labels`` (``embed``, ``pos_embed``, ``L3H1`` a head, ``L3 attn bias``, ``L3 mlp``,
    ``final norm bias``); ``values.sum(0)`` is the logit (difference) before a final soft-cap."""
    values: Tensor
    labels: list[str]


class _Frozen:
    """A norm with its scale frozen at ``scale`` ``(B, T, 1)``: ``linear(part)`` and the constant
    ``bias``, whose sum over the parts of an input is the norm's output."""

    def __init__(self, norm: nn.Module, scale: Tensor | None):
        self.identity = isinstance(norm, nn.Identity)
        if not self.identity:
            self.centres, self.weight, self.bias = affine(norm)
            self.scale = scale

    def linear(self, part: Tensor) -> Tensor:  # (..., B, T, C)
        if self.identity:
            return part
        if self.centres:
            part = part - part.mean(dim=-1, keepdim=True)
        part = part / self.scale.to(part.dtype)
        return part if self.weight is None else part * self.weight.to(part.dtype)


def _answer(model, answer, B: int, T: int, device) -> Tensor:
    """Token ids ``(B, T)`` from an int or a tensor broadcasting to it."""
    ids = torch.as_tensor(answer, device=device)
    if ids.is_floating_point() or ids.is_complex() or ids.dtype == torch.bool:
        raise TypeError(f"answer and wrong must be token ids (ints), got dtype {ids.dtype}")
    try:
        ids = ids.expand(B, T)
    except RuntimeError:
        raise ValueError(f"answer and wrong must broadcast to the cache's (B={B}, T={T}), got {tuple(ids.shape)}")
    if ids.shape != (B, T) or bool(((ids < 0) | (ids >= model.config.vocab_size)).any()):
        raise ValueError(f"answer and wrong must be ids in [0, {model.config.vocab_size}) broadcasting to "
                         f"(B={B}, T={T}), got {answer!r}")
    return ids


@torch.no_grad()
def direct_logit_attribution(model, cache: dict, answer, wrong=None) -> Attribution:
    """Each part's direct effect on the logit of ``answer`` (minus that of ``wrong``), at every position.

    cache: from :func:`~selfattn.interp.run_with_cache` on ``model`` with every site (or at least
        the embeddings, ``hook_z``, ``hook_mlp_out`` and the norms' ``hook_scale``).
    answer, wrong: token ids, an int or a tensor broadcasting to ``(B, T)``.
    Returns an :class:`Attribution` whose parts sum to the logit (difference): the final norm's
    scale, and any norm's after a sublayer, frozen at the run's values (see the module docstring).
    """
    model = _gpt(model)
    resid = _cached(cache, f"blocks.{len(model.blocks) - 1}.hook_resid_post")
    B, T, _ = resid.shape
    unembed = model.lm_head.weight  # (V, C)
    direction = unembed[_answer(model, answer, B, T, unembed.device)]  # (B, T, C)
    if wrong is not None:
        direction = direction - unembed[_answer(model, wrong, B, T, unembed.device)]
    final = _Frozen(model.ln_f, _cached(cache, "ln_final.hook_scale"))
    labels, parts = [], []

    def add(label: str, part: Tensor, *norms: _Frozen) -> None:  # part (B, T, C) or (N, B, T, C)
        for norm in (*norms, final):
            part = norm.linear(part)
        parts.append((part * direction.to(part.dtype)).sum(-1).reshape(-1, B, T))
        labels.extend([label] if part.dim() == 3 else [label.format(h) for h in range(part.shape[0])])

    if model.ln_emb is None:
        add("embed", _cached(cache, "hook_embed"))
        if model.wpe is not None:
            add("pos_embed", _cached(cache, "hook_pos_embed"))
    else:
        add("embed", _cached(cache, "blocks.0.hook_resid_pre"))
    for i, block in enumerate(model.blocks):
        attn = block.attn
        post = _Frozen(block.post_ln_1, None if isinstance(block.post_ln_1, nn.Identity) else
                       _cached(cache, f"blocks.{i}.ln1_post.hook_scale"))
        writes = attn.head_writes(_cached(cache, f"blocks.{i}.attn.hook_z"))  # (B, T, H, C)
        add(f"L{i}H{{}}", writes.permute(2, 0, 1, 3), post)  # each head's write, (H, B, T, C)
        post_bias = None if post.identity else post.bias
        if attn.proj.bias is not None or post_bias is not None:
            bias = torch.zeros_like(resid) if attn.proj.bias is None else \
                attn.proj.bias.to(resid.dtype).expand_as(resid)
            add(f"L{i} attn bias", post.linear(bias) + (0 if post_bias is None else post_bias.to(resid.dtype)))
        if block.mlp is not None:
            add(f"L{i} mlp", _cached(cache, f"blocks.{i}.hook_mlp_out"))
    if final.bias is not None:
        labels.append("final norm bias")
        parts.append((final.bias.to(resid.dtype) * direction.to(resid.dtype)).sum(-1).reshape(1, B, T))
    return Attribution(torch.cat(parts), labels)
