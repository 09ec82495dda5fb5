"""Hooks and caches on the model's sites, with TransformerLens's names and shapes.

Every forward of a :class:`~selfattn.model.GPT` passes through named sites (``hook_embed``,
``blocks.3.attn.hook_z``, ...: ``docs/interp.md`` has the table); :func:`sites` lists a model's.
:func:`hooks` runs code with functions on some of them, :func:`run_with_cache` keeps what they
hold. Both work through the model's one generic hook point, :attr:`~selfattn.model.GPT.tap`
(:mod:`selfattn.taps`): without hooks the model runs its own code and fast paths untouched.

A forward hook is ``fn(tensor, name)`` returning a replacement or None (keep it); a backward hook
``fn(grad, name)`` likewise, on the gradient arriving at the site. Names are matched exactly, or
by a predicate ``name -> bool`` in their place.
"""
from __future__ import annotations

import contextlib
import difflib
import weakref
from collections.abc import Callable, Iterable, Iterator, Mapping

import torch
from torch import Tensor

Hook = Callable[[Tensor, str], "Tensor | None"]
Names = "str | Iterable[str] | Callable[[str], bool] | None"


def _gpt(model):
    from selfattn.model import GPT

    if not isinstance(model, GPT):
        raise TypeError(f"expected a selfattn.model.GPT (loading.load(...).model), got {type(model).__name__}")
    return model


class _Recorder:
    """A tap that asks for every site and notes the names it sees, in order."""

    def __init__(self):
        self.names: list[str] = []

    def __call__(self, name: str, x: Tensor) -> Tensor:
        self.names.append(name)
        return x

    def asks(self, name: str) -> bool:
        return True


# model -> (what its sites follow from, its sites): a model's sites are listed by one forward, once
_listed: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def sites(model) -> list[str]:
    """Every site name of ``model``, in the order a forward reaches them (one token, run once for a model
    until its config or its modules change)."""
    model = _gpt(model)
    shape = (repr(model.config), tuple(type(m) for m in model.modules()))  # what the sites follow from
    known = _listed.get(model)
    if known is None or known[0] != shape:
        recorder = _Recorder()
        with _installed(model, recorder), torch.no_grad():
            model(torch.zeros(1, 1, dtype=torch.long, device=model.wte.weight.device))
        known = _listed[model] = (shape, recorder.names)
    return list(known[1])


@contextlib.contextmanager
def _installed(model, tap) -> Iterator[None]:
    """``model.tap = tap`` for the block, the one before restored after it."""
    before, model.tap = model.tap, tap
    try:
        yield
    finally:
        model.tap = before


def _check_names(model, names: Iterable[str]) -> None:
    """ValueError naming each unknown site and the nearest real ones (no names: nothing run)."""
    names = list(names)
    if not names:
        return
    known = sites(model)
    unknown = [n for n in names if n not in set(known)]
    if unknown:
        hints = "; ".join(f"{n!r}: nearest {difflib.get_close_matches(n, known, n=3, cutoff=0.4) or 'none'}"
                          for n in unknown)
        raise ValueError(f"no site of this model is called {hints} (selfattn.interp.sites(model) lists them)")


def _matcher(key, what: str) -> Callable[[str], bool]:
    if isinstance(key, str):
        return key.__eq__
    if callable(key):
        return key
    raise TypeError(f"a {what} is keyed by a site name or a predicate name -> bool, got {type(key).__name__}")


def _entries(model, hooks_, what: str) -> list[tuple[Callable[[str], bool], Hook]]:
    """(match, fn) pairs from a mapping or pairs of name-or-predicate -> fn; exact names checked."""
    if hooks_ is None:
        return []
    pairs = list(hooks_.items() if isinstance(hooks_, Mapping) else hooks_)
    for pair in pairs:
        if not (isinstance(pair, tuple) and len(pair) == 2 and callable(pair[1])):
            raise TypeError(f"{what}s must map a site name (or predicate) to a function fn(tensor, name), got "
                            f"{pair!r}")
    _check_names(model, [k for k, _ in pairs if isinstance(k, str)])
    return [(_matcher(k, what), fn) for k, fn in pairs]


def _version(x: Tensor) -> int | None:
    """How many times ``x`` was changed in place (None for inference tensors, which do not count)."""
    return None if x.is_inference() else x._version


class _Hooks:
    """The tap of :func:`hooks`: forward functions (replacements flow on), then backward ones
    registered on the tensor that flows on; it wraps an outer tap, which sees each site first."""

    def __init__(self, fwd, bwd, outer, keep: Callable[[str], bool] | None = None):
        self.fwd, self.bwd, self.outer, self.keep = fwd, bwd, outer, keep

    def asks(self, name: str) -> bool:
        return (any(m(name) for m, _ in self.fwd + self.bwd) or (self.keep is not None and self.keep(name))
                or (self.outer is not None and self.outer.asks(name)))

    def __call__(self, name: str, x: Tensor) -> Tensor:
        if self.outer is not None:
            x = self.outer(name, x)
        for match, fn in self.fwd:
            if match(name):
                version = _version(x)
                out = fn(x, name)
                if out is not None and not isinstance(out, Tensor):
                    raise TypeError(f"the hook on {name} returned {type(out).__name__}, not a tensor or None")
                if out is not None and out.shape != x.shape:
                    raise ValueError(f"the hook on {name} returned shape {tuple(out.shape)}, the site holds "
                                     f"{tuple(x.shape)}")
                # changed in place: a new tensor object, so that the model takes it (see selfattn.taps)
                x = out if out is not None else x.view_as(x) if _version(x) != version else x
        wanted = [fn for match, fn in self.bwd if match(name)]
        if wanted and x.requires_grad:
            x = x.view_as(x)  # a tensor of its own, on the path the gradient takes
            for fn in wanted:
                x.register_hook(lambda grad, fn=fn: fn(grad, name))
        return x


@contextlib.contextmanager
def hooks(model, fwd=None, *, bwd=None) -> Iterator[None]:
    """Run the block with hooks on ``model``'s sites; they go when it ends.

    fwd: ``{name: fn}`` or ``[(name, fn), ...]``, a name or a predicate ``name -> bool``;
        ``fn(tensor, name)`` returns a replacement (same shape) or None. A site changed in place
        counts as replaced.
    bwd: the same for gradients: ``fn(grad, name)`` on the gradient at the site, returning a
        replacement or None.
    A hooked forward runs eagerly (the model's own code, no fused paths it cannot show); a site
    name that does not exist is a ValueError naming the nearest real ones. Hooks nest.
    """
    model = _gpt(model)
    with _installed(model, _Hooks(_entries(model, fwd, "forward hook"), _entries(model, bwd, "backward hook"),
                                  model.tap)):
        yield


def _keep(names) -> tuple[Callable[[str], bool], list[str]]:
    """What ``run_with_cache`` keeps: (a predicate on site names, the exact names asked for)."""
    if names is None:
        return (lambda name: True), []
    if callable(names):
        return names, []
    names = [names] if isinstance(names, str) else list(names)
    if not all(isinstance(n, str) for n in names):
        raise TypeError(f"names must be a site name, a list of them or a predicate name -> bool, got {names!r}")
    return set(names).__contains__, names


def run_with_cache(model, idx: Tensor, names=None, *, device=None, dtype: torch.dtype | None = None,
                   fwd=None, **forward) -> tuple[Tensor, dict[str, Tensor]]:
    """The logits ``(B, T, V)`` of ``model(idx, **forward)`` and a dict of the sites' tensors.

    names: which sites to keep: None (every one, each head's ``hook_result`` included), a name,
        a list of names, or a predicate ``name -> bool``; only these are kept (and the costly ones,
        like ``hook_result`` and the attention pattern, computed only when kept).
    device, dtype: where and in what to keep them (default: as computed), detached.
    fwd: forward hooks to run as well (as :func:`hooks`); the cache holds what flowed on.
    """
    model = _gpt(model)
    keep, asked = _keep(names)
    if device is not None:
        device = torch.device(device)
    if dtype is not None and not isinstance(dtype, torch.dtype):
        raise TypeError(f"dtype must be a torch.dtype, got {dtype!r}")
    cache: dict[str, Tensor] = {}

    def store(x: Tensor, name: str) -> None:
        cache[name] = x.detach().to(device=device, dtype=dtype)

    with hooks(model, fwd), _installed(model, _Hooks([(keep, store)], [], model.tap, keep)):
        logits, _ = model(idx, **forward)
    # a name asked for and not met is checked after the forward, so a right one costs no second forward
    _check_names(model, [n for n in asked if n not in cache])
    return logits, cache
