"""Cached decoding against the full forward: where the other causality bugs hide.

A model can be causal in its full forward and still decode wrongly from its KV cache: a
causal mask aligned top-left once the cache makes T < S hides past keys, a stale cache slot
is read, positions restart at 0. :func:`check_cache` decodes greedily with the cache and
compares every step, layer by layer, with the full forward of the same sequence.
"""
from __future__ import annotations

import copy
import numbers
from dataclasses import dataclass

import torch
from torch import Tensor, nn

from selfattn.audit.causality import eval_mode

CACHE_RTOL_EPS = 16  # the default tolerance's floor, in units of the dtype's eps per block the outputs went through
ROUNDING_FACTOR = 8  # ... and its bound per layer: this many times the full forward's own rounding error there


@dataclass(frozen=True)
class CacheReport:
    """The result of :func:`check_cache`; ``str(report)`` is a readable summary."""
    layers: tuple[str, ...]  # "embeddings" (block 0's input), "block 0", ..., "logits"
    errors: Tensor  # (steps, layers) float64: max |cached - full| / max |full| of that step and layer
    bounds: Tensor  # (layers,) float64: the largest relative error of each layer that counts as agreement
    tokens: Tensor  # (B, steps) the greedy tokens of the full forward

    @property
    def rtol(self) -> float:
        """The largest bound of any layer."""
        return float(self.bounds.max())

    @property
    def divergent(self) -> tuple[int, str] | None:
        """(step, layer) of the first disagreement, an error past its bound or not finite: the earliest
        step, its shallowest layer."""
        bad = (~(self.errors <= self.bounds)).nonzero().tolist()  # row-major: step first, then layer; NaN is bad
        return (bad[0][0], self.layers[bad[0][1]]) if bad else None

    @property
    def ok(self) -> bool:
        return self.divergent is None

    @property
    def first_step(self) -> int | None:
        """0 is the prefill of the prompt; step s feeds the s-th generated token."""
        return None if self.ok else self.divergent[0]

    @property
    def first_layer(self) -> str | None:
        return None if self.ok else self.divergent[1]

    @property
    def max_error(self) -> dict[str, float]:
        """Layer -> the largest relative error over all steps."""
        return dict(zip(self.layers, self.errors.amax(dim=0).tolist()))

    def __str__(self) -> str:
        steps = self.errors.shape[0]
        head = f"cache check ({steps} steps, rtol up to {self.rtol:.3g}): "
        head += "ok" if self.ok else f"DIVERGES at step {self.first_step}, {self.first_layer}"
        worst = ", ".join(f"{name} {err:.2g}" for name, err in self.max_error.items())
        return f"{head}\n  max relative error per layer: {worst}"


def check_cache(model: nn.Module, prompt: Tensor, max_new_tokens: int, *, rtol: float | None = None) -> CacheReport:
    """Decode greedily with the KV cache and compare every step with the full forward.

    Step 0 runs the prompt through an empty cache; step s feeds the s-th generated token
    alone. Each step's outputs of every layer (block 0's input, each block, the logits) for
    the new positions are compared with the full forward of the whole sequence so far at the
    same positions. The next token is the full forward's greedy choice, so the two stay on the
    same sequence after a divergence. An error is relative to the largest magnitude of that layer's
    full-forward output, and counts as rounding up to ``rtol`` when given; by default, up to each
    layer's bound: :data:`ROUNDING_FACTOR` times the largest error of the full forward itself at that
    layer against the same model in float64 (the two paths sum in other orders in every layer, so the
    cached one errs about as much as the full one: a model whose layers amplify rounding, a mixture
    of experts, soft-caps, gets a bound to match), and never below ``16 * eps`` of the model's dtype
    per block. A real cache bug errs by 1e-2 and more; a non-finite error always fails.

    ``model``: our ``GPT``, or any module with ``blocks``, ``new_cache(batch, max_len)`` and a
    ``forward(idx, cache=...)`` returning logits (or a tuple starting with them).
    """
    if not isinstance(model, nn.Module) or not hasattr(model, "blocks") or not hasattr(model, "new_cache"):
        raise TypeError(f"check_cache needs a model with .blocks and .new_cache() (our GPT), "
                        f"got {type(model).__name__}")
    if not isinstance(prompt, Tensor) or prompt.dim() != 2 or prompt.shape[1] == 0 or prompt.is_floating_point():
        raise ValueError(f"prompt must be integer token ids of shape (B, T) with T >= 1, got "
                         f"{tuple(prompt.shape) if isinstance(prompt, Tensor) else type(prompt).__name__}")
    if not isinstance(max_new_tokens, int) or isinstance(max_new_tokens, bool) or max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be a positive int, got {max_new_tokens!r}")
    dtype = next(model.parameters()).dtype
    if rtol is not None and (not isinstance(rtol, numbers.Real) or not rtol >= 0):
        raise ValueError(f"rtol must be a number >= 0, got {rtol!r}")
    floor = CACHE_RTOL_EPS * torch.finfo(dtype).eps * max(1, len(model.blocks))
    exact = None if rtol is not None or dtype == torch.float64 else copy.deepcopy(model).double()
    layers = ("embeddings",) + tuple(f"block {i}" for i in range(len(model.blocks))) + ("logits",)
    B, P = prompt.shape
    errors, rounding, tokens = [], [], []
    with eval_mode(model), torch.no_grad():
        cache = model.new_cache(B, P + max_new_tokens - 1)  # the last new token is never fed
        seq, new = prompt, prompt
        for _ in range(max_new_tokens):
            cached, full = _layer_outputs(model, new, cache), _layer_outputs(model, seq, None)
            T = new.shape[1]
            errors.append([_relative_error(c, f[:, -T:]) for c, f in zip(cached, full)])
            if exact is not None:
                with eval_mode(exact):
                    rounding.append([_relative_error(f, e) for f, e in zip(full, _layer_outputs(exact, seq, None))])
            tok = full[-1][:, -1].argmax(dim=-1)  # (B,) greedy on the full forward
            tokens.append(tok)
            seq, new = torch.cat([seq, tok[:, None]], dim=1), tok[:, None]  # (B, L + 1), (B, 1)
    if rtol is not None:
        bounds = torch.full((len(layers),), float(rtol), dtype=torch.float64)
    elif exact is None:
        bounds = torch.full((len(layers),), floor, dtype=torch.float64)
    else:  # (steps, layers) -> (layers,): the full forward's worst rounding at each layer, times the factor
        worst = torch.tensor(rounding, dtype=torch.float64).nan_to_num(nan=0.0, posinf=0.0).amax(dim=0)
        bounds = (ROUNDING_FACTOR * worst).clamp(min=floor)
    return CacheReport(layers=layers, errors=torch.tensor(errors, dtype=torch.float64), bounds=bounds,
                       tokens=torch.stack(tokens, dim=1))


def _layer_outputs(model: nn.Module, idx: Tensor, cache) -> list[Tensor]:
    """Block 0's input, every block's output and the logits of one forward, each (B, T, ...)."""
    seen = []
    hooks = [model.blocks[0].register_forward_pre_hook(lambda m, args: seen.append(args[0]))]
    hooks += [block.register_forward_hook(lambda m, args, out: seen.append(_first(out))) for block in model.blocks]
    try:
        logits = _first(model(idx) if cache is None else model(idx, cache=cache))
    finally:
        for h in hooks:
            h.remove()
    return seen + [logits]


def _first(out) -> Tensor:
    return out[0] if isinstance(out, (tuple, list)) else out


def _relative_error(got: Tensor, want: Tensor) -> float:
    scale = want.abs().max().double().item()
    return (got.double() - want.double()).abs().max().item() / (scale if scale > 0 else 1.0)
