"""Train a two-layer attention-only GPT until induction heads form: 4 heads vs 1 of the same width.

See :mod:`selfattn.analysis.induction` for the data, the probe and what is measured.
"""
from __future__ import annotations

import argparse
from pathlib import Path

from selfattn.analysis.induction import InductionConfig, report, run, save_outputs
from selfattn.cli import flags

EXAMPLE = "selfattn induction --out out/induction"


def add_arguments(p: argparse.ArgumentParser) -> None:
    flags.add_flags(p, InductionConfig)
    p.add_argument("--out", default="out/induction", metavar="FOLDER",
                   help="folder to write curve.png, key_heads.png, heads_*.png and induction.json in")


def main(args: argparse.Namespace) -> int:
    cfg = InductionConfig(**flags.given(args, InductionConfig))
    runs = run(cfg)
    print(report(cfg, runs))
    paths = save_outputs(cfg, runs, Path(args.out))
    print("\nwrote " + ", ".join(str(p) for p in paths))
    return 0
