"""Activation patching: which layers, positions and heads carry what tells a clean prompt from a corrupted one.

``--clean`` and ``--corrupt`` are two prompts of the same number of tokens (the model's tokenizer) that differ
where it matters; ``--answer`` is the token the clean prompt should be followed by, ``--wrong`` the one the
corrupted prompt's evidence points to. The metric is the answer's logit at the last position, or with
``--wrong`` the logit difference ``logit(answer) - logit(wrong)``. The command prints it on both prompts, then
runs the corrupted prompt once per patch with one activation of the clean run put in (``--site`` of one layer at
one position, ``--by position``; of one head, ``--by head``; or both) and lists the patches that restore most of
the gap (share: ``(patched - corrupt) / (clean - corrupt)``, 1 = the whole clean metric back); writes the whole
sweep as a heatmap to ``--out`` (:func:`selfattn.interp.patch`, ``docs/interp.md``).
"""
from __future__ import annotations

import argparse
from pathlib import Path

import torch

from selfattn._util import plot as _plot
from selfattn._util import validate as _validate
from selfattn.cli import flags
from selfattn.interp import logit_diff, patch, run_with_cache
from selfattn.interp.patching import SITES, site_of
from selfattn.io.loading import load

BY = ("position", "head", "head,position")
DEFAULT_SITE = {"position": "resid_pre", "head": "z", "head,position": "z"}
EXAMPLE = ("selfattn patch --ckpt runs/tiny --clean 'When Mary and John went to the store, John gave a drink to' "
           "--corrupt 'When Mary and John went to the store, Mary gave a drink to' --answer ' Mary' --wrong ' John' "
           "--by head --out out/patch.png")


def add_arguments(p: argparse.ArgumentParser) -> None:
    flags.add_model(p)
    p.add_argument("--clean", required=True, default=argparse.SUPPRESS, metavar="TEXT",
                   help="the prompt the model answers right")
    p.add_argument("--corrupt", required=True, default=argparse.SUPPRESS, metavar="TEXT",
                   help="the same prompt, as many tokens long, with the evidence changed")
    p.add_argument("--answer", required=True, default=argparse.SUPPRESS, metavar="TOKEN",
                   help="the clean prompt's next token, as text (mind its leading space: ' Paris'); one token")
    p.add_argument("--wrong", default=None, metavar="TOKEN",
                   help="the corrupted prompt's next token, as text: the metric is then logit(answer) - "
                        "logit(wrong) (default: the answer's logit alone)")
    p.add_argument("--by", choices=BY, default="position",
                   help="patch one position of a layer (every head), one head (every position), or one head at one "
                        "position")
    p.add_argument("--site", choices=tuple(SITES), default=None,
                   help="the activation patched (default: resid_pre by position, z by head)")
    p.add_argument("--top", type=int, default=10, metavar="N", help="patches listed")
    p.add_argument("--out", default="out/patch.png", metavar="FILE", help="file to write the heatmap PNG to")


def main(args: argparse.Namespace) -> int:
    out = flags.figure_and_top(args, "patch.png")  # checked before the work
    site = args.site or DEFAULT_SITE[args.by]
    site_of(site, args.by)  # a site without heads by head: refused before loading
    device = _validate.device(args.device)
    loaded = load(args.ckpt, **flags.base_of(args))
    model = loaded.model.to(device, flags.dtype(args)).eval()
    tokenizer = loaded.require_tokenizer()
    clean, corrupt = (_prompt(tokenizer, flag, text, model.config.block_size)
                      for flag, text in (("clean", args.clean), ("corrupt", args.corrupt)))
    if len(clean) != len(corrupt):
        raise ValueError(f"--clean is {len(clean)} tokens and --corrupt {len(corrupt)}: patching compares the two "
                         f"prompts position by position, so they must be as many tokens long")
    answer = _token(tokenizer, "answer", args.answer)
    wrong = None if args.wrong is None else _token(tokenizer, "wrong", args.wrong)
    if wrong is None:
        name = f"logit({args.answer!r})"

        def metric(logits: torch.Tensor) -> torch.Tensor:  # (..., B, T, V) -> (...)
            return logits[..., -1, answer].mean(-1)
    else:
        name, metric = f"logit({args.answer!r}) - logit({args.wrong!r})", logit_diff(answer, wrong)

    clean_ids, corrupt_ids = (torch.tensor([ids], device=device) for ids in (clean, corrupt))  # (1, T)
    hook = site_of(site, args.by).hook
    with torch.no_grad():
        clean_logits, cache = run_with_cache(model, clean_ids, names=lambda n: n.endswith("." + hook))
        corrupt_logits, _ = model(corrupt_ids)
    on_clean, on_corrupt = metric(clean_logits).item(), metric(corrupt_logits).item()
    values = patch(model, corrupt_ids, cache, metric, site=site, by=args.by).float().cpu()  # (L, T|H) or (L, T, H)
    gap = on_clean - on_corrupt

    labels = [_label(tokenizer, t) for t in clean]
    L, cfg = values.shape[0], model.config
    print(f"selfattn patch: {args.ckpt}: {L} layers x {cfg.n_head} heads on {device} in {args.dtype}; "
          f"{len(clean)} tokens; site {site} by {args.by}")
    print(f"  metric {name} at the last position: clean {on_clean:.4f}, corrupt {on_corrupt:.4f}, gap {gap:.4f}")
    rows = _ranked(values, gap, on_corrupt, args.by, labels)[:args.top]
    heads = "head".ljust(6) if "head" in args.by else ""
    where = "position".ljust(10) + "token".ljust(18) if "position" in args.by else ""
    print(f"\n  {'layer'.ljust(7)}{where}{heads}{'value'.rjust(10)}{'share'.rjust(9)}")
    for layer, position, head, value, share in rows:
        cells = f"{position:<10}{labels[position]:<18}" if position is not None else ""
        cells += f"{head:<6}" if head is not None else ""
        print(f"  {layer:<7}{cells}{value:>10.4f}{_share(share):>9}")

    grid, row_names, x, xlabel = _grid(values, args.by, labels, L)
    out.parent.mkdir(parents=True, exist_ok=True)
    _plot.heatmap(grid, out, rows=row_names, columns=x, xlabel=xlabel, ylabel="layer" if args.by != "head,position"
                  else "layer, head", title=f"{Path(args.ckpt).name}: {name} patching {site} by {args.by}",
                  label=f"{name} (corrupt {on_corrupt:.3f}, clean {on_clean:.3f})", centre=on_corrupt)
    print(f"\n  share of the gap restored, (value - corrupt) / (clean - corrupt); wrote {out}")
    return 0


def _prompt(tokenizer, flag: str, text: str, block_size: int) -> list[int]:
    ids = tokenizer.encode(text)
    if not ids:
        raise ValueError(f"--{flag} encodes to no tokens")
    if len(ids) > block_size:
        raise ValueError(f"--{flag} is {len(ids)} tokens, more than the model's block_size={block_size}")
    return ids


def _token(tokenizer, flag: str, text: str) -> int:
    """The one token ``text`` encodes to; a ValueError showing how it splits otherwise."""
    ids = tokenizer.encode(text)
    if len(ids) != 1:
        pieces = " + ".join(_label(tokenizer, t) for t in ids) or "nothing"
        raise ValueError(f"--{flag} {text!r} is {len(ids)} tokens for this model ({pieces}), not one: give a "
                         f"single token, e.g. {_label(tokenizer, ids[0]) if ids else 'a word'}")
    return ids[0]


def _ranked(values: torch.Tensor, gap: float, corrupt: float, by: str, labels: list[str]) -> list[tuple]:
    """Every patch as (layer, position or None, head or None, value, share), the most restoring first: by share
    of the gap (by value when the gap is 0)."""
    order = values.flatten().argsort(descending=True) if gap >= 0 else values.flatten().argsort()
    rows = []
    for i in order.tolist():
        index = list(torch.unravel_index(torch.tensor(i), values.shape))
        layer = int(index[0])
        position = int(index[1]) if "position" in by else None
        head = int(index[-1]) if "head" in by else None
        value = values.flatten()[i].item()
        rows.append((layer, position, head, value, (value - corrupt) / gap if gap else None))
    return rows


def _share(share: float | None) -> str:
    return "n/a" if share is None else f"{share:.0%}".replace("-0%", "0%")


def _grid(values: torch.Tensor, by: str, labels: list[str], L: int):
    """The heatmap's rows ``(R, K)``, row names, column names and x label."""
    if by == "position":
        return values, [str(i) for i in range(L)], labels, "position (clean token)"
    if by == "head":
        return values, [str(i) for i in range(L)], [str(h) for h in range(values.shape[1])], "head"
    H = values.shape[2]
    return (values.permute(0, 2, 1).reshape(L * H, -1), [f"L{i}H{h}" for i in range(L) for h in range(H)], labels,
            "position (clean token)")


def _label(tokenizer, token: int) -> str:
    return repr(tokenizer.token_bytes(token).decode("utf-8", errors="replace"))
