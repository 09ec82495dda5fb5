"""The audits ``selfattn check`` runs: every backend × option of ``SelfAttention``, a GPT and
its KV cache, or a module a user's factory builds.

Each audit is a :class:`Case`, a name and a function returning its report, so a caller
decides how to run and show them. Backends are asked whether they run on the device
(:func:`selfattn.backends.availability`); one that cannot is listed in :func:`skipped` with
its reason instead of being audited. A backend that refuses float64 (the jacobian's dtype)
is audited by perturbation only.
"""
from __future__ import annotations

import importlib
from collections.abc import Callable, Iterator
from typing import NamedTuple

import torch
from torch import Tensor, nn

from selfattn import backends
from selfattn._util.validate import one_line
from selfattn.audit.cache import CacheReport, check_cache
from selfattn.audit.causality import CausalityReport, check_causal, input_embedding_name
from selfattn.config import GPTConfig
from selfattn.masks import Mask
from selfattn.model import GPT
from selfattn.self_attention import SelfAttention


def dilated(b, h, q_idx, kv_idx):
    """A mask_mod for the audit: every other key, and always the query's own position."""
    return ((q_idx - kv_idx) % 2 == 0) | (h == 0)


OPTIONS = {  # case name -> SelfAttention keywords; "padding", "documents", "prefix" add forward keywords
    "plain": {},
    "gqa": {"n_kv_head": 2},
    "mqa": {"n_kv_head": 1},
    "window": {"window": 4},
    "rope": {"rope": True},
    "gqa+rope+window": {"n_kv_head": 2, "rope": True, "window": 4},
    "padding": {},
    "documents": {},
    "window+sink-tokens": {"window": 4, "sink_tokens": 2},
    "prefix": {},
    "alibi": {"alibi": True},
    "softcap": {"softcap": 2.0},
    "sinks": {"sinks": True},
    "mask_mod": {"mask_mod": dilated},
}
PREFIX = 5  # the prefix of the "prefix" case: positions 0..4 attend to each other


class Case(NamedTuple):
    name: str
    run: Callable[[], CausalityReport | CacheReport]
    refused: str | None = None  # why the backend cannot serve this case (then it is not run)


def skipped(device: torch.device) -> dict[str, str]:
    """{backend: why it cannot run on ``device`` here} for the backends the built-in audit leaves out."""
    return {name: why for name in backends.NAMES if (why := backends.availability(name, device))}


def builtin_cases(T: int, audit: dict, device: torch.device, B: int = 2, C: int = 32, H: int = 4) -> Iterator[Case]:
    """Every available backend × option of SelfAttention, then a tiny GPT: its causality and its cache."""
    x = torch.randn(B, T, C).to(device)
    pad = torch.ones(B, T, dtype=torch.bool, device=device)
    pad[:, :2] = False  # two left-padding positions in every row: they must be dead
    docs = (torch.arange(T, device=device) >= T // 3).long().expand(B, T)  # (B, T) two packed documents
    extra = {"padding": {"key_padding_mask": pad}, "documents": {"doc_ids": docs}, "prefix": {"prefix_len": PREFIX}}
    for backend in (name for name in backends.NAMES if name not in skipped(device)):
        method = audit["method"]
        if method != "perturb" and _refuses_float64(backend, device, C // H):
            method = "perturb"  # the jacobian runs in float64
        for option, kwargs in OPTIONS.items():
            attn = SelfAttention(C, H, backend=backend, **kwargs).to(device)
            fn = _With(attn, **extra[option]) if option in extra else attn
            rule = dict(window=kwargs.get("window"), sink_tokens=kwargs.get("sink_tokens"),
                        prefix_len=PREFIX if option == "prefix" else None)
            refused = _refusal(fn, x)
            case = _causal(f"{backend} {option}", fn, x, {**audit, "method": method}, **rule)
            yield case._replace(refused=refused) if refused else case
    for name, kwargs in (("gpt", {}), ("gpt rope+gqa+window", {"pos": "rope", "n_kv_head": 2, "window": 4})):
        gpt = GPT(GPTConfig(vocab_size=64, block_size=max(64, T), n_layer=2, n_head=H, n_embd=C, **kwargs))
        yield from model_cases(name, gpt, T, audit)


def model_cases(name: str, gpt: GPT, T: int, audit: dict, B: int = 2) -> list[Case]:
    """A GPT's causality on random token ids; for each window its config says layers slide over,
    the first such layer's attention against that window's rule (on random embeddings); its KV caches
    (rolling for windowed layers): a prompt of T // 2 tokens, the rest new. A window of T or
    more cannot be told from causality at T: its case is refused, naming the --seq-len it needs.
    The inputs are drawn on the CPU and moved to the model's device, in its dtype."""
    if T > gpt.config.block_size:
        raise ValueError(f"--seq-len {T} is more than {name}'s block_size={gpt.config.block_size}; pass "
                         f"--seq-len {gpt.config.block_size} or less")
    device = next(gpt.parameters()).device
    ids = torch.randint(0, gpt.config.vocab_size, (B, T)).to(device)
    cases = [_causal(name, gpt, ids, audit)]
    first = {}  # window -> the first layer sliding over it
    for i in range(gpt.config.n_layer):
        first.setdefault(gpt.config.layer_window(i), i)
    for window, i in sorted((w, i) for w, i in first.items() if w is not None):
        attn, case = gpt.blocks[i].attn, f"{name} layer {i} window={window}"
        if window >= T:
            cases.append(Case(case, lambda: None, f"window {window} >= --seq-len {T}: pass --seq-len {window + 1} "
                                                  f"or more to audit it"))
            continue
        x = torch.randn(B, T, attn.n_embd).to(device, attn.qkv.weight.dtype)  # (B, T, C)
        cases.append(_causal(case, attn, x, audit, window=window, sink_tokens=attn.sink_tokens))
    return cases + [Case(f"{name} kv-cache", lambda: check_cache(gpt, ids[:, :T // 2], T - T // 2))]


def module_case(spec: str, audit: dict, shape: tuple[int, ...], window: int | None = None) -> Case:
    """The module ``factory()`` returns, for ``spec`` ``"pkg.mod:factory"``, on a random input
    of ``shape``: token ids ``(B, T)`` when it has an input embedding, else embeddings
    ``(B, T, C)`` (C from its first Linear or LayerNorm when ``shape`` is ``(B, T)``)."""
    factory = load_factory(spec)
    try:
        module = factory()
    except Exception as e:
        raise ValueError(f"--module: the factory {spec}() raised {type(e).__name__}: {one_line(e)}") from e
    if not callable(module):
        raise TypeError(f"{spec} returned {type(module).__name__}, not a module or callable")
    emb = input_embedding_name(module)
    if emb is not None:
        if len(shape) != 2:
            raise ValueError(f"{spec} takes token ids: its input shape is B,T, got {','.join(map(str, shape))}")
        example = torch.randint(0, module.get_submodule(emb).num_embeddings, shape)
    else:
        example = torch.randn(shape if len(shape) == 3 else (*shape, _infer_width(module, spec)))

    def run() -> CausalityReport:
        try:
            return check_causal(module, example, window=window, **audit)
        except Exception as e:
            raise ValueError(f"--module: the module {spec}() built raised {type(e).__name__} on an input of shape "
                             f"{tuple(example.shape)}: {one_line(e)}") from e
    return Case(spec, run)


def load_factory(spec: str) -> Callable:
    """The callable ``factory`` of ``"pkg.mod:factory"``, imported."""
    mod_name, sep, attr = spec.partition(":")
    if not sep or not mod_name or not attr:
        raise ValueError(f"--module must look like pkg.mod:factory, got {spec!r}")
    try:
        mod = importlib.import_module(mod_name)
    except Exception as e:  # ImportError, or whatever the module raises while it is imported
        raise ValueError(f"--module: cannot import {mod_name!r}: {type(e).__name__}: {one_line(e)}") from e
    factory = getattr(mod, attr, None)
    if not callable(factory):
        raise ValueError(f"--module: {mod_name!r} has no callable {attr!r}")
    return factory


def _causal(name: str, fn: Callable, example: Tensor, audit: dict, window: int | None = None, **rule) -> Case:
    return Case(name, lambda: check_causal(fn, example, window=window, **rule, **audit))


def _refusal(fn: Callable, x: Tensor) -> str | None:
    """Why the module's backend refuses this case (asked by one forward without gradients), or None."""
    try:
        with torch.no_grad():
            fn(x)
    except ValueError as e:
        if "cannot serve this request" not in str(e):
            raise
        return str(e).split(": ", 1)[1]
    return None


def _refuses_float64(backend: str, device: torch.device, head_dim: int) -> bool:
    probe = torch.zeros(1, 1, 1, head_dim, dtype=torch.float64, device=device)  # (B, H, T, D)
    return backends.load(backend).unsupported(probe, probe, probe, Mask(), 0.0) is not None


class _With(nn.Module):
    """A module called with fixed keyword arguments (a padding mask, document ids)."""

    def __init__(self, module: nn.Module, **kwargs):
        super().__init__()
        self.module, self.kwargs = module, kwargs

    def forward(self, x: Tensor) -> Tensor:
        return self.module(x, **self.kwargs)


def _infer_width(module, spec: str) -> int:
    """C from the module's first Linear (in_features) or LayerNorm (normalized_shape)."""
    for m in module.modules() if isinstance(module, nn.Module) else ():
        if isinstance(m, nn.Linear):
            return m.in_features
        if isinstance(m, nn.LayerNorm):
            return m.normalized_shape[-1]
    raise ValueError(f"cannot infer the width C of {spec}; pass --shape B,T,C")
