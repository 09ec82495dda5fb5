"""LoRA: low-rank adapters on a frozen :class:`~selfattn.model.GPT`, equal to ``peft``'s.

:func:`add_lora` replaces the model's attention projections (``attn.qkv``, ``attn.proj``) and,
with ``mlp=True``, its MLP's (``gate_up_proj`` and ``down_proj``, or ``c_fc`` and ``c_proj``) by
:class:`LoRALinear`, in place. Each keeps the base ``weight`` and ``bias`` it replaced (the same
tensors, frozen), so the state-dict keys of the base do not change (``blocks.0.attn.qkv.weight``),
and adds ``lora_A`` and ``lora_B`` beside them (``blocks.0.attn.qkv.lora_A``). It computes

    y = x W^T + b + (dropout(x) A_i^T) B_i^T · alpha / rank     for the rows of each part i,

through the rank-r path: the full ``B A`` is never formed while training (:func:`merge` forms it).

Parts. Our fused linears stand for several of ``transformers``' modules, and ``peft`` gives each
of those an adapter of its own. A linear's output rows are cut into *parts*, one per tensor the
model's family names for it (``family.sources``), each with its own ``A_i`` (r x in) and ``B_i``
(rows_i x r):

- Llama, Mistral, Qwen, Gemma, OLMo 2, gpt-oss: ``attn.qkv`` is q_proj, k_proj, v_proj, three
  parts of H·D, Hkv·D, Hkv·D rows, so one fused qkv adapter *is* peft's three adapters, each with
  its own A; ``mlp.gate_up_proj`` is gate_proj and up_proj, two parts of I rows;
- Phi-3 keeps ``qkv_proj`` and ``gate_up_proj`` fused, and BLOOM ``query_key_value``: one part;
- every other linear (``attn.proj``, ``down_proj``, ``c_fc``, ``c_proj``): one part.

``family=None`` (a model no family names, trained from scratch) splits q/k/v and gate/up, as all
but Phi-3 and BLOOM do. ``lora_A`` stacks the parts' A along dim 0, ``(P·r, in)``, so ``x @ A^T``
is one product for all of them; ``lora_B`` stacks their B, ``(out, r)``, the rows of part i
being those of the part's output. Initialised as peft does, from the torch RNG: A kaiming-uniform
(``a = sqrt(5)``), B zeros, so a new adapter changes nothing.

Dropout on the adapters' input draws one mask per part, as peft's separate modules do (and so
one product per part while it is on); the adapters train and evaluate with the model they are on.

Beside them: :func:`merge` folds the adapters into plain linears; :func:`adapter_state`,
:func:`load_adapter_state`, :func:`lora_settings` and :func:`base_digest` are what a checkpoint
needs to rebuild a model with LoRA and check it sits on the same base; :func:`save_peft` and
:func:`load_peft` write and read ``peft``'s adapter folders (:mod:`selfattn.formats.peft`).
"""
from __future__ import annotations

import math
import os
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from selfattn._util import validate as _validate
from selfattn.families import FAMILIES
from selfattn.formats import peft
from selfattn.formats.checkpoint import digest
from selfattn.model import GPT, MLP, GatedMLP

_SPLIT = {"attn.qkv": 3, "mlp.gate_up_proj": 2}  # our fused linears: how many tensors q/k/v, gate/up are


class LoRALinear(nn.Linear):
    """The ``nn.Linear`` ``base`` (its weight and bias, the same tensors, frozen) plus one low-rank
    adapter per part of its output rows (``parts``: the rows of each, summing to ``out_features``).

    ``lora_A`` ``(P·r, in)`` and ``lora_B`` ``(out, r)`` are in the base's dtype and device;
    ``family`` is the ``model_type`` whose naming set the parts (None: q/k/v and gate/up split).
    """

    def __init__(self, base: nn.Linear, parts: list[int], rank: int, alpha: float, dropout: float,
                 family: str | None):
        super().__init__(base.in_features, base.out_features, bias=base.bias is not None, device="meta")
        assert sum(parts) == base.out_features, (parts, base.out_features)
        self.weight, self.bias = base.weight, base.bias  # shared, not copied: the base's keys stay
        self.parts, self.rank, self.alpha, self.dropout, self.family = tuple(parts), rank, alpha, dropout, family
        self.scale = alpha / rank
        w = base.weight
        self.lora_A = nn.Parameter(torch.empty(len(parts) * rank, base.in_features, dtype=w.dtype, device=w.device))
        self.lora_B = nn.Parameter(torch.zeros(base.out_features, rank, dtype=w.dtype, device=w.device))
        for a in self.lora_A.data.split(rank):  # each part's A as peft draws it: fan_in = in_features
            nn.init.kaiming_uniform_(a, a=math.sqrt(5))
        self.train(base.training)  # the adapters' dropout is on only where the model trains

    def forward(self, x: Tensor) -> Tensor:
        y = F.linear(x, self.weight, self.bias)  # (..., out)
        if self.training and self.dropout:  # a mask per part, as peft's q, k, v each draw their own
            h = torch.cat([F.linear(F.dropout(x, self.dropout), a) for a in self.lora_A.split(self.rank)], -1)
        else:
            h = F.linear(x, self.lora_A)  # (..., P·r): every part's x A_i^T in one product
        pieces = [F.linear(h_i, b_i) for h_i, b_i in zip(h.split(self.rank, -1), self.lora_B.split(self.parts))]
        delta = pieces[0] if len(pieces) == 1 else torch.cat(pieces, -1)  # (..., out), part i's rows from B_i
        return y + delta * self.scale

    def delta_weight(self) -> Tensor:
        """``scale · B_i A_i`` for every part, stacked: ``(out, in)`` in float64."""
        A, B = self.lora_A.detach().double(), self.lora_B.detach().double()
        return torch.cat([b @ a for a, b in zip(A.split(self.rank), B.split(self.parts))]) * self.scale

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, parts={self.parts}, rank={self.rank}, alpha={self.alpha:g}"


def add_lora(model: GPT, rank: int, *, alpha: float | None = None, dropout: float = 0.0, mlp: bool = False,
             family: str | None = None) -> GPT:
    """Put LoRA adapters of ``rank`` on ``model``'s attention projections (and MLP's, with ``mlp``),
    in place, and freeze every other parameter: only the adapters require grad. Returns ``model``.

    alpha: the adapters' output is scaled by ``alpha / rank`` (default ``alpha = 2 · rank``).
    dropout: on the adapters' input, in [0, 1).
    family: the ``model_type`` (a key of :data:`selfattn.families.FAMILIES`) whose tensor names cut
        the fused linears into parts (see the module docstring); None splits q/k/v and gate/up.

    ValueError (TypeError for a wrong type) naming the value: a rank not a positive int or larger
    than a linear's input or its smallest part, alpha not > 0, dropout outside [0, 1), an unknown
    family, ``mlp`` on a model whose MLP is a mixture of experts (its experts are not linears) or
    that has none, a model that already has adapters. Nothing is changed when it raises.
    """
    if not isinstance(model, GPT):
        raise TypeError(f"add_lora expects a selfattn GPT, got {type(model).__name__}")
    _validate.positive_int("rank", rank)
    alpha = _validate.positive_number("alpha", 2 * rank if alpha is None else alpha)
    dropout = _validate.probability("dropout", dropout)
    _validate.flag("mlp", mlp)
    if family is not None and family not in FAMILIES:
        raise ValueError(f"unknown family {family!r}; choose one of {', '.join(FAMILIES)} or None")
    if lora_modules(model):
        raise ValueError("the model already has LoRA adapters: merge(model) first, or add them to a fresh model")
    if mlp and not all(isinstance(block.mlp, (MLP, GatedMLP)) for block in model.blocks):
        raise ValueError(f"mlp=True needs linear MLPs, but this model's MLP is "
                         f"{model.config.mlp_kind if model.config.mlp else 'absent (mlp=False)'}: its attention "
                         f"alone can take adapters")
    targets = []  # (parent module, attribute, parts), every one checked before any is replaced
    for i, block in enumerate(model.blocks):
        for owner, parent in [("attn", block.attn)] + ([("mlp", block.mlp)] if mlp else []):
            for attr, linear in parent.named_children():
                if isinstance(linear, nn.Linear):
                    name = f"blocks.{i}.{owner}.{attr}"
                    parts = _parts(model, block, name, linear, family)
                    if rank > min(linear.in_features, *parts):
                        raise ValueError(f"rank={rank} is larger than {name} allows: min(in_features="
                                         f"{linear.in_features}, smallest part={min(parts)} rows) = "
                                         f"{min(linear.in_features, *parts)}")
                    targets.append((parent, attr, parts))
    model.requires_grad_(False)
    for parent, attr, parts in targets:
        setattr(parent, attr, LoRALinear(getattr(parent, attr), parts, rank, alpha, dropout, family))
    return model


def _parts(model: GPT, block: nn.Module, name: str, linear: nn.Linear, family: str | None) -> list[int]:
    """The rows of each part of ``block``'s linear ``name`` (``blocks.0.attn.qkv``): one part per
    tensor ``family`` names it as, or for no family, q/k/v and gate/up apart."""
    kind = name.split(".", 2)[2]  # attn.qkv
    count = len(FAMILIES[family].sources(f"{name}.weight", model.config)) if family is not None else \
        _SPLIT.get(kind, 1)
    if count == 1:
        return [linear.out_features]
    assert count == _SPLIT.get(kind), (family, name, count)  # the families split these two only, this way
    if kind == "attn.qkv":
        return [block.attn.n_head * block.attn.head_dim] + [block.attn.n_kv_head * block.attn.head_dim] * 2  # q, k, v
    return [linear.out_features // 2] * 2  # gate rows, then up rows


def lora_modules(model: nn.Module) -> dict[str, LoRALinear]:
    """The :class:`LoRALinear` modules of ``model`` by name (``blocks.0.attn.qkv``), in model order."""
    return {name: m for name, m in model.named_modules() if isinstance(m, LoRALinear)}


def merge(model: GPT) -> GPT:
    """``model`` as a plain GPT, in place: each :class:`LoRALinear` becomes an ``nn.Linear`` of
    weight ``W + alpha / rank · B_i A_i`` (computed in float64, cast to W's dtype; W itself is not
    written, the new weight is a new tensor) and the same bias. Every parameter requires grad
    again, as in a GPT built fresh. Returns ``model``, computing what it computed (to rounding)."""
    modules = _require_lora(model)
    for name, m in modules.items():
        parent, attr = model.get_submodule(name.rsplit(".", 1)[0]), name.rsplit(".", 1)[1]
        linear = nn.Linear(m.in_features, m.out_features, bias=m.bias is not None, device="meta")
        linear.weight = nn.Parameter((m.weight.detach().double() + m.delta_weight()).to(m.weight.dtype))
        linear.bias = m.bias
        setattr(parent, attr, linear)
    return model.requires_grad_(True)


def adapter_state(model: GPT) -> dict[str, Tensor]:
    """The adapters' tensors by state-dict key (``blocks.0.attn.qkv.lora_A``), detached, not copied."""
    return {f"{name}.lora_{ab}": getattr(m, f"lora_{ab}").detach()
            for name, m in _require_lora(model).items() for ab in "AB"}


def load_adapter_state(model: GPT, state: dict[str, Tensor]) -> None:
    """Copy ``state`` (as :func:`adapter_state` gives it) into ``model``'s adapters, in place. The
    keys must be exactly the model's adapters and every shape theirs: a ValueError naming them."""
    own = adapter_state(model)
    missing, unexpected = own.keys() - state.keys(), state.keys() - own.keys()
    reshaped = [f"{k} {tuple(state[k].shape)} instead of {tuple(own[k].shape)}"
                for k in own.keys() & state.keys() if state[k].shape != own[k].shape]
    wrong = [f"{kind} {_validate.listed(keys)}" for kind, keys in (("missing", missing), ("unexpected", unexpected),
                                                                  ("of another shape", reshaped)) if keys]
    if wrong:
        raise ValueError(f"adapter state does not fit the model's adapters: {'; '.join(wrong)}")
    with torch.no_grad():
        for key, tensor in own.items():
            tensor.copy_(state[key])


def lora_settings(model: GPT) -> dict:
    """What :func:`add_lora` was given, JSON-ready: ``add_lora(GPT(config), **lora_settings(model))``
    rebuilds the same adapters (rank, alpha, dropout, mlp, family; the family sets the parts)."""
    m = next(iter(_require_lora(model).values()))
    return dict(rank=m.rank, alpha=m.alpha, dropout=m.dropout, family=m.family,
                mlp=any(".mlp." in name for name in lora_modules(model)))


def base_digest(model: GPT) -> str:
    """SHA-256 of the base model under the adapters: the name, dtype, shape and bytes of every tensor
    of its state dict (parameters and persistent buffers, a tied weight under each of its names), the
    adapters left out; the same before :func:`add_lora` and after, whatever the adapters hold. It
    tells whether saved adapters are being put back on the base they were trained on."""
    return digest({k: v for k, v in model.state_dict().items() if not k.endswith((".lora_A", ".lora_B"))}, {})


def check_base(base: dict, digest: str, what: str, *, at: str | None = None) -> None:
    """Refuse adapters trained on the base ``base`` (``{"path", "digest"}``) when the model loaded from
    its path (or from ``at``, its new place) has the digest ``digest`` (another model, or the file
    changed), naming both."""
    if base["digest"] != digest:
        where = base["path"] if at is None or at == base["path"] else at
        now = "now holds" if where == base["path"] else "holds"
        raise ValueError(f"{what} holds LoRA adapters trained on the base model {base['path']} of SHA-256 "
                         f"{base['digest'][:12]}..., but {where} {now} a model of SHA-256 {digest[:12]}...; "
                         f"put the base back, or fine-tune again")


def save_peft(model: GPT, folder: str | os.PathLike, model_type: str, *, base_model: str) -> Path:
    """Write ``model``'s adapters as a ``peft`` adapter folder for ``model_type``'s ``transformers``
    model (``base_model``: its ``base_model_name_or_path``), which ``PeftModel.from_pretrained`` loads;
    see :mod:`selfattn.formats.peft`. ValueError when ``model_type`` names the fused linears
    otherwise than the parts were cut (``add_lora(..., family=model_type)``). Returns the folder."""
    tensors = peft.to_peft(adapter_state(model), _parts_of(model), model.config, model_type)
    s = lora_settings(model)
    return peft.write(folder, tensors, rank=s["rank"], alpha=s["alpha"], dropout=s["dropout"], base_model=base_model)


def load_peft(model: GPT, folder: str | os.PathLike, model_type: str) -> None:
    """Load a ``peft`` adapter folder of ``model_type``'s ``transformers`` model into ``model``, whose
    LoRA has the folder's rank and alpha on the same modules; a ValueError naming the folder otherwise."""
    theirs, tensors = peft.read(folder)
    mine = lora_settings(model)
    if (theirs["rank"], theirs["alpha"]) != (mine["rank"], mine["alpha"]):
        raise ValueError(f"{folder}: adapters of rank {theirs['rank']} and alpha {theirs['alpha']}, but this model's "
                         f"have rank {mine['rank']} and alpha {mine['alpha']:g}")
    try:
        load_adapter_state(model, peft.from_peft(tensors, _parts_of(model), model.config, model_type))
    except ValueError as e:
        raise ValueError(f"{folder}: {e}") from None


def _parts_of(model: GPT) -> dict[str, tuple[int, ...]]:
    return {name: m.parts for name, m in _require_lora(model).items()}


def _require_lora(model: GPT) -> dict[str, LoRALinear]:
    modules = lora_modules(model)
    if not modules:
        raise ValueError("the model has no LoRA adapters: add_lora(model, rank) first")
    return modules
