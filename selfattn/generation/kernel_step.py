"""A decode step of a decoder (Llama's, GPT-2's, Gemma's and the families between) as one C++ call
(``kernels/decode.cpp``, built with :mod:`selfattn.kernels.matvec`), for
:func:`~selfattn.generation.compile_decode` on the CPU.

The whole step is one call: the threads start once, every product and attention is split among them,
and they meet at a barrier where an operation needs all of the one before (ten a layer); the norms, the
rotation and the additions are done by one thread between two barriers. Why a step of its own rather
than the compiled graph's: ``docs/design.md``, "The C++ decode step".

The model it serves, described as data (``decode.cpp``'s arguments), never by a family's name: blocks
``x + post(attn(pre(x)))``, ``x + post(mlp(pre(x)))`` with the norms before, around or after each
sublayer (``norm_position``) and one after the embedding or not; the norms all RMSNorm (any offset,
rounded before or after the weight) or all LayerNorm (with or without bias), of one epsilon, q/k norms
over each head or over the projection included; RoPE (any rule but longrope, per layer: Gemma 3's
local base), learned positions or neither; grouped kv heads; per-layer windows over rolling caches,
with sink tokens; ALiBi, soft-capped scores, learned sinks; an MLP ``down(act(gate) * up)`` or
``down(act(up))`` with SiLU or GELU (exact or tanh), or a mixture of experts (gpt-oss's: each token's
top k clamped SwiGLUs, the experts stored in rows by ``decode_layout``, in floats); biases on any matrix;
the embedding scaled, the logits soft-capped; every matrix multiplied by the matvec kernel
(:func:`selfattn.generation.layout.decode_layout`'s ``matvec`` form, its rule wherever the kernel builds,
or int8 from :func:`selfattn.generation.int8.quantize_int8`): the kernel runs the products the model's own
step would. That is every family of :mod:`selfattn.families` and this project's GPTs (:func:`unsupported`
says why a model is not served). Batches of rows without padding only (a padded batch's step is not the kernel's). A
call takes one token a row (a decode step) or several (a speculative verification by prompt lookup or a
draft model: causal among themselves, after the cached ones); a rolling cache takes as many as it can
roll back, plus one (:meth:`KernelStep.serves`): the new keys are written before they are read, and a
longer run would overwrite keys its first queries still see.

Each value is rounded to the model's dtype where its eager step rounds it (``kernels/decode.cpp``
lists them), so a half-precision step rounds as the eager one does, not as a fused graph does.
"""
from __future__ import annotations

import weakref
from collections.abc import Sequence

import torch
from torch import Tensor, nn

from selfattn.generation.int8 import Int8Linear
from selfattn.generation.layout import FEW
from selfattn.kernels import matvec
from selfattn.kv_cache import KVCache, RollingKVCache
from selfattn.model import GPT, MLP, GatedMLP, MoE
from selfattn.norms import RMSNorm
from selfattn.rope import rope_angles
from selfattn.scores import alibi_slopes

DTYPES = (torch.float32, torch.bfloat16, torch.float16)

# Every field of GPTConfig (a test holds this to the config's fields): the C++ step is a second copy of the
# model, and a field it does not know would otherwise be computed silently wrong. Read by the step (or each
# value it cannot compute refused by the checks of the modules in unsupported()):
HANDLED = ("vocab_size", "block_size", "n_layer", "n_head", "n_embd", "n_kv_head", "head_dim", "bias", "qkv_bias",
           "proj_bias", "dropout", "pos", "rope_base", "rope_scaling", "rope_dims", "attn_scale", "backend", "mlp",
           "mlp_kind", "intermediate_size", "norm", "layer_norm_eps", "gelu_approximate", "tie_embeddings",
           "window", "window_layers", "window_rope_base", "sink_tokens", "alibi", "softcap", "sinks", "qk_norm",
           "norm_offset", "norm_weight_in_float32", "norm_position", "embedding_norm", "embedding_scale",
           "logit_softcap", "n_experts", "experts_per_token", "expert_clamp")


def unsupported(model: GPT, *, as_stored: bool = False) -> str | None:
    """Why :class:`KernelStep` cannot run ``model``'s decode steps (None when it can): a model laid out for
    the kernel's products (:func:`~selfattn.generation.layout.decode_layout`'s ``matvec`` form or int8), whose
    eager step the kernel's equals; ``as_stored``: plain float32 ``nn.Linear`` matrices too (stored in rows),
    whose eager products are PyTorch's (generate's default, :func:`~selfattn.generation.steps.steps_of`). The
    kernel sums in another order, which in float32 moves a logit by a rounding of its sum; in half precision
    each product's rounding to the dtype turns that into other tokens at a near-tie, so plain half matrices
    decode eagerly until laid out. The kernel is built (once) for a model on the CPU."""
    w = model.wte.weight
    if w.device.type != "cpu" or w.dtype not in DTYPES:
        return f"the model is {w.dtype} on {w.device}, the kernel takes float32, bfloat16 or float16 on the CPU"
    why = matvec.failure()
    if why is not None:
        return f"the kernel did not build here ({why})"
    norms = [n for n in _norms(model) + _qk_norms(model) if n is not None]
    rules = {_norm_rule(n) for n in norms}
    if len(rules) > 1 or any(isinstance(rule, str) for rule in rules):
        return "its norms are not all RMSNorm or all LayerNorm (with a weight) of one epsilon, offset and rounding"
    for i, b in enumerate(model.blocks):
        why = _block(b)
        if why is not None:
            return f"layer {i} {why}"
    if len({(b.attn.rope, b.attn.rope_dims) for b in model.blocks}) > 1:
        return "its layers rotate different channels"
    if len({_mlp(b.mlp) for b in model.blocks}) > 1 or len({b.attn.qk_norm_over for b in model.blocks}) > 1:
        return "its layers' MLPs or q/k norms differ"
    matrices = _matrices(model)
    kinds = {(type(m) is Int8Linear, m.q.dtype if type(m) is Int8Linear else m.weight.dtype) for m in matrices}
    if len(kinds) > 1:
        return f"its matrices are not of one dtype ({sorted(str(k[1]) for k in kinds)})"
    for m in matrices:
        if type(m) is Int8Linear and m.kernel != "matvec":
            return "an int8 matrix is multiplied by another kernel"
        if type(m) is not Int8Linear and getattr(m, "one_row", None) != "matvec" and not (
                as_stored and type(m) is nn.Linear and m.weight.dtype == torch.float32):
            return (f"its one-row products are not the matvec kernel's ({getattr(m, 'one_row', 'nn.Linear')} in "
                    f"{m.weight.dtype}: decode_layout() takes them wherever the kernel builds)")
        if type(m) is not Int8Linear and (not m.weight.is_contiguous() or m.weight.dtype != w.dtype):
            return f"a matrix is not stored in rows of {w.dtype}"
    (int8, dtype), = kinds
    for b in model.blocks:
        experts = (b.mlp.gate_up_proj, b.mlp.down_proj) if isinstance(b.mlp, MoE) else ()
        if any(int8 or e.dtype != dtype or not e.transpose(1, 2).is_contiguous() for e in experts):
            return (f"its experts are not stored in rows of {w.dtype} (decode_layout() stores them so; an int8 "
                    f"model's experts stay in floats)")
    return None


def _norm_rule(n: nn.Module) -> tuple | str:
    """What the kernel needs to be one for every norm of a model: kind, epsilon, offset, rounding (a string
    naming a norm it does not compute)."""
    if type(n) is RMSNorm:
        return "rmsnorm", n.eps, n.offset, n.weight_in_float32
    if type(n) is nn.LayerNorm and n.weight is not None:
        return "layernorm", n.eps, 0.0, False
    return f"a {type(n).__name__}"


def _block(b: nn.Module) -> str | None:
    """Why block ``b`` is not one the kernel runs (None when it is)."""
    a, mlp = b.attn, b.mlp
    if a.rope and (a.rope_scaling or {}).get("rope_type") == "longrope":
        return "rotates by longrope"
    if a.mask_mod is not None or a.score_mod is not None:
        return "has a mask or score rule of its own"
    if _mlp(mlp) is None:
        return "has no MLP of SiLU or GELU, gated or not, or of experts"
    return None


def _mlp(mlp: nn.Module | None) -> tuple[str, bool] | None:
    """The kernel's name of ``mlp``'s activation and whether it is gated (``"moe"`` for a mixture of
    experts, whose clamped SwiGLUs the kernel knows), None for an MLP it has not."""
    if isinstance(mlp, MoE):
        return "moe", True
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


def _norms(model: GPT) -> list[nn.Module | None]:
    """The norms in the order of ``kernels/decode.cpp``: the embedding's, each layer's four (before and
    after attention, before and after the MLP), the final one; None for each one the model has not."""
    def norm(n: nn.Module | None) -> nn.Module | None:
        return None if n is None or isinstance(n, nn.Identity) else n
    return [norm(model.ln_emb), *(norm(n) for b in model.blocks for n in (b.ln_1, b.post_ln_1, b.ln_2, b.post_ln_2)),
            model.ln_f]


def _qk_norms(model: GPT) -> list[nn.Module | None]:
    """Each layer's q and k norms (None where it has none), in the order of ``kernels/decode.cpp``."""
    return [n for b in model.blocks for n in (b.attn.q_norm, b.attn.k_norm)]


def _matrices(model: GPT) -> list[nn.Module]:
    """Every matrix module of ``model`` the kernel multiplies: each layer's (:func:`_matrices_of`), the head."""
    return [m for b in model.blocks for m in _matrices_of(b)] + [model.lm_head]


def _matrices_of(b: nn.Module) -> tuple[nn.Module, ...]:
    """Block ``b``'s matrix modules in the order of ``kernels/decode.cpp``: qkv, proj, up (or gate_up) and down;
    a mixture's router in their place (its experts are parameters: :func:`_experts`)."""
    if isinstance(b.mlp, MoE):
        return b.attn.qkv, b.attn.proj, b.mlp.router
    mlp = (b.mlp.gate_up_proj, b.mlp.down_proj) if isinstance(b.mlp, GatedMLP) else (b.mlp.c_fc, b.mlp.c_proj)
    return b.attn.qkv, b.attn.proj, *mlp


def _experts(moe: MoE) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """A mixture's experts as ``kernels/decode.cpp`` reads them, in rows (out, in) each: gate_up ``(E, 2I, C)``
    (gate and up alternating), down ``(E, C, I)``, and their biases ``(E, 2I)``, ``(E, C)``."""
    return (moe.gate_up_proj.detach().transpose(1, 2), moe.down_proj.detach().transpose(1, 2),
            moe.gate_up_bias.detach(), moe.down_bias.detach())


def _rope_rule(attn: nn.Module) -> tuple:
    """A layer's RoPE rule: layers of one rule share a table of angles."""
    return attn.rope, attn.rope_dims, attn.rope_base, repr(attn.rope_scaling)


class KernelStep:
    """``model``'s decode steps by the kernel (the model must be supported: :func:`unsupported`, with
    ``as_stored``), of the build ``isa`` (None: :func:`selfattn.kernels.matvec.chosen`). The weights are read from
    the model at the first call with a cache (:meth:`_weights`)."""

    def __init__(self, model: GPT, *, isa: str | None = None, as_stored: bool = False):
        why = unsupported(model, as_stored=as_stored)
        if why is not None:
            raise ValueError(f"the decode kernel cannot run this model: {why}")
        self._model, self.isa = weakref.ref(model), isa  # weakly, as the steps hold it
        self.cache, self.weights = None, None  # the cache (its first layer, weakly) they were gathered for, and them
        rules = list(dict.fromkeys(_rope_rule(b.attn) for b in model.blocks))  # in the order the layers take them
        self.rope_of = [rules.index(_rope_rule(b.attn)) for b in model.blocks]  # each layer's table of angles
        firsts = [model.blocks[self.rope_of.index(i)].attn for i in range(len(rules))]  # a layer of each rule
        self.rules = [(a.rope, a.rope_dims, a.rope_base, a.rope_scaling) for a in firsts]
        self.angles = None  # each rule's (cos, sin) of positions 0 .. P - 1, P grown as positions are reached
        a, c, (act, gated) = model.blocks[0].attn, model.config, _mlp(model.blocks[0].mlp)
        moe = model.blocks[0].mlp if act == "moe" else None
        kind, eps, offset, in_float32 = _norm_rule(model.ln_f)
        self.shape = {"n_head": a.n_head, "scale": a.scale if a.scale is not None else a.head_dim ** -0.5,
                      "softcap": a.softcap or 0.0, "logit_softcap": c.logit_softcap or 0.0,
                      "embedding_scale": c.embedding_scale or 0.0, "norm": kind, "eps": eps, "norm_offset": offset,
                      "norm_weight_in_float32": in_float32, "qk_per_head": a.qk_norm_over == "head",
                      "act": "silu" if moe else act, "gated": gated, "top_k": moe.top_k if moe else 0,
                      "clamp": moe.clamp if moe else 0.0, "alpha": MoE.ALPHA}  # the step's arguments

    @property
    def model(self) -> GPT:
        return self._model()

    def serves(self, mask: Tensor | None, cache: Sequence, tokens: int = 1) -> bool:
        """Whether a step of ``tokens`` a row with this ``mask`` and ``cache`` runs here: a few rows (up to
        :data:`~selfattn.generation.layout.FEW`, what its products stream for; a prompt's are BLAS's), no
        padding, the caches the model makes (a rolling one taking at most its rollback + 1 tokens), and no
        dropout to draw (a model in training mode with dropout steps as it is)."""
        dropout = self.model.training and self.model.config.dropout > 0
        few = len(cache) == 0 or cache[0].k.shape[0] * tokens <= FEW
        return few and mask is None and not dropout and all(_fits(b.attn, c, tokens)
                                                            for b, c in zip(self.model.blocks, cache))

    def __call__(self, idx: Tensor, cache: Sequence[KVCache | RollingKVCache], past: int) -> Tensor:
        """Logits ``(B, T, V)`` of the tokens ``idx`` ``(B, T)`` at positions ``past ..``, causal among
        themselves (a decode step: T = 1; a speculative verification: a few), their k and v cached."""
        if self.cache is None or self.cache() is not cache[0]:  # a new generation's cache
            self.weights, self.cache = self._weights(), weakref.ref(cache[0])
        B, T = idx.shape
        cos, sin = self._angles(past + T)
        layers = [n for c, rope in zip(cache, self.rope_of) for n in _layer(c, rope)]
        logits = matvec.load(self.isa or matvec.chosen()).step(
            idx, past, caches=[t for c in cache for t in (c.k, c.v)], layers=layers, cos=cos, sin=sin,
            **self.weights, **self.shape)
        for c in cache:
            c.advance(T)  # the T positions the kernel wrote into their slots
        return logits.view(B, T, -1)  # (B·T, V) -> (B, T, V)

    def _weights(self) -> dict[str, Tensor | None | list]:
        """The model's embeddings, norms, matrices, biases, int8 scales, slopes and sinks as they are now
        (the step's arguments of those names), gathered once per generation (per cache: a list of every
        weight is a measurable part of a step), so a model cast or quantised since the last generation
        decodes as it is now."""
        m = self.model
        dtype, norms = m.wte.weight.dtype, _norms(m)
        int8 = type(m.lm_head) is Int8Linear

        def entry(x: nn.Module) -> tuple:  # (matrix, its bias in the model's dtype, its float32 int8 scale)
            return (x.q if int8 else x.weight, None if x.bias is None else x.bias.to(dtype),  # int8's: float32
                    x.scale.float() if int8 else None)
        matrices, routers = [], []  # a mixture's router apart, its experts in place of up and down
        for b in m.blocks:
            moe = b.mlp if isinstance(b.mlp, MoE) else None
            if moe is None:
                matrices += [entry(x) for x in _matrices_of(b)]
            else:
                gate_up, down, gate_up_bias, down_bias = _experts(moe)
                matrices += [entry(b.attn.qkv), entry(b.attn.proj), (gate_up, gate_up_bias, None),
                             (down, down_bias, None)]
            routers.append(entry(moe.router)[:2] if moe else (None, None))
        matrices.append(entry(m.lm_head))
        return {"wte": m.wte.weight.contiguous(),  # in rows (a layout for another form stores it in columns)
                "wpe": None if m.wpe is None else m.wpe.weight.contiguous(),
                "norms": [None if n is None else n.weight for n in norms],
                "norm_biases": [getattr(n, "bias", None) for n in norms],
                "qk_norms": [None if n is None else n.weight for n in _qk_norms(m)],
                "matrices": [w for w, _, _ in matrices], "biases": [b for _, b, _ in matrices],
                "scales": [s for _, _, s in matrices],
                "routers": [w for w, _ in routers], "router_biases": [b for _, b in routers],
                "alibi": alibi_slopes(m.config.n_head) if m.config.alibi else None,
                "sinks": [None if b.attn.sinks is None else b.attn.sinks.detach().float().contiguous()
                          for b in m.blocks]}

    def _angles(self, positions: int) -> tuple[list[Tensor], list[Tensor]]:
        """Each RoPE rule's cos and sin of positions ``0 .. P - 1`` (P >= ``positions``), ``(P, R / 2)``
        float32 (``(P, 0)`` without RoPE: nothing rotates), computed again twice as long when a
        position past them is reached (up to ``block_size`` where the model has a limit)."""
        if self.angles is None or self.angles[0][0].shape[0] < positions:
            limit = self.model.max_positions
            P = max(positions, 256, 2 * (0 if self.angles is None else self.angles[0][0].shape[0]))
            P = P if limit is None else max(positions, min(P, limit))
            self.angles = [], []
            for rope, dims, base, scaling in self.rules:
                if not rope:
                    cos = sin = torch.zeros(P, 0)
                else:
                    cos, sin = rope_angles(torch.arange(P), dims, base, scaling=scaling)  # (1, 1, P, R/2)
                    cos, sin = cos[0, 0].float().contiguous(), sin[0, 0].float().contiguous()
                self.angles[0].append(cos), self.angles[1].append(sin)
        return self.angles


def _fits(attn: nn.Module, cache, tokens: int) -> bool:
    """Whether ``cache`` is the one the model makes for the layer of ``attn``, and takes ``tokens`` at once."""
    if attn.window is None:
        return type(cache) is KVCache
    return (type(cache) is RollingKVCache and cache.window == attn.window and
            cache.sink_tokens == (attn.sink_tokens or 0) and tokens <= cache.rollback + 1)


def _layer(cache, rope: int) -> tuple[int, int, int, int]:
    """A layer's four numbers of ``kernels/decode.cpp``: its window, sink tokens, ring and RoPE table."""
    if type(cache) is RollingKVCache:
        return cache.window, cache.sink_tokens, cache.ring, rope
    return 0, 0, 0, rope
