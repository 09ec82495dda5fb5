"""The logit lens: what each layer's residual stream would predict, read through the final norm and the head.

Each layer's ``hook_resid_post`` goes through the final norm (with its own statistics) and the un-embedding
(:func:`selfattn.interp.logit_lens`); the command prints, at each of ``--positions``, every layer's ``--top``
next tokens with their probabilities. The last layer's are the model's own. Writes to ``--out`` a heatmap of the
probability each layer gives, at every position, to the token the model finally predicts there. Without
``--text`` the input is ``--random-tokens`` random distinct tokens shown twice, whose second half a model with
induction heads predicts, from some layer on.
"""
from __future__ import annotations

import argparse
from pathlib import Path

import torch

from selfattn._util import plot as _plot
from selfattn._util import validate as _validate
from selfattn.analysis.heads import repeated_tokens
from selfattn.cli import flags
from selfattn.interp import logit_lens, run_with_cache
from selfattn.io.loading import load

EXAMPLE = "selfattn lens --ckpt runs/tiny --text 'The cat sat on the mat. The cat sat on the' --positions=-3,-1"


def add_arguments(p: argparse.ArgumentParser) -> None:
    flags.add_model(p)
    flags.add_input(p, random_tokens=16)
    p.add_argument("--positions", default="-1", metavar="I,J",
                   help="comma-separated positions to show, negative from the end (write --positions=-3,-1)")
    p.add_argument("--top", type=int, default=5, metavar="K", help="tokens shown per layer")
    p.add_argument("--out", default="out/lens.png", metavar="FILE", help="file to write the heatmap PNG to")


def main(args: argparse.Namespace) -> int:
    out = flags.figure_and_top(args, "lens.png")  # checked before the work
    positions = _parse_positions(args.positions)
    flags.check_input(args)
    device = _validate.device(args.device)
    loaded = load(args.ckpt, **flags.base_of(args))
    model = loaded.model.to(device, flags.dtype(args)).eval()
    if args.text is not None:
        ids = loaded.require_tokenizer().encode(args.text)
        what = f"--text, {len(ids)} tokens"
    else:
        flags.check_random_tokens(args.random_tokens, model.config)
        ids = repeated_tokens(model.config.vocab_size, args.random_tokens,
                              generator=torch.Generator().manual_seed(args.seed))[0].tolist()
        what = f"{args.random_tokens} random tokens, repeated (T={len(ids)})"
    T = len(ids)
    if not 0 < T <= model.config.block_size:
        raise ValueError(f"--text is {T} tokens: the lens needs 1 to block_size={model.config.block_size}")
    bad = [i for i in positions if not -T <= i < T]
    if bad:
        raise ValueError(f"--positions {bad} out of range: the input has {T} tokens (0..{T - 1}, or -{T}..-1)")
    with torch.no_grad():
        _, cache = run_with_cache(model, torch.tensor([ids], device=device),
                                  names=lambda n: n.endswith(".hook_resid_post"))
        probs = logit_lens(model, cache)[:, 0].float().softmax(-1).cpu()  # (L, T, V)
    L = probs.shape[0]
    tokenizer = loaded.tokenizer
    labels = [_label(tokenizer, t) for t in ids]

    cfg = model.config
    print(f"selfattn lens: {args.ckpt}: {L} layers x {cfg.n_head} heads on {device} in {args.dtype}; input: {what}")
    for i in positions:
        t = i % T
        after = f", next in the text {labels[t + 1]}" if t + 1 < T else ""
        print(f"\n  position {t} {labels[t]}{after}: each layer's top {args.top}")
        top = probs[:, t].topk(min(args.top, probs.shape[-1]), dim=-1)  # (L, K)
        for layer in range(L):
            cells = "  ".join(f"{_label(tokenizer, tok)} {p:.3f}"
                              for tok, p in zip(top.indices[layer].tolist(), top.values[layer].tolist()))
            print(f"  L{layer:<4}{cells}")

    final = probs[-1].argmax(-1)  # (T,): the model's own prediction at each position
    grid = probs.gather(-1, final.expand(L, T)[..., None])[..., 0]  # (L, T)
    out.parent.mkdir(parents=True, exist_ok=True)
    _plot.heatmap(grid, out, rows=[str(i) for i in range(L)], columns=labels, xlabel="position (token)",
                  ylabel="layer", title=f"{Path(args.ckpt).name}: each layer's probability of the model's next token",
                  label="probability")
    print(f"\n  the last layer's tokens are the model's own; wrote {out}")
    return 0


def _parse_positions(text: str) -> list[int]:
    try:
        return [int(x) for x in text.split(",")]
    except ValueError:
        raise ValueError(f"--positions must be comma-separated integers (e.g. --positions=-3,-1), got {text!r}") \
            from None


def _label(tokenizer, token: int) -> str:
    if tokenizer is None:  # a model without a tokenizer this library reads: random tokens, shown by id
        return f"#{token}"
    return repr(tokenizer.token_bytes(token).decode("utf-8", errors="replace"))
