"""Write one self-contained HTML page to explore a model's attention in any browser.

``--ckpt`` takes what ``selfattn sample`` takes: a run folder of ``selfattn train``, one
checkpoint file, or a local GPT-2 folder. The page shows the head view (queries and keys in
two columns, lines with opacity = weight), the model view (every layer x head as a small map),
the head-role scores of ``selfattn heads`` in a sortable table, and the model's top-5 next
tokens and loss at every position. Without ``--text`` the input is ``--repeat`` random
distinct tokens shown twice, on which induction heads show themselves. Data and code are
inline; the page makes no network request (see :mod:`selfattn.analysis.explore`).
"""
from __future__ import annotations

import argparse
from pathlib import Path

import torch

from selfattn._util import files as _files
from selfattn.analysis.explore import QUANT_ERROR, explore
from selfattn.analysis.heads import repeated_tokens
from selfattn.io.loading import load


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--ckpt", required=True, metavar="PATH", default=argparse.SUPPRESS,
                   help="run folder, checkpoint file, local folder saved by transformers, or GGUF file")
    given = p.add_mutually_exclusive_group()
    given.add_argument("--text", default=None, help="text to look at (default: random tokens, repeated twice)")
    given.add_argument("--repeat", type=int, default=32, metavar="N",
                       help="without --text: N random distinct tokens, shown twice (2N positions)")
    p.add_argument("--seed", type=int, default=0, help="seed of the random tokens")
    p.add_argument("--out", default="out/explore.html", metavar="PAGE", help="the HTML file to write")


def main(args: argparse.Namespace) -> int:
    out = Path(args.out)
    if out.is_dir():
        raise ValueError(f"--out {args.out!r} is a folder: name the page to write, e.g. --out {out / 'explore.html'}")
    _files.writable_folder(out.parent)  # checked before the work, created once the page is ready
    if args.text is None and args.repeat <= 0:
        raise ValueError(f"--repeat must be positive, got {args.repeat}")
    if args.text == "":
        raise ValueError("--text is empty: pass a text, or leave --text out for random tokens")
    loaded = load(args.ckpt)
    model, tokenizer = loaded.model, loaded.tokenizer
    if args.text is None:
        check_repeat("--repeat", args.repeat, model.config)
        tokens = repeated_tokens(model.config.vocab_size, args.repeat,
                                 generator=torch.Generator().manual_seed(args.seed))[0]  # (2·repeat,)
        what = f"{args.repeat} random tokens, repeated (T={tokens.shape[0]})"
    else:
        tokens = torch.tensor(loaded.require_tokenizer().encode(args.text), dtype=torch.long)  # (T,)
        what = f"--text, {tokens.shape[0]} tokens"
    page = explore(model, tokens, out, tokenizer=tokenizer, title=f"{Path(args.ckpt).name}: {what}")
    cfg = model.config
    print(f"selfattn explore: {args.ckpt}: {cfg.n_layer} layers x {cfg.n_head} heads; input: {what}")
    size = f"{page.size / 1e6:.2f} MB" if page.size >= 1e6 else f"{page.size / 1e3:.0f} KB"
    print(f"  wrote {out} ({size}): weights as 8-bit codes, max error {page.max_error:.5f} "
          f"(bound 1/510 = {QUANT_ERROR:.5f})")
    print(f"  open it in a browser: {out.absolute().as_uri()}")
    return 0


def check_repeat(flag: str, n: int, config) -> None:
    """``n`` distinct random tokens shown twice must fit the model: 2n positions, n tokens of its vocabulary."""
    if 2 * n > config.block_size:
        raise ValueError(f"{flag} {n} shows {2 * n} tokens, more than the model's block_size={config.block_size}; "
                         f"pass {flag} {config.block_size // 2} or less")
    if n > config.vocab_size:
        raise ValueError(f"{flag} {n} needs {n} distinct tokens, more than the model's vocabulary of "
                         f"{config.vocab_size}; pass {flag} {config.vocab_size} or less")
