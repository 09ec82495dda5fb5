"""Audit causality: every attention backend × option, a tiny GPT and its KV cache, or your module.

One line per case: its name, the method, ok or LEAK, the largest dependence of an output on
an input it must not see (perturbation | float64 jacobian; 0 means none at all), the inputs
whose change moved nothing, and the time. A failing case prints its full report (with the
T×T dependence picture) below its line. The exit status is 1 when any case fails.

``--module pkg.mod:factory`` imports ``factory``, calls it with no arguments and audits the
module it returns on a random input of ``--shape``: token ids when it has an input embedding
(``get_input_embeddings()`` or ``.wte``), else embeddings. ``--ckpt RUN`` audits a trained GPT.
"""
from __future__ import annotations

import argparse
import importlib
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import NamedTuple

import torch
from torch import Tensor, nn

from selfattn import backends
from selfattn.attention import SelfAttention
from selfattn.causality import (METHODS, CacheReport, CausalityReport, check_cache, check_causal,
                                input_embedding_name)

OPTIONS = {  # case name -> SelfAttention keywords; "padding" and "documents" add forward keywords
    "plain": {},
    "gqa": {"n_kv_head": 2},
    "mqa": {"n_kv_head": 1},
    "window": {"window": 4},
    "rope": {"rope": True},
    "gqa+rope+window": {"n_kv_head": 2, "rope": True, "window": 4},
    "padding": {},
    "documents": {},
}


class Case(NamedTuple):
    name: str
    run: Callable[[], CausalityReport | CacheReport]


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--method", choices=METHODS, default="both", help="perturbation, float64 jacobian, or both")
    p.add_argument("--atol", type=float, default=0.0, help="dependence up to this size counts as none")
    p.add_argument("--seq-len", type=int, default=16, help="sequence length T of every audit")
    p.add_argument("--ckpt", metavar="RUN", default=None,
                   help="audit only a trained GPT: a run folder (its newest checkpoint) or a checkpoint file")
    p.add_argument("--module", metavar="PKG.MOD:FACTORY", default=None,
                   help="audit only the module returned by this factory (called with no arguments)")
    p.add_argument("--shape", default=None,
                   help="for --module: B,T,C for embeddings or B,T for token ids; unset: B=2, T=--seq-len, "
                        "C from the module's first Linear or LayerNorm")
    p.add_argument("--window", type=int, default=None,
                   help="for --module: also forbid inputs WINDOW or more positions back (one sliding-window layer)")
    p.add_argument("--seed", type=int, default=0, help="torch.manual_seed before building modules and inputs")


def main(args: argparse.Namespace) -> int:
    if args.seq_len < 2:
        raise ValueError(f"--seq-len must be at least 2, got {args.seq_len}")
    torch.manual_seed(args.seed)
    if args.ckpt and args.module:
        raise ValueError("pass --ckpt or --module, not both")
    audit = dict(method=args.method, atol=args.atol)
    if args.ckpt:
        cases = _model_cases(args.ckpt, _load_checkpoint(args.ckpt), args.seq_len, audit)
    elif args.module:
        cases = [_module_case(args, audit)]
    else:
        cases = list(_builtin_cases(args.seq_len, audit))
    print(f"selfattn check: method={args.method}, atol={args.atol:g}, seed={args.seed}")
    print(f"{'case':<30} {'method':<9} {'result':<9} {'leak (per | jac)':<17} {'dead':<8} time")
    failed = 0
    for case in cases:
        start = time.perf_counter()
        report = case.run()
        ms = (time.perf_counter() - start) * 1e3
        print(_line(case.name, report, ms), flush=True)
        if not report.ok:
            failed += 1
            print("\n".join("    " + line for line in str(report).splitlines()), flush=True)
    if not args.module and not args.ckpt and not torch.cuda.is_available():
        print(f"{'triton':<30} skipped: needs a CUDA device")
    print(f"{len(cases) - failed} of {len(cases)} cases ok" + (f", {failed} FAILED" if failed else ""))
    return 1 if failed else 0


def _line(name: str, report: CausalityReport | CacheReport, ms: float) -> str:
    if isinstance(report, CacheReport):
        result = "ok" if report.ok else "DIVERGES"
        leak = f"{report.errors.max().item():.2g} rel"
        method, dead = "cache", "-"
    else:
        result = "ok" if report.ok else "LEAK" if report.leaks else "NON-FINITE"
        leak = " | ".join(f"{v:.2g}" for v in report.max_leak.values())
        names = list(report.dependence)
        method = "+".join(m[:3] for m in names) if len(names) > 1 else names[0]
        dead = ",".join(map(str, report.dead)) or "-"
    return f"{name:<30} {method:<9} {result:<9} {leak:<17} {dead:<8} {ms:6.0f} ms"


def _causal(name: str, fn: Callable, example: Tensor, audit: dict, window: int | None = None) -> Case:
    return Case(name, lambda: check_causal(fn, example, window=window, **audit))


def _builtin_cases(T: int, audit: dict, B: int = 2, C: int = 32, H: int = 4) -> Iterator[Case]:
    """Every CPU backend × option of SelfAttention, then a tiny GPT: its causality and its cache."""
    x = torch.randn(B, T, C)
    pad = torch.ones(B, T, dtype=torch.bool)
    pad[:, :2] = False  # two left-padding positions in every row: they must be dead
    docs = (torch.arange(T) >= T // 3).long().expand(B, T)  # (B, T) two packed documents
    extra = {"padding": {"key_padding_mask": pad}, "documents": {"doc_ids": docs}}
    for backend in (name for name in backends.NAMES if name != "triton"):  # the ones that run on a CPU
        for option, kwargs in OPTIONS.items():
            attn = SelfAttention(C, H, backend=backend, **kwargs)
            fn = _With(attn, **extra[option]) if option in extra else attn
            yield _causal(f"{backend} {option}", fn, x, audit, kwargs.get("window"))
    from selfattn.model import GPT, GPTConfig
    for name, kwargs in (("gpt", {}), ("gpt rope+gqa+window", {"pos": "rope", "n_kv_head": 2, "window": 4})):
        gpt = GPT(GPTConfig(vocab_size=64, block_size=max(64, T), n_layer=2, n_head=H, n_embd=C, **kwargs))
        yield from _model_cases(name, gpt, T, audit)


def _model_cases(name: str, gpt, T: int, audit: dict, B: int = 2) -> list[Case]:
    """A GPT's causality on random token ids, and its KV cache: a prompt of T // 2 tokens, the rest new."""
    T = min(T, gpt.config.block_size)
    ids = torch.randint(0, gpt.config.vocab_size, (B, T))
    return [_causal(name, gpt, ids, audit),
            Case(f"{name} kv-cache", lambda: check_cache(gpt, ids[:, :T // 2], T - T // 2))]


def _load_checkpoint(run: str):
    """The GPT of a checkpoint file, or of the newest checkpoint in a run folder."""
    from selfattn import checkpoint
    from selfattn.model import GPT, GPTConfig
    path = checkpoint.latest(run) if Path(run).is_dir() else Path(run)
    if path is None:
        raise ValueError(f"--ckpt: no checkpoint (ckpt-*.safetensors) in {run!r}")
    meta = checkpoint.load(path)
    model = GPT(GPTConfig(**meta["model"]))
    checkpoint.load(path, model)
    return model


class _With(nn.Module):
    """A module called with fixed keyword arguments (a padding mask, document ids)."""

    def __init__(self, module: nn.Module, **kwargs):
        super().__init__()
        self.module, self.kwargs = module, kwargs

    def forward(self, x: Tensor) -> Tensor:
        return self.module(x, **self.kwargs)


def _module_case(args: argparse.Namespace, audit: dict) -> Case:
    module = _load_factory(args.module)()
    if not callable(module):
        raise TypeError(f"{args.module} returned {type(module).__name__}, not a module or callable")
    emb = input_embedding_name(module)
    shape = _parse_shape(args.shape, args.seq_len, 2 if emb is not None else 3)
    if emb is not None:
        vocab = module.get_submodule(emb).num_embeddings
        example = torch.randint(0, vocab, shape)
    else:
        if len(shape) == 2:
            shape = (*shape, _infer_width(module, args.module))
        example = torch.randn(shape)
    return _causal(args.module, module, example, audit, args.window)


def _load_factory(spec: str) -> Callable:
    mod_name, sep, attr = spec.partition(":")
    if not sep or not mod_name or not attr:
        raise ValueError(f"--module must look like pkg.mod:factory, got {spec!r}")
    try:
        mod = importlib.import_module(mod_name)
    except ImportError as e:
        raise ValueError(f"--module: cannot import {mod_name!r}: {e}") from e
    factory = getattr(mod, attr, None)
    if not callable(factory):
        raise ValueError(f"--module: {mod_name!r} has no callable {attr!r}")
    return factory


def _parse_shape(text: str | None, T: int, dims: int) -> tuple[int, ...]:
    if text is None:
        return (2, T)
    try:
        shape = tuple(int(s) for s in text.split(","))
    except ValueError:
        shape = ()
    if len(shape) not in (2, dims) or any(s <= 0 for s in shape):
        raise ValueError(f"--shape must be {'B,T' if dims == 2 else 'B,T,C'} positive ints, got {text!r}")
    return shape


def _infer_width(module, spec: str) -> int:
    """C from the module's first Linear (in_features) or LayerNorm (normalized_shape)."""
    for m in module.modules() if isinstance(module, nn.Module) else ():
        if isinstance(m, nn.Linear):
            return m.in_features
        if isinstance(m, nn.LayerNorm):
            return m.normalized_shape[-1]
    raise ValueError(f"cannot infer the width C of {spec}; pass --shape B,T,C")
