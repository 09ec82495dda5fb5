"""Write one self-contained HTML page to explore a model's attention in any browser.

``--ckpt`` takes what ``selfattn sample`` takes: a run folder of ``selfattn train``, one
checkpoint file, or a local GPT-2 folder. The page shows the head view (queries and keys in
two columns, lines with opacity = weight), the model view (every layer x head as a small map),
the head-role scores of ``selfattn heads`` in a sortable table, the model's top-5 next tokens
and loss at every position, and what its last prediction depends on: each head's and each input
position's share of it, patched from the input into ``--corrupt`` (as many tokens; default: the
input's tokens shuffled), for inputs of up to 32 tokens (:mod:`selfattn.analysis.depends`).
Without ``--text`` the input is ``--random-tokens`` random distinct tokens shown twice, on which
induction heads show themselves. The model runs on ``--device`` in ``--dtype``. Data and code
are inline; the page makes no network request (see :mod:`selfattn.analysis.explore`).
"""
from __future__ import annotations

import argparse
from pathlib import Path

import torch

from selfattn._util import files as _files
from selfattn._util import validate as _validate
from selfattn.analysis.explore import QUANT_ERROR, explore
from selfattn.analysis.heads import repeated_tokens
from selfattn.cli import flags
from selfattn.io.loading import load

EXAMPLE = "selfattn explore --ckpt runs/tiny --text 'The cat sat on the mat. The cat' --out out/cat.html"


def add_arguments(p: argparse.ArgumentParser) -> None:
    flags.add_model(p)
    flags.add_input(p, random_tokens=32)
    p.add_argument("--corrupt", default=None, metavar="TEXT",
                   help="with --text: the corrupted input \"depends on\" patches into, as many tokens as --text; "
                        "unset: --text's tokens shuffled")
    p.add_argument("--out", default="out/explore.html", metavar="FILE", help="file to write the HTML page to")


def main(args: argparse.Namespace) -> int:
    out = Path(args.out)
    if out.is_dir():
        raise ValueError(f"--out {args.out!r} is a folder: name the page to write, e.g. --out {out / 'explore.html'}")
    _files.writable_folder(out.parent)  # checked before the work, created once the page is ready
    flags.check_input(args)
    if args.corrupt is not None and args.text is None:
        raise ValueError("--corrupt is a corrupted --text: give --text too")
    device = _validate.device(args.device)
    loaded = load(args.ckpt, **flags.base_of(args))
    model, tokenizer = loaded.model.to(device, flags.dtype(args)), loaded.tokenizer
    if args.text is None:
        flags.check_random_tokens(args.random_tokens, model.config)
        tokens = repeated_tokens(model.config.vocab_size, args.random_tokens,
                                 generator=torch.Generator().manual_seed(args.seed))[0]  # (2·random_tokens,)
        what = f"{args.random_tokens} random tokens, repeated (T={tokens.shape[0]})"
    else:
        tokens = torch.tensor(loaded.require_tokenizer().encode(args.text), dtype=torch.long)  # (T,)
        what = f"--text, {tokens.shape[0]} tokens"
    corrupt = None
    if args.corrupt is not None:
        corrupt = torch.tensor(loaded.require_tokenizer().encode(args.corrupt), dtype=torch.long)  # (T,)
        if corrupt.shape != tokens.shape:
            raise ValueError(f"--corrupt is {corrupt.shape[0]} tokens and --text {tokens.shape[0]}: patching needs "
                             f"as many")
    page = explore(model, tokens, out, tokenizer=tokenizer, title=f"{Path(args.ckpt).name}: {what}", corrupt=corrupt)
    cfg = model.config
    print(f"selfattn explore: {args.ckpt}: {cfg.n_layer} layers x {cfg.n_head} heads on {device} in {args.dtype}; "
          f"input: {what}")
    size = f"{page.size / 1e6:.2f} MB" if page.size >= 1e6 else f"{page.size / 1e3:.0f} KB"
    print(f"  wrote {out} ({size}): weights as 8-bit codes, max error {page.max_error:.5f} "
          f"(bound 1/510 = {QUANT_ERROR:.5f})")
    print(f"  open it in a browser: {out.absolute().as_uri()}")
    return 0

