"""Look inside the heads of a trained model: attention maps, ranked head roles, scores.

``--ckpt`` takes what ``selfattn sample`` takes: a run folder of ``selfattn train``, one
checkpoint file, a local folder written by ``transformers``' ``save_pretrained`` or a GGUF file;
the model runs on ``--device`` in ``--dtype``. Without ``--text`` the input is ``--random-tokens``
random distinct tokens repeated twice, on which
previous-token, duplicate-token and induction heads show themselves (see
:mod:`selfattn.analysis.heads` for each score's formula). Writes ``attention.png`` (one panel per layer and head) and
``scores.json`` to ``--out`` and prints the best heads for each role.
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

from selfattn._util import files as _files
from selfattn._util import validate as _validate
from selfattn.analysis.heads import (
    ROLES,
    UNDEFINED,
    attention_layers,
    attention_maps,
    head_scores,
    plot_attention_grid,
    rank_heads,
    repeated_tokens,
)
from selfattn.cli import flags
from selfattn.io.loading import load

LABELS_UP_TO = 32  # token labels on the plot axes for sequences up to this long
TABLE_UP_TO = 64  # print the per-head table for models with at most this many heads
EXAMPLE = "selfattn heads --ckpt runs/tiny --random-tokens 24 --out out/heads"


def add_arguments(p: argparse.ArgumentParser) -> None:
    flags.add_model(p)
    flags.add_input(p, random_tokens=16)
    p.add_argument("--layers", default=None, help="comma-separated layers to show (default: all)")
    p.add_argument("--top", type=int, default=3, help="heads listed per role")
    p.add_argument("--out", default="out/heads", metavar="FOLDER", help="folder to write attention.png and "
                                                                       "scores.json in")


def main(args: argparse.Namespace) -> int:
    out = _files.writable_folder(args.out)  # checked before the work
    layers = _parse_layers(args.layers)  # the flags first, then the model (seconds to load)
    if args.top <= 0:
        raise ValueError(f"--top must be positive, got {args.top}")
    flags.check_input(args)
    device = _validate.device(args.device)
    loaded = load(args.ckpt, **flags.base_of(args))
    model, tokenizer = loaded.model.to(device, flags.dtype(args)).eval(), loaded.tokenizer
    n_layer = len(attention_layers(model))
    layers = _check_layers(layers, n_layer)
    if args.text is None:
        flags.check_random_tokens(args.random_tokens, model.config)
        g = torch.Generator().manual_seed(args.seed)
        tokens = repeated_tokens(model.config.vocab_size, args.random_tokens, generator=g)  # (1, 2·random_tokens)
        what = f"{args.random_tokens} random tokens, repeated (T={tokens.shape[1]})"
    else:
        ids = loaded.require_tokenizer().encode(args.text)
        if not ids:
            raise ValueError("--text encodes to no tokens")
        tokens = torch.tensor([ids])  # (1, T)
        what = f"--text, {len(ids)} tokens"
    if tokens.shape[1] > model.config.block_size:
        raise ValueError(f"{tokens.shape[1]} tokens exceed the model's block_size={model.config.block_size}")
    att = attention_maps(model, tokens.to(device), layers).cpu()  # (L, 1, H, T, T) float32
    repeats = bool((tokens[0, :, None] == tokens[0, None, :]).tril(-1).any())
    scores = head_scores(att, tokens if repeats else None)

    out.mkdir(parents=True, exist_ok=True)
    labels = [_label(tokenizer, t) for t in tokens[0].tolist()] if args.text is not None else None
    if labels is not None and len(labels) > LABELS_UP_TO:
        labels = None
    plot_attention_grid(att[:, 0], out / "attention.png", labels=labels, layers=layers,
                        title=f"{Path(args.ckpt).name}: {what}")
    _files.write_text(out / "scores.json", json.dumps({
        "ckpt": str(args.ckpt), "input": what, "tokens": tokens[0].tolist(), "layers": layers,
        "scores": {name: [[None if v != v else v for v in row] for row in s.tolist()]  # NaN (undefined): null
                   for name, s in scores.items()},
        "ranking": {role: [{"layer": layers[l], "head": h, "score": v} for l, h, v in top]
                    for role, top in rank_heads(scores, args.top)}}, indent=1))

    H = att.shape[2]
    print(f"selfattn heads: {args.ckpt}: {n_layer} layers x {H} heads on {device} in {args.dtype}; input: {what}")
    if not repeats:
        print("  no token occurs twice in the input, so duplicate-token and induction scores are left out")
    for name in [n for n, s in scores.items() if s.isnan().all()]:
        print(f"  {name}: n/a, undefined on this input: {UNDEFINED[name]}")
    print("\n" + ("  " + "role".ljust(18) + "".join(f"#{i + 1}".ljust(14) for i in range(args.top))).rstrip())
    for role, top in rank_heads(scores, args.top):
        print(("  " + role.ljust(18) + ("".join(f"L{layers[l]}H{h} {v:.3f}".ljust(14) for l, h, v in top)
                                        or "n/a")).rstrip())
    if len(layers) * H <= TABLE_UP_TO:
        names = [n for n in (*ROLES, "mean-distance", "entropy") if n in scores]
        print("\n" + ("  head   " + "".join(n.ljust(16) for n in names)).rstrip())
        for i, layer in enumerate(layers):
            for h in range(H):
                cells = "".join(("n/a" if scores[n][i, h].isnan() else f"{scores[n][i, h]:.3f}").ljust(16)
                                for n in names)
                print((f"  L{layer}H{h}".ljust(9) + cells).rstrip())
    print(f"\n  mean-distance in positions, entropy in nats; wrote {out / 'attention.png'}, {out / 'scores.json'}")
    return 0


def _parse_layers(text: str | None) -> list[int] | None:
    """``--layers``' numbers; None (all layers) without it."""
    if text is None:
        return None
    try:
        return [int(x) for x in text.split(",")]
    except ValueError:
        raise ValueError(f"--layers must be comma-separated integers, got {text!r}") from None


def _check_layers(layers: list[int] | None, n_layer: int) -> list[int]:
    if layers is None:
        return list(range(n_layer))
    bad = [i for i in layers if not 0 <= i < n_layer]
    if bad:
        raise ValueError(f"--layers {bad} out of range: the model has {n_layer} layers (0..{n_layer - 1})")
    return layers


def _label(tokenizer, token: int) -> str:
    text = tokenizer.token_bytes(token).decode("utf-8", errors="replace")
    return repr(text)[1:-1].replace(" ", "·")
