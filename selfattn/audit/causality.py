"""Causality audits: does any output depend on an input it must not see?

The seed document tests causality with one perturbation: change the input at position 2,
check that the outputs at 0 and 1 do not move. :func:`check_causal` generalises it to every
position of any sequence function, by two complementary methods:

- ``perturb``: for each position t, change the input at t only, in the module's own dtype,
  and record how far every output moves. Outputs before t must not move (beyond ``atol``).
  It sees the function exactly as inference runs it, non-differentiable paths included.
- ``jacobian``: on a float64 copy of the module, one vector-Jacobian product per output
  position i with a random vector u gives ``|u · ∂y_i/∂x_j|`` for every input j at once. It
  is zero exactly when the block ``∂y_i/∂x_j`` is zero (for all but a measure-zero set of u),
  so it finds leaks too small for float32 rounding to show and names every leaking pair.

Either way the result is a T×T dependence matrix (row = output, column = input); a leak is
a pair above ``atol`` that the declared rule forbids (``j > i``, or with ``window=W`` also
``j <= i - W``). :func:`selfattn.audit.cache.check_cache` checks the other place causality bugs hide: cached
decoding against the full forward, step by step and layer by layer.

What is and is not audited: the function in eval mode (dropout off, BatchNorm on its running
statistics). A BatchNorm that normalises over the sequence with batch statistics leaks in
training mode only, and that is out of scope; a normalisation over time that runs at eval
(a LayerNorm across T, BatchNorm with ``track_running_stats=False``) is caught.
Misalignments that *hide* the past (e.g. a top-left causal mask under a KV cache) are not
leaks: they show as holes in the dependence picture and are caught by ``check_cache``.
"""
from __future__ import annotations

import contextlib
import copy
import math
import numbers
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import NamedTuple

import torch
from torch import Tensor, nn

from selfattn._util import validate as _validate
from selfattn.masks import Mask

METHODS = ("perturb", "jacobian", "both")
PICTURE_MAX_T = 64  # longer sequences get no T×T picture in the report


class Leak(NamedTuple):
    """Output position ``output`` depends on input position ``input`` that it must not see."""
    output: int
    input: int
    size: float  # the change (perturb) or the projected derivative (jacobian)
    method: str  # "perturb" or "jacobian"


@dataclass(frozen=True)
class CausalityReport:
    """The result of :func:`check_causal`; ``str(report)`` is a readable summary."""
    T: int  # sequence length of the example
    positions: tuple[int, ...]  # the input positions that were checked
    atol: float  # dependence up to this size counts as none
    window: int | None  # the allowed window, or None for plain causality
    sink_tokens: int | None  # with the window: inputs below this stay allowed (StreamingLLM)
    prefix_len: int | None  # prefix-LM: every output may depend on the first prefix_len inputs
    dependence: dict[str, Tensor]  # method -> (T, T) float64, [i, j] = output i vs input j; NaN: unmeasured
    #   (column not in positions) or not finite
    leaks: tuple[Leak, ...]  # every forbidden pair above atol: perturb first, each method largest first
    max_leak: dict[str, float]  # method -> largest dependence on a forbidden input (below atol too)
    dead: tuple[int, ...]  # checked inputs whose change moved no output at all
    nonfinite: tuple[int, ...]  # output positions that are NaN or inf on the example itself

    @property
    def ok(self) -> bool:
        """No leak and every output finite."""
        return not self.leaks and not self.nonfinite

    @property
    def first_leak(self) -> Leak | None:
        """The leak of the earliest output, and of its nearest forbidden input."""
        return min(self.leaks, key=lambda leak: (leak.output, leak.input), default=None)

    def __str__(self) -> str:
        methods = " + ".join(self.dependence)
        rule = ", ".join(["causal"] + [f"{n}={v}" for n, v in (("window", self.window),
                                                                ("sink_tokens", self.sink_tokens),
                                                                ("prefix_len", self.prefix_len)) if v is not None])
        lines = [f"causality check ({methods}; {rule}; T={self.T}, atol={self.atol:g}): "
                 + ("ok" if self.ok else "LEAK" if self.leaks else "NON-FINITE")]
        lines.append("  max dependence on a forbidden input: "
                     + ", ".join(f"{m} {v:.3g}" for m, v in self.max_leak.items()))
        if self.leaks:
            first = self.first_leak
            lines.append(f"  first leak: output {first.output} depends on input {first.input} "
                         f"({first.method} {first.size:.3g})")
            shown = ", ".join(f"{k.output}<-{k.input} {k.size:.2g}" for k in self.leaks[:8])
            more = f", ... ({len(self.leaks)} in all)" if len(self.leaks) > 8 else ""
            lines.append(f"  leaks (output<-input size): {shown}{more}")
        if self.nonfinite:
            lines.append(f"  non-finite outputs at positions {list(self.nonfinite)} (a row that sees nothing?)")
        if self.dead:
            lines.append(f"  dead inputs (changing them moved nothing): {list(self.dead)}")
        return "\n".join(lines + self.picture())

    def picture(self) -> list[str]:
        """The T×T dependence pattern, row = output, column = input: '█' dependence on an
        allowed input, '!' a leak, '.' none, '?' not finite, ' ' column not checked."""
        if self.T > PICTURE_MAX_T:
            return [f"  (no picture for T={self.T} > {PICTURE_MAX_T})"]
        allowed = _allowed(self.T, self.window, self.sink_tokens, self.prefix_len)  # (T, T)
        deps = torch.stack(list(self.dependence.values()))  # (methods, T, T)
        moved = (deps > self.atol).any(0)  # (T, T)
        unknown = deps.isnan().any(0) & ~moved  # (T, T)
        measured = torch.zeros(self.T, dtype=torch.bool)
        measured[list(self.positions)] = True
        lines = ["  dependence (row = output, column = input; █ allowed, ! leak, . none, ? non-finite):",
                 "      " + "".join(str(j % 10) for j in range(self.T))]
        for i in range(self.T):
            row = "".join(" " if not measured[j] else "?" if unknown[i, j] else
                          ("█" if allowed[i, j] else "!") if moved[i, j] else "." for j in range(self.T))
            lines.append(f"  {i:>3} {row}")
        return lines


def check_causal(fn: Callable, example: Tensor, *, method: str = "both", positions: Iterable[int] | None = None,
                 atol: float = 0.0, window: int | None = None, sink_tokens: int | None = None,
                 prefix_len: int | None = None, embedding: nn.Module | None = None) -> CausalityReport:
    """Audit that every output of ``fn`` depends only on inputs it may see.

    fn: maps ``example`` ``(B, T, ...)`` to ``(B, T, ...)`` along dim 1: an ``nn.Module`` on
        embeddings ``(B, T, C)``, our ``GPT`` on token ids ``(B, T)``, a Hugging Face causal LM
        through :func:`hf_adapter`, or any callable. When it returns a tuple or list (our GPT
        returns ``(logits, loss)``) the first element is the output.
    example: a float tensor, or integer token ids (a changed token is another id; the
        jacobian is taken with respect to the input embedding's output).
    method: ``"perturb"``, ``"jacobian"`` or ``"both"`` (see the module docstring).
    positions: input positions to check (default: all T).
    atol: the largest change (perturb) or projected derivative (jacobian) that counts as none.
    window: also forbid inputs ``j <= i - window`` (one sliding-window attention layer);
        ``sink_tokens``: except the first ``sink_tokens`` inputs, which stay allowed.
    prefix_len: prefix-LM: also allow every output to depend on inputs ``j < prefix_len`` (a
        bidirectional prefix); anything beyond that set is still a leak.
    embedding: the input embedding of a module on token ids, when it is neither
        ``fn.get_input_embeddings()`` nor ``fn.wte``.

    A module runs in eval mode (each submodule's mode is restored afterwards); the jacobian
    runs on a float64 deep copy, so ``fn`` itself is never cast and its parameters and buffers
    never change. A plain callable (a function, a lambda around a module) runs as it is: put
    its modules in eval mode yourself; its jacobian is taken in the example's own dtype.
    """
    if not callable(fn):
        raise TypeError(f"fn must be callable, got {type(fn).__name__}")
    if method not in METHODS:
        raise ValueError(f"method must be one of {METHODS}, got {method!r}")
    _check_example(example)
    T = example.shape[1]
    positions = _check_positions(positions, T)
    if not isinstance(atol, numbers.Real) or not atol >= 0:
        raise ValueError(f"atol must be a number >= 0, got {atol!r}")
    if window is not None and (not isinstance(window, int) or isinstance(window, bool) or window <= 0):
        raise ValueError(f"window must be a positive int or None, got {window!r}")
    sink_tokens = _validate.sink_tokens(sink_tokens, window)
    if prefix_len is not None:
        _validate.prefix_len(prefix_len, 1, T, True, window, None)
    ids = not example.is_floating_point()
    emb_name = input_embedding_name(fn, embedding) if ids else None

    dependence, nonfinite = {}, set()
    if method in ("perturb", "both"):
        vocab = _vocab(fn, emb_name, example) if ids else 0
        dependence["perturb"], bad = _perturb(fn, example, positions, vocab)
        nonfinite.update(bad)
    if method in ("jacobian", "both"):
        if ids and emb_name is None:
            raise TypeError("method='jacobian' on token ids needs fn to be an nn.Module with an input embedding "
                            "(get_input_embeddings(), a .wte, or pass embedding=); or use method='perturb'")
        dependence["jacobian"], bad = _jacobian(fn, example, positions, emb_name)
        nonfinite.update(bad)
    return _report(dependence, positions, float(atol), (window, sink_tokens, prefix_len), tuple(sorted(nonfinite)))


def hf_adapter(model: nn.Module) -> nn.Module:
    """Wrap a Hugging Face causal LM as ``ids (B, T) -> logits (B, T, V)`` for :func:`check_causal`.

    Needs no import of ``transformers``: it calls ``model(input_ids=ids, use_cache=False)``
    and takes ``.logits``; the wrapper exposes the model's ``get_input_embeddings()``.
    """
    if not isinstance(model, nn.Module) or not hasattr(model, "get_input_embeddings"):
        raise TypeError(f"hf_adapter expects a Hugging Face model (an nn.Module with get_input_embeddings), "
                        f"got {type(model).__name__}")
    return _HFCausalLM(model)


class _HFCausalLM(nn.Module):
    def __init__(self, model: nn.Module):
        super().__init__()
        self.model = model

    def forward(self, ids: Tensor) -> Tensor:
        return self.model(input_ids=ids, use_cache=False).logits  # (B, T, V)

    def get_input_embeddings(self) -> nn.Module:
        return self.model.get_input_embeddings()


def input_embedding_name(fn, embedding: nn.Module | None = None) -> str | None:
    """The dotted name of the input embedding inside ``fn`` (a module): ``embedding`` itself,
    else ``fn.get_input_embeddings()``, else ``fn.wte``; None when there is none."""
    if not isinstance(fn, nn.Module):
        return None
    if embedding is None:
        getter = getattr(fn, "get_input_embeddings", None)
        embedding = getter() if callable(getter) else getattr(fn, "wte", None)
        if not isinstance(embedding, nn.Module):
            return None
    names = [name for name, m in fn.named_modules() if m is embedding]
    if not names:
        raise ValueError(f"embedding= must be a submodule of fn; {type(embedding).__name__} is not one")
    return names[0]


# --- the two methods --------------------------------------------------------------------------

def _perturb(fn: Callable, x: Tensor, positions: tuple[int, ...], vocab: int) -> tuple[Tensor, list[int]]:
    """(T, T) float64: max |change| of output i when input j alone changes (NaN: j not checked)."""
    B, T = x.shape[:2]
    gen = torch.Generator().manual_seed(0)
    scale = x.double().std().item() if x.is_floating_point() and x.numel() > 1 else 1.0
    scale = scale if math.isfinite(scale) and scale > 0 else 1.0  # noise of the example's size
    dep = torch.full((T, T), math.nan, dtype=torch.float64)
    with eval_mode(fn), torch.no_grad():
        y = _sequence(fn(x), B, T)
        for t in positions:
            x2 = x.clone()
            if vocab:  # another token id at t: add 1..vocab-1 modulo the vocabulary
                shift = torch.randint(1, vocab, x[:, t].shape, generator=gen).to(x.device)
                x2[:, t] = (x[:, t] + shift) % vocab
            else:
                noise = torch.randn(x[:, t].shape, generator=gen, dtype=torch.float64) * scale
                x2[:, t] = x[:, t] + noise.to(x.device, x.dtype)
            dep[:, t] = _per_position((_sequence(fn(x2), B, T) - y).abs())
    return dep, _nonfinite(y)


def _jacobian(fn: Callable, x: Tensor, positions: tuple[int, ...], emb_name: str | None) -> tuple[Tensor, list[int]]:
    """(T, T) float64: max over input entries at j of |u · ∂y_i/∂x_j|, u standard normal per i."""
    B, T = x.shape[:2]
    if isinstance(fn, nn.Module):
        fn = copy.deepcopy(fn).to(torch.float64).eval().requires_grad_(False)
    leaves = []
    if emb_name is not None:  # token ids: differentiate with respect to the embedding's output
        def as_leaf(module, args, out):
            leaves.append(out.detach().requires_grad_(True))
            return leaves[-1]
        handle = fn.get_submodule(emb_name).register_forward_hook(as_leaf)
        try:
            y = _sequence(fn(x), B, T)
        finally:
            handle.remove()
        if len(leaves) != 1 or leaves[0].shape[:2] != (B, T):
            raise ValueError(f"the input embedding {emb_name!r} must run once per forward on (B={B}, T={T}), "
                             f"it ran {len(leaves)} times with shapes {[tuple(e.shape) for e in leaves]}")
        leaf = leaves[0]
    else:
        leaf = x.detach().to(torch.float64 if isinstance(fn, nn.Module) else x.dtype).requires_grad_(True)
        y = _sequence(fn(leaf), B, T)
    if not y.is_floating_point():
        raise TypeError(f"method='jacobian' needs a floating-point output, got dtype {y.dtype}")
    gen = torch.Generator().manual_seed(0)
    dep = torch.zeros(T, T, dtype=torch.float64)
    for i in range(T):
        if not y.requires_grad:
            break  # the output depends on no input at all
        u = torch.randn(y[:, i].shape, generator=gen, dtype=torch.float64).to(y.device, y.dtype)
        (g,) = torch.autograd.grad(y[:, i], leaf, grad_outputs=u, retain_graph=True, allow_unused=True)
        if g is not None:
            dep[i] = _per_position(g.abs())
    unchecked = [j for j in range(T) if j not in positions]
    dep[:, unchecked] = math.nan
    return dep, _nonfinite(y.detach())


# --- the report ------------------------------------------------------------------------------

def _report(dependence: dict[str, Tensor], positions: tuple[int, ...], atol: float, rule: tuple,
            nonfinite: tuple[int, ...]) -> CausalityReport:
    T = next(iter(dependence.values())).shape[0]
    forbidden = ~_allowed(T, *rule)  # (T, T)
    leaks, max_leak = [], {}
    dead = set(positions)
    for name, dep in dependence.items():
        measured = dep.nan_to_num(nan=0.0)  # NaN (non-finite output) is reported apart, never as a leak
        outside = measured.masked_fill(~forbidden, 0.0)  # (T, T)
        max_leak[name] = outside.max().item()
        found = [Leak(i, j, outside[i, j].item(), name) for i, j in (outside > atol).nonzero().tolist()]
        leaks += sorted(found, key=lambda leak: -leak.size)
        moved = dep.nan_to_num(nan=math.inf).tril() > atol  # (T, T) output i >= j moved with input j
        dead -= {j for j in positions if moved[:, j].any()}
    return CausalityReport(T=T, positions=positions, atol=atol, window=rule[0], sink_tokens=rule[1],
                           prefix_len=rule[2], dependence=dependence,
                           leaks=tuple(leaks), max_leak=max_leak, dead=tuple(sorted(dead)), nonfinite=nonfinite)


def _allowed(T: int, window: int | None, sink_tokens: int | None = None, prefix_len: int | None = None) -> Tensor:
    """(T, T) bool, True where output i may depend on input j: the one mask predicate."""
    prefix = None if prefix_len is None else torch.tensor([prefix_len])
    return Mask(causal=True, window=window, sink_tokens=sink_tokens, prefix_len=prefix).dense(T, T)[0, 0]


# --- helpers ---------------------------------------------------------------------------------

def _check_example(example) -> None:
    if not isinstance(example, Tensor):
        raise TypeError(f"example must be a tensor, got {type(example).__name__}")
    if example.dim() < 2 or example.shape[0] == 0 or example.shape[1] == 0:
        raise ValueError(f"example must have shape (B, T, ...) with B, T >= 1, got {tuple(example.shape)}")
    if example.is_complex() or example.dtype == torch.bool:
        raise TypeError(f"example must be floating point or integer token ids, got dtype {example.dtype}")
    if not example.is_floating_point() and (example < 0).any():
        raise ValueError(f"token ids must be >= 0, got {example.min().item()}")


def _check_positions(positions, T: int) -> tuple[int, ...]:
    if positions is None:
        return tuple(range(T))
    positions = list(positions)
    bad = [p for p in positions if not isinstance(p, int) or isinstance(p, bool) or not 0 <= p < T]
    if bad or not positions:
        raise ValueError(f"positions must be ints in [0, T={T}), got {positions if not bad else bad}")
    return tuple(sorted(set(positions)))


def _sequence(out, B: int, T: int) -> Tensor:
    """The output tensor of ``fn``: the first element of a tuple, shaped (B, T, ...)."""
    if isinstance(out, (tuple, list)) and out:
        out = out[0]
    if not isinstance(out, Tensor):
        raise TypeError(f"fn must return a tensor (or a tuple whose first element is one), got {type(out).__name__}")
    if out.dim() < 2 or out.shape[:2] != (B, T):
        raise ValueError(f"fn must map a sequence to a same-length sequence along dim 1: input (B={B}, T={T}, ...), "
                         f"output {tuple(out.shape)}")
    return out


def _per_position(d: Tensor) -> Tensor:
    """(B, T, ...) -> (T,) float64: the max over everything but the position (NaN propagates)."""
    T = d.shape[1]
    return d.transpose(0, 1).reshape(T, -1).double().amax(dim=1).cpu()  # (T,)


def _nonfinite(y: Tensor) -> list[int]:
    T = y.shape[1]
    return (~y.isfinite()).transpose(0, 1).reshape(T, -1).any(dim=1).nonzero().flatten().tolist()


def _vocab(fn, emb_name: str | None, example: Tensor) -> int:
    """How many token ids a changed token may take: the embedding's rows, else the example's range."""
    emb = fn.get_submodule(emb_name) if emb_name is not None else None
    vocab = getattr(emb, "num_embeddings", None) or int(example.max().item()) + 1
    if vocab < 2:
        raise ValueError(f"cannot change a token with a vocabulary of {vocab}; pass embedding= or other ids")
    return vocab


@contextlib.contextmanager
def eval_mode(fn):
    """Eval mode for a module and all its submodules, each one's own mode restored after."""
    if not isinstance(fn, nn.Module):
        yield
        return
    modes = [(m, m.training) for m in fn.modules()]
    fn.eval()
    try:
        yield
    finally:
        for m, training in modes:
            m.training = training
