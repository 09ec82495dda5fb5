"""Audit causality: every attention backend × option, a tiny GPT and its KV cache, or your module.

One line per case: its name, the method, ok or LEAK, the largest dependence of an output on
an input it must not see (perturbation | float64 jacobian; 0 means none at all), the inputs
whose change moved nothing, and the time. A failing case prints its full report (with the
T×T dependence picture) below its line. The exit status is 1 when any case fails.

``--module pkg.mod:factory`` imports ``factory``, calls it with no arguments and audits the
module it returns on a random input of ``--shape``: token ids when it has an input embedding
(``get_input_embeddings()`` or ``.wte``), else embeddings. ``--ckpt PATH`` audits a trained
model: a run folder, a checkpoint file, a transformers folder or a GGUF file, as ``selfattn sample``
takes, on ``--device`` in ``--dtype``. The built-in audits run on ``--device`` too (the backends that
cannot run there are listed as skipped), each in the dtypes it is written for.
"""
from __future__ import annotations

import argparse
import time

import torch

from selfattn._util import validate as _validate
from selfattn.audit import suite
from selfattn.audit.cache import CacheReport
from selfattn.audit.causality import METHODS, CausalityReport
from selfattn.cli import flags

SEQ_LEN = 16  # T of every audit unless --seq-len says otherwise (or a --ckpt model's window needs more)
WINDOW_MAX = 512  # a --ckpt model's windows up to this raise the default T past them
EXAMPLE = "selfattn check --ckpt runs/tiny --dtype bfloat16"


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--method", choices=METHODS, default="both", help="perturbation, float64 jacobian, or both")
    p.add_argument("--atol", type=float, default=0.0, help="dependence up to this size counts as none")
    p.add_argument("--seq-len", type=int, default=None,
                   help=f"sequence length T of every audit; unset: {SEQ_LEN}, or for --ckpt past the model's smallest "
                        f"window (up to {WINDOW_MAX}), at most its block_size")
    flags.add_model(p, required=False, purpose="audit only this model")
    p.add_argument("--module", metavar="PKG.MOD:FACTORY", default=None,
                   help="audit only the module returned by this factory (called with no arguments)")
    p.add_argument("--shape", default=None,
                   help="for --module: B,T,C for embeddings or B,T for token ids; unset: B=2, T=--seq-len, "
                        "C from the module's first Linear or LayerNorm")
    p.add_argument("--window", type=int, default=None,
                   help="for --module: also forbid inputs WINDOW or more positions back (one sliding-window layer)")
    flags.add_seed(p, "torch.manual_seed before building modules and inputs")


def main(args: argparse.Namespace) -> int:
    if args.seq_len is not None and args.seq_len < 2:
        raise ValueError(f"--seq-len must be at least 2, got {args.seq_len}")
    seq_len = SEQ_LEN if args.seq_len is None else args.seq_len
    if args.ckpt and args.module:
        raise ValueError("pass --ckpt or --module, not both")
    if args.base is not None and not args.ckpt:
        raise ValueError("--base is the base model of a LoRA run given by --ckpt; give --ckpt")
    if not args.ckpt and args.dtype != "float32":
        raise ValueError(f"--dtype {args.dtype} is the dtype of --ckpt's model; the built-in audits run in the "
                         f"dtypes each is written for, and --module's module in its own")
    device = _validate.device(args.device)
    torch.manual_seed(args.seed)
    audit = dict(method=args.method, atol=args.atol)
    skipped = {}
    if args.ckpt:
        from selfattn.io.loading import load

        model = load(args.ckpt, **flags.base_of(args)).model.to(device, flags.dtype(args))
        if args.seq_len is None:  # long enough to tell the smallest window from causality, where that is cheap
            windows = [b.attn.window for b in model.blocks if b.attn.window is not None and b.attn.window < WINDOW_MAX]
            seq_len = min(max([seq_len] + [w + SEQ_LEN // 4 for w in windows]), model.config.block_size)
        cases = suite.model_cases(args.ckpt, model, seq_len, audit)  # a --seq-len beyond block_size is refused
    elif args.module:
        cases = [suite.module_case(args.module, audit, _parse_shape(args.shape, seq_len), args.window)]
    else:
        skipped = suite.skipped(device)
        cases = list(suite.builtin_cases(seq_len, audit, device))
    print(f"selfattn check: method={args.method}, atol={args.atol:g}, seed={args.seed}")
    print(f"{'case':<30} {'method':<9} {'result':<9} {'leak (per | jac)':<17} {'dead':<8} time")
    failed = 0
    skipped |= {case.name: case.refused for case in cases if case.refused}
    cases = [case for case in cases if not case.refused]
    for case in cases:
        start = time.perf_counter()
        report = case.run()
        ms = (time.perf_counter() - start) * 1e3
        print(_line(case.name, report, ms), flush=True)
        if not report.ok:
            failed += 1
            print("\n".join("    " + line for line in str(report).splitlines()), flush=True)
    for name, why in skipped.items():
        print(f"{name:<30} skipped: {why}")
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


def _parse_shape(text: str | None, T: int) -> tuple[int, ...]:
    if text is None:
        return (2, T)
    try:
        shape = tuple(int(s) for s in text.split(","))
    except ValueError:
        shape = ()
    if len(shape) not in (2, 3) or any(s <= 0 for s in shape):
        raise ValueError(f"--shape must be B,T or B,T,C positive ints, got {text!r}")
    return shape
