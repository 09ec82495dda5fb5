"""Benchmarks: our attention, decoding and training side by side with the peers, in one run.

``selfattn bench attention|decode|train|all [--out DIR] [--quick] [--device D] [--threads N]``

- ``attention``: our backends and the peers (the seed's module, ``nn.MultiheadAttention``,
  nanoGPT's attention, transformers' GPT-2 attention), forward and forward+backward, as T
  sweeps at fixed B·T: median time, ratio to the fastest, GFLOP/s and its fraction of this
  machine's measured matmul throughput, peak memory (:mod:`selfattn.bench.attention`);
- ``decode``: tokens/s of greedy generation, our KV cache vs no cache vs transformers'
  ``generate`` on the same GPT-2-shaped weights (:mod:`selfattn.bench.decode`);
- ``train``: tokens/s of a training step, our GPT vs a nanoGPT-equivalent model
  (:mod:`selfattn.bench.train`).

Every implementation is checked against the reference before it is timed; a failed check
stops the run with exit status 1. Each suite prints its tables and targets and writes
``DIR/<suite>.json`` and ``DIR/<suite>.png``. ``--quick`` runs small shapes in about a
minute; the default run of all three suites is sized for ~15 minutes on two CPU cores.
"""
from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

from selfattn.bench import attention, common, decode, train

SUITES = {"attention": attention, "decode": decode, "train": train}
HELP = {"attention": "attention layers: our backends vs the peers over a T sweep",
        "decode": "generation tokens/s: KV cache vs no cache vs transformers' generate",
        "train": "training-step tokens/s: our GPT vs a nanoGPT-equivalent model",
        "all": "the three suites, one after the other"}


def add_arguments(p: argparse.ArgumentParser) -> None:
    sub = p.add_subparsers(dest="suite", required=True, metavar="SUITE")
    for name, help_text in HELP.items():
        s = sub.add_parser(name, help=help_text, description=help_text)
        s.add_argument("--out", default="bench_results",
                       help="directory for <suite>.json and <suite>.png (default: bench_results)")
        s.add_argument("--quick", action="store_true", help="small shapes, about a minute")
        s.add_argument("--device", default="auto", help="cpu, cuda, ... (default auto: the accelerator if any)")
        s.add_argument("--threads", type=int, default=None, help="torch threads (default: every core available)")
        s.add_argument("--reps", type=int, default=None, help="timed repetitions (default: the suite's)")
        if name in SUITES:
            SUITES[name].add_arguments(s)


def main(args: argparse.Namespace) -> int:
    os.environ.setdefault("HF_HUB_OFFLINE", "1")  # the benchmarks never download anything
    device = common.resolve_device(args.device)
    common.pin_threads(args.threads)
    out = Path(args.out)
    for name in SUITES if args.suite == "all" else [args.suite]:
        suite = SUITES[name]
        settings = suite.settings_from(args)
        print(f"== selfattn bench {name}" + (" (quick)" if args.quick else ""), flush=True)
        try:
            result = suite.run(settings, device, log=lambda line: print(line, flush=True))
        except common.CorrectnessError as e:
            print(f"selfattn bench {name}: FAILED the correctness check, nothing timed is reported: {e}",
                  file=sys.stderr)
            return 1
        print(suite.report(result))
        written = [common.write_json(out, name, result)]
        try:
            written.append(suite.plot(result, out / f"{name}.png"))
        except ImportError as e:
            print(f"no plot: {e}", file=sys.stderr)
        print("wrote " + ", ".join(map(str, written)), flush=True)
    return 0
