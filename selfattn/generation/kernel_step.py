"""A decode step of a pre-norm decoder (Llama's, GPT-2's and the families between) as one C++
call (``kernels/decode.cpp``, built with :mod:`selfattn.kernels.stream`), for
:func:`~selfattn.generation.compile_decode` on the CPU.

A compiled graph (:mod:`selfattn.generation.compiled`) still pays per step for what surrounds its
kernels: torch.compile's guards on every weight and cache, the Python wrapper that calls each
product and attention, a start and an end of the threads' work at each of them, and the fused
elementwise kernels between. Here the whole step is one call: the threads start once, every product
and attention is split among them, and they meet at a barrier where an operation needs all of the
one before (ten a layer); the norms, the rotation and the additions are a few thousand numbers, done
by one thread between two barriers. It is faster than the graph's step at batch 1 and 8 (the A/B
runs: ``docs/benchmarks.md``, "How the EPYC's batch-1 decode got here").

The model it serves: every block ``x + attn(norm(x))``, ``x + mlp(norm(x))``, the norms all RMSNorm
(without offset) or all LayerNorm (with or without bias), of one epsilon; RoPE (any rule but
longrope, one for every layer), learned positions or neither; grouped kv heads; no window and no
other score rule; an MLP ``down(act(gate) * up)`` or ``down(act(up))`` with SiLU or GELU (exact
or tanh); biases on any matrix; no embedding norm or scale, no logit cap; every matrix multiplied
by the stream kernel (:func:`selfattn.generation.layout.decode_layout`'s ``stream`` form, its rule
wherever the kernel builds, or int8 from :func:`selfattn.generation.int8.quantize_int8`): the kernel
runs the products the model's own step would. That is Llama, SmolLM2, Qwen2, Phi-3 without
longrope, Mistral without its window, GPT-2 and this project's GPTs; :func:`unsupported` says why
another model is not (Gemma, OLMo 2, BLOOM, gpt-oss), and its steps stay graphs. Batches of rows
without padding only (a padded batch's step is a graph). A call takes one token a row (a decode
step) or several (a speculative verification by prompt lookup or a draft model: causal among
themselves, after the cached ones).

Each value is rounded to the model's dtype where its eager step rounds it (``kernels/decode.cpp``
lists them), so a half-precision step rounds as the eager one does, not as a fused graph does.
"""
from __future__ import annotations

import weakref
from collections.abc import Sequence

import torch
from torch import Tensor, nn

from selfattn.config import GPTConfig
from selfattn.generation.int8 import Int8Linear
from selfattn.kernels import stream
from selfattn.kv_cache import KVCache
from selfattn.model import GPT, MLP, GatedMLP
from selfattn.norms import RMSNorm
from selfattn.rope import rope_angles

DTYPES = (torch.float32, torch.bfloat16, torch.float16)

# Every field of GPTConfig is one or the other (a test holds the two to the config's fields): the C++ step is
# a second copy of the model, and a field it does not know would otherwise be computed silently wrong.
# Read by the step (or each value it cannot compute refused by the checks of the modules in unsupported()):
HANDLED = ("vocab_size", "block_size", "n_layer", "n_head", "n_embd", "n_kv_head", "head_dim", "bias", "qkv_bias",
           "proj_bias", "dropout", "pos", "rope_base", "rope_scaling", "rope_dims", "attn_scale", "backend", "mlp",
           "mlp_kind", "intermediate_size", "norm", "layer_norm_eps", "gelu_approximate", "tie_embeddings")
# Refused unless at its default:
REFUSED = ("window", "window_layers", "window_rope_base", "sink_tokens", "alibi", "softcap", "sinks", "qk_norm",
           "n_experts", "experts_per_token", "expert_clamp", "norm_offset", "norm_weight_in_float32", "norm_position",
           "embedding_norm", "embedding_scale", "logit_softcap")
_DEFAULTS = GPTConfig.__dataclass_fields__


def unsupported(model: GPT) -> str | None:
    """Why :class:`KernelStep` cannot run ``model``'s decode steps (None when it can)."""
    why = stream.failure()
    if why is not None:
        return f"the kernel did not build here ({why})"
    w = model.wte.weight
    if w.device.type != "cpu" or w.dtype not in DTYPES:
        return f"the model is {w.dtype} on {w.device}, the kernel takes float32, bfloat16 or float16 on the CPU"
    if model.ln_emb is not None:
        return "its embedding has a norm"
    norms = _norms(model)
    if not (all(type(n) is RMSNorm and not n.offset and not n.weight_in_float32 for n in norms) or
            all(type(n) is nn.LayerNorm and n.weight is not None for n in norms)) or \
            len({n.eps for n in norms}) > 1:
        return "its norms are not all RMSNorm (without offset) or all LayerNorm, of one epsilon"
    for i, b in enumerate(model.blocks):
        why = _block(b)
        if why is not None:
            return f"layer {i} {why}"
    if len({(b.attn.rope, b.attn.rope_dims, b.attn.rope_base, repr(b.attn.rope_scaling)) for b in model.blocks}) > 1:
        return "its layers rotate by different RoPE rules"
    if len({_mlp(b.mlp) for b in model.blocks}) > 1:
        return "its layers' MLPs differ"
    matrices = _matrices(model)
    kinds = {(type(m) is Int8Linear, m.q.dtype if type(m) is Int8Linear else m.weight.dtype) for m in matrices}
    if len(kinds) > 1:
        return f"its matrices are not of one dtype ({sorted(str(k[1]) for k in kinds)})"
    for m in matrices:
        if type(m) is Int8Linear and m.kernel != "stream":
            return "an int8 matrix is multiplied by another kernel"
        if type(m) is not Int8Linear and getattr(m, "one_row", None) != "stream":
            return (f"its one-row products are not the stream kernel's ({getattr(m, 'one_row', 'nn.Linear')}: "
                    f"decode_layout() takes them wherever the kernel builds)")
        if type(m) is not Int8Linear and (not m.weight.is_contiguous() or m.weight.dtype != w.dtype):
            return f"a matrix is not stored in rows of {w.dtype}"
    for name in REFUSED:
        if getattr(model.config, name) != _DEFAULTS[name].default:
            return f"its config sets {name}={getattr(model.config, name)!r}, which the kernel does not compute"
    return None


def _block(b: nn.Module) -> str | None:
    """Why block ``b`` is not one the kernel runs (None when it is)."""
    a, mlp = b.attn, b.mlp
    if not (isinstance(b.post_ln_1, nn.Identity) and (mlp is None or isinstance(b.post_ln_2, nn.Identity))):
        return "norms its sublayers' outputs"
    if a.rope and (a.rope_scaling or {}).get("rope_type") == "longrope":
        return "rotates by longrope"
    if a.window is not None or a.alibi or a.softcap is not None or a.sinks is not None or a.q_norm is not None \
            or a.mask_mod is not None or a.score_mod is not None:
        return "has a window, ALiBi, soft-capping, sinks, q/k norms or a mask or score rule"
    if _mlp(mlp) is None:
        return "has no MLP of SiLU or GELU, gated or not"
    return None


def _mlp(mlp: nn.Module | None) -> tuple[str, bool] | None:
    """The kernel's name of ``mlp``'s activation and whether it is gated, None for an MLP it has not."""
    if isinstance(mlp, GatedMLP):
        act, gated = mlp.act, True
    elif isinstance(mlp, MLP):
        act, gated = mlp.gelu, False
    else:
        return None
    if type(act) is nn.SiLU:
        return "silu", gated
    if type(act) is nn.GELU:
        return {"none": "gelu", "tanh": "gelu_tanh"}[act.approximate], gated
    return None


def _norms(model: GPT) -> list[nn.Module]:
    """The norms in the order of ``kernels/decode.cpp``: each layer's two, the final one."""
    return [n for b in model.blocks for n in (b.ln_1, b.ln_2)] + [model.ln_f]


def _matrices(model: GPT) -> list[nn.Module]:
    """The matrices in the order of ``kernels/decode.cpp``: each layer's qkv, proj, up (or gate_up) and
    down, the head."""
    def mlp(m: nn.Module) -> tuple[nn.Module, nn.Module]:
        return (m.gate_up_proj, m.down_proj) if isinstance(m, GatedMLP) else (m.c_fc, m.c_proj)
    return [m for b in model.blocks for m in (b.attn.qkv, b.attn.proj, *mlp(b.mlp))] + [model.lm_head]


class KernelStep:
    """``model``'s decode steps by the kernel (the model must be supported: :func:`unsupported`),
    of the build ``isa`` (None: :func:`selfattn.kernels.stream.chosen`). The weights are read from
    the model at the first call with a cache (:meth:`_weights`)."""

    def __init__(self, model: GPT, *, isa: str | None = None):
        why = unsupported(model)
        if why is not None:
            raise ValueError(f"the decode kernel cannot run this model: {why}")
        self._model, self.angles, self.isa = weakref.ref(model), None, isa  # weakly, as the steps hold it
        self.cache, self.weights = None, None  # the cache (its first layer, weakly) they were gathered for, and them
        a, (act, gated) = model.blocks[0].attn, _mlp(model.blocks[0].mlp)
        self.shape = {"n_head": a.n_head, "eps": model.ln_f.eps, "act": act, "gated": gated,
                      "scale": a.scale if a.scale is not None else a.head_dim ** -0.5,
                      "norm": "rmsnorm" if type(model.ln_f) is RMSNorm else "layernorm"}  # the step's arguments

    @property
    def model(self) -> GPT:
        return self._model()

    def serves(self, mask: Tensor | None, cache: Sequence) -> bool:
        """Whether a step with this ``mask`` and ``cache`` runs here: no padding, the model's caches,
        and no dropout to draw (a model in training mode with dropout steps as it is)."""
        dropout = self.model.training and self.model.config.dropout > 0
        return mask is None and not dropout and all(type(c) is KVCache for c in cache)

    def __call__(self, idx: Tensor, cache: Sequence[KVCache], past: int) -> Tensor:
        """Logits ``(B, T, V)`` of the tokens ``idx`` ``(B, T)`` at positions ``past ..``, causal among
        themselves (a decode step: T = 1; a speculative verification: a few), their k and v cached."""
        if self.cache is None or self.cache() is not cache[0]:  # a new generation's cache
            self.weights, self.cache = self._weights(), weakref.ref(cache[0])
        B, T = idx.shape
        cos, sin = self._angles()
        logits = stream.load(self.isa or stream.chosen()).step(
            idx, past, caches=[t for c in cache for t in (c.k, c.v)], cos=cos, sin=sin, **self.weights, **self.shape)
        for c in cache:
            c.length = past + T
        return logits.view(B, T, -1)  # (B·T, V) -> (B, T, V)

    def _weights(self) -> dict[str, Tensor | None | list]:
        """The model's embeddings, norms, matrices, biases and int8 scales as they are now (the
        step's arguments of those names), gathered once per generation (per cache: a list of every
        weight is a measurable part of a step), so a model cast or quantised since the last generation
        decodes as it is now."""
        m = self.model
        dtype, matrices, norms = m.wte.weight.dtype, _matrices(m), _norms(m)
        int8 = type(matrices[0]) is Int8Linear
        return {"wte": m.wte.weight.contiguous(),  # in rows (a layout for another form stores it in columns)
                "wpe": None if m.wpe is None else m.wpe.weight.contiguous(),
                "norms": [n.weight for n in norms], "norm_biases": [getattr(n, "bias", None) for n in norms],
                "matrices": [x.q if int8 else x.weight for x in matrices],
                "biases": [None if x.bias is None else x.bias.to(dtype) for x in matrices],  # int8's: float32
                "scales": [x.scale.float() if int8 else None for x in matrices]}  # float32 (a model cast casts them)

    def _angles(self) -> tuple[Tensor, Tensor]:
        """RoPE's cos and sin of every position the model reads, ``(block_size, R / 2)`` float32, once
        (``(block_size, 0)`` without RoPE: nothing rotates)."""
        if self.angles is None:
            a, positions = self.model.blocks[0].attn, torch.arange(self.model.config.block_size)
            if not a.rope:
                self.angles = (torch.zeros(len(positions), 0),) * 2
            else:
                cos, sin = rope_angles(positions, a.rope_dims, a.rope_base, scaling=a.rope_scaling)  # (1, 1, P, R/2)
                self.angles = cos[0, 0].float().contiguous(), sin[0, 0].float().contiguous()
        return self.angles
