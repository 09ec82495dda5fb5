"""The seed's worked example, computed live: shape walk, parameter count, causality test.

With the defaults it reproduces the seed document: 256 parameters, max change 0.0 at
positions 0-1 and 0.3175 at positions 2-3 (:mod:`selfattn.analysis.worked_example`).
"""
from __future__ import annotations

import argparse

from selfattn.analysis.worked_example import worked_example
from selfattn.cli import flags

EXAMPLE = "selfattn demo --seq-len 6 --window 3"


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--n-embd", type=int, default=8, help="model width C")
    p.add_argument("--n-head", type=int, default=2, help="number of query heads H (head_dim D = C / H)")
    p.add_argument("--seq-len", type=int, default=4, help="sequence length T")
    flags.add_seed(p, "torch.manual_seed before building the module and input")
    p.add_argument("--position", type=int, default=2, help="the position whose input is changed")
    p.add_argument("--n-kv-head", type=int, default=None, help="key/value heads for GQA (default: H)")
    p.add_argument("--window", type=int, default=None, help="sliding window: each query sees this many recent keys")
    p.add_argument("--head", type=int, default=0, help="which head's attention weights to print")


def main(args: argparse.Namespace) -> int:
    print(worked_example(n_embd=args.n_embd, n_head=args.n_head, seq_len=args.seq_len, seed=args.seed,
                         position=args.position, n_kv_head=args.n_kv_head, window=args.window, head=args.head))
    return 0
