"""Calibrate ``auto`` to this machine: time its candidates on the kinds of request it is tuned for and
keep the fastest of each, which ``auto`` then follows (:mod:`selfattn.backends.calibrate`).

``selfattn calibrate`` measures (about ten minutes on 2 cores; ``--quick``, about one) and writes this
machine's cache file; ``--show`` says what ``auto`` follows here and times nothing; ``--out FOLDER``
keeps the measurements as ``FOLDER/calibrate.json`` too.
"""
from __future__ import annotations

import argparse
import json
import os

import torch

from selfattn._util import files as _files
from selfattn._util import validate as _validate
from selfattn.backends import calibrate
from selfattn.cli import flags

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
QUICK = dict(kinds=("window-256", "docs-16", "causal"), lengths=(256, 1024), n_head=2, reps=3)
EXAMPLE = "selfattn calibrate --quick --out out/calibrate"


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--show", action="store_true", help="say what auto follows on this machine; time nothing")
    p.add_argument("--kinds", nargs="+", choices=calibrate.KINDS, default=None,
                   help="the masks and score rules to time (default: all)")
    p.add_argument("--lengths", type=int, nargs="+", default=None,
                   help=f"sequence lengths T = S (default {' '.join(map(str, calibrate.LENGTHS))})")
    p.add_argument("--dtypes", nargs="+", choices=tuple(DTYPES), default=None,
                   help="dtypes (default: float32, and bfloat16 where the hardware computes it natively)")
    p.add_argument("--reps", type=int, default=None, help="timed calls per backend, the median kept (default 5)")
    p.add_argument("--quick", action="store_true", help="three kinds, two lengths, two heads: about a minute")
    flags.add_device(p)
    p.add_argument("--threads", type=int, default=None,
                   help="torch threads, part of the machine's fingerprint (default: every core available)")
    p.add_argument("--out", default=None, metavar="FOLDER",
                   help="folder to write calibrate.json in too, with the measurements")


def main(args: argparse.Namespace) -> int:
    device = _validate.device(args.device)
    threads = args.threads or (len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count())
    _validate.positive_int("--threads", threads)
    torch.set_num_threads(threads)
    if args.show:
        print("\n".join(calibrate.show(device)))
        return 0
    out = None if args.out is None else _files.writable_folder(args.out)  # checked before the work
    settings = dict(QUICK) if args.quick else {}
    for name in ("kinds", "lengths", "reps"):
        if getattr(args, name) is not None:
            value = getattr(args, name)
            settings[name] = _validate.positive_int("--reps", value) if name == "reps" else tuple(value)
    if args.dtypes:
        settings["dtypes"] = tuple(DTYPES[d] for d in args.dtypes)

    def line(m: dict) -> None:
        ranked = sorted(m["times_s"].items(), key=lambda x: x[1])
        print(f"{m['key']:<32} T={m['T']:<6} best {m['best']:<6} " +
              ", ".join(f"{n} {t / ranked[0][1]:.2f}x" for n, t in ranked), flush=True)

    measured = calibrate.calibrate(device, log=line, **settings)
    print(f"auto follows these measurements from {calibrate.tuning.path(device)}")
    if out is not None:
        out.mkdir(parents=True, exist_ok=True)
        _files.write_text(out / "calibrate.json", json.dumps({
            "device": str(device), "fingerprint": calibrate.tuning.fingerprint(device), "results": measured}, indent=1))
        print(f"wrote {out / 'calibrate.json'}")
    return 0
