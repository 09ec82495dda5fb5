"""Why scores are scaled by 1/sqrt(head_dim): the softmax at initialisation under three scalings.

See :mod:`selfattn.analysis.scaling` for what is measured.
"""
from __future__ import annotations

import argparse

from selfattn.analysis.scaling import report, study
from selfattn.cli import flags

EXAMPLE = "selfattn scaling --widths 64,1024 --seq-len 64"


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--widths", default="64,256,1024,4096", help="comma-separated model widths C")
    p.add_argument("--head-dim", type=int, default=64, help="head size D, fixed (H = C / D heads)")
    p.add_argument("--seq-len", type=int, default=128, help="keys per query T")
    flags.add_seed(p, "seed for q, k, v and the upstream gradient")


def main(args: argparse.Namespace) -> int:
    try:
        widths = [int(w) for w in args.widths.split(",")]
    except ValueError:
        raise ValueError(f"--widths must be comma-separated integers, got {args.widths!r}") from None
    print(report(study(widths, args.head_dim, seq_len=args.seq_len, seed=args.seed), args.seq_len))
    return 0
