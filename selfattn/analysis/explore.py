"""One self-contained HTML page to explore a model's attention: :func:`explore`.

The page (the template ``explore.html`` beside this file: vanilla JavaScript, SVG and canvas)
holds its data and code inline and makes no network request of any kind; its
Content-Security-Policy forbids every fetch. It shows

- head view: the tokens in two columns, queries and keys; selecting (or hovering) a query
  draws a line to each key it attends to, opacity = weight, for one head or for all heads of
  a layer (one colour per head); hovering a key shows who attends to it;
- model view: every layer x head as a small T x T map; a click opens it in the head view;
- head roles: the six scores of :func:`~selfattn.analysis.heads.head_scores` per head in a
  sortable table, the top heads per role marked, a score the input leaves undefined as n/a
  (induction on "hello", whose only repeat is adjacent); a row opens its head;
- predictions: at every position the model's top-5 next tokens with their probabilities,
  and the loss of the actual next token;
- depends on: for the token predicted after the last position, the share of its logit each head
  and each input position restores when patched from the input into a corrupted one
  (:mod:`selfattn.analysis.depends`).

Weights come from :func:`~selfattn.analysis.heads.capture` during one forward pass. Only the
causal triangle is stored, one byte per weight (:func:`quantise`): code 0 is exactly zero,
a non-zero weight w is ``ceil(255 w)`` and is drawn as ``(code - 1/2) / 255``, so every drawn
weight is within :data:`QUANT_ERROR` = 1/510 of the captured one and is non-zero exactly
when the captured one is. The bytes are deflated (the browser's ``DecompressionStream``
inflates them) and written as base-85 text.
"""
from __future__ import annotations

import contextlib
import itertools
import json
import os
import zlib
from dataclasses import dataclass
from importlib import resources
from pathlib import Path

import torch
from torch import Tensor

from selfattn._util import files as _files
from selfattn.analysis import depends
from selfattn.analysis.heads import UNDEFINED, capture, head_scores, rank_heads
from selfattn.model import GPT

QUANT_ERROR = 1 / 510  # the largest |drawn weight - captured weight| the 8-bit codes allow
TOP_PREDICTIONS = 5
TOP_HEADS = 3  # heads marked per role
_VISIBLE = {" ": "\u2423", "\n": "\u21b5", "\t": "\u21e5", "\r": "\u240d"}  # open box, return, tab, CR symbols
# RFC 1924's base-85 alphabet (Python's b85encode) with < > & swapped for . : , so the text is inert in HTML
ALPHABET = "0123456789ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz!#$%,()*+-;.=:?@^_`{|}~"


@dataclass
class Page:
    """What :func:`explore` wrote."""
    path: Path
    size: int  # bytes of the HTML file
    tokens: int  # T, the positions shown
    max_error: float  # measured max |drawn weight - captured weight|, at most QUANT_ERROR


def explore(model: GPT, tokens, path: str | os.PathLike, *, tokenizer=None, title: str | None = None,
            corrupt=None) -> Page:
    """Write the attention page of ``model`` reading ``tokens`` to ``path`` (one HTML file).

    tokens: token ids, a list or a tensor ``(T,)`` or ``(1, T)``, 2 <= T <= block_size.
    tokenizer: anything with ``token_bytes(id)`` (the byte tokenizer, a BPE); without one,
        tokens are shown as their ids.
    corrupt: the corrupted input "depends on" patches into, as many tokens as ``tokens``; None: the
        tokens shuffled (:mod:`selfattn.analysis.depends`; inputs longer than ``depends.MAX_TOKENS``
        go without that section).
    The page is written atomically once it is ready, and the missing folders of ``path`` with
    it: a failure leaves no half page and no folder made here.
    The model runs once in eval mode (its train/eval mode is restored after).
    """
    if not isinstance(model, GPT):
        raise TypeError(f"explore expects a selfattn GPT, got {type(model).__name__}")
    idx = _check_tokens(tokens, model.config)
    corrupt = None if corrupt is None else _check_tokens(corrupt, model.config)
    if corrupt is not None and corrupt.shape != idx.shape:
        raise ValueError(f"the corrupted input must be as many tokens as the input, {idx.shape[0]}; got "
                         f"{corrupt.shape[0]}")
    att, logits = _forward(model, idx)  # (L, H, T, T), (T, V)
    depends_on = _depends(model, idx, corrupt)
    L, H, T, _ = att.shape
    rows, cols = torch.tril_indices(T, T)
    triangle = att[:, :, rows, cols].double()  # (L, H, T(T+1)/2): row after row
    codes = quantise(triangle)
    max_error = float((dequantise(codes) - triangle).abs().max())
    repeats = bool((idx[:, None] == idx[None, :]).tril(-1).any())
    scores = head_scores(att[:, None], idx[None] if repeats else None)  # name -> (L, H)
    predictions, shown = _predictions(logits, idx)
    if depends_on.get("corrupt_tokens"):
        shown |= set(depends_on["corrupt_tokens"]) | {depends_on["token"]}
    html = _fill({
        "title": title or f"{type(model).__name__}: {L} layers x {H} heads",
        "layers": L, "heads": H, "T": T, "tokens": idx.tolist(),
        "vocab": {str(t): _token_info(tokenizer, t) for t in sorted(set(idx.tolist()) | shown)},
        "weights": _pack(codes), "alphabet": ALPHABET,
        "quant": {"bits": 8, "bound": QUANT_ERROR, "measured": max_error},
        "scores": {name: [[None if v != v else v for v in row] for row in s.tolist()]  # NaN (undefined): null
                   for name, s in scores.items()},
        "undefined": {name: UNDEFINED[name] for name, s in scores.items() if s.isnan().all()},
        "top": {role: [[l, h] for l, h, _ in top] for role, top in rank_heads(scores, TOP_HEADS)},
        "predictions": predictions,
        "depends": depends_on,
    })
    path = Path(path)
    _write(path, html)  # ASCII only: the same bytes in any locale
    return Page(path, len(html), T, max_error)


def _write(path: Path, text: str) -> None:
    """Write ``text`` to ``path`` atomically, creating its missing folders; a failed write leaves
    none of the folders made here."""
    made = list(itertools.takewhile(lambda folder: not folder.exists(), path.parents))  # deepest first
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        _files.write_text(path, text)
    except BaseException:
        for folder in made:
            with contextlib.suppress(OSError):
                folder.rmdir()  # removed only while empty
        raise


def quantise(weights: Tensor) -> Tensor:
    """8-bit codes of attention weights in [0, 1]: 0 for exactly 0, else ``ceil(255 w)`` (1..255)."""
    return (weights.double() * 255).ceil().clamp(0, 255).to(torch.uint8)


def dequantise(codes: Tensor) -> Tensor:
    """The weights the page draws for :func:`quantise`'s codes: ``(code - 1/2) / 255``, and 0 for 0."""
    c = codes.double()
    return torch.where(c > 0, (c - 0.5) / 255, 0.0)


def token_label(raw: bytes) -> str:
    """A token's bytes as readable text: space, newline, tab and carriage return as the symbols
    of :data:`_VISIBLE`; other control characters, and bytes that are not (complete) UTF-8, as
    ``\\xNN``; everything else as the characters it encodes."""
    out = []
    for ch in raw.decode("utf-8", errors="surrogateescape"):
        code = ord(ch)
        if 0xDC80 <= code <= 0xDCFF:  # a byte that surrogateescape kept aside: not valid UTF-8 here
            out.append(f"\\x{code - 0xDC00:02x}")
        elif ch in _VISIBLE:
            out.append(_VISIBLE[ch])
        elif not ch.isprintable():
            out.append(f"\\x{code:02x}" if code < 0x100 else f"\\u{code:04x}")
        else:
            out.append(ch)
    return "".join(out)


def _check_tokens(tokens, config) -> Tensor:
    idx = tokens if isinstance(tokens, Tensor) else torch.tensor(tokens) if isinstance(tokens, (list, tuple)) \
        else None
    if idx is None or idx.is_floating_point() or idx.is_complex() or idx.dtype == torch.bool:
        raise TypeError(f"tokens must be integer token ids (a list, or a tensor (T,) or (1, T)), "
                        f"got {getattr(tokens, 'dtype', type(tokens).__name__)}")
    if idx.dim() == 2 and idx.shape[0] == 1:
        idx = idx[0]
    if idx.dim() != 1:
        raise ValueError(f"tokens must be one sequence, (T,) or (1, T); got shape {tuple(idx.shape)}")
    T = idx.shape[0]
    if not 2 <= T <= config.block_size:
        raise ValueError(f"tokens must hold 2 to block_size={config.block_size} tokens, got {T}")
    bad = idx[(idx < 0) | (idx >= config.vocab_size)]
    if bad.numel():
        raise ValueError(f"token {int(bad[0])} is outside the vocabulary 0..{config.vocab_size - 1}")
    return idx.long().cpu()


@torch.no_grad()
def _forward(model: GPT, idx: Tensor) -> tuple[Tensor, Tensor]:
    """The captured weights of every layer ``(L, H, T, T)`` and the logits ``(T, V)``, in eval mode,
    float32 on the CPU whatever the model's device and dtype."""
    was = model.training
    try:
        with capture(model.eval()) as maps:
            logits = model(idx[None].to(next(model.parameters()).device))[0][0].float().cpu()  # (T, V)
    finally:
        model.train(was)
    att = torch.stack([maps[i][0].float().cpu() for i in sorted(maps)])  # (L, H, T, T)
    if att.triu(1).any():
        raise ValueError("the captured weights attend to future keys; the page shows causal attention only")
    return att, logits


def _depends(model: GPT, idx: Tensor, corrupt: Tensor | None) -> dict:
    """:func:`selfattn.analysis.depends.depends_on` in eval mode (the mode restored after), or why not."""
    if idx.shape[0] > depends.MAX_TOKENS:
        return {"why": f"left out: the input is {idx.shape[0]} tokens, and the page patches inputs of at most "
                       f"{depends.MAX_TOKENS}"}
    was = model.training
    try:
        return depends.depends_on(model.eval(), idx, corrupt)
    finally:
        model.train(was)


def _predictions(logits: Tensor, idx: Tensor) -> tuple[dict, set[int]]:
    """The top next tokens and their probabilities at every position, and the loss and rank of
    the actual next token (positions 0..T-2); with the set of token ids they name."""
    logp = logits.log_softmax(-1)  # (T, V)
    top = logp.topk(min(TOP_PREDICTIONS, logp.shape[-1]), dim=-1)  # (T, k)
    actual = logp[:-1].gather(1, idx[1:, None])  # (T-1, 1)
    rank = (logp[:-1] > actual).sum(-1) + 1  # (T-1,)
    predictions = {"top": top.indices.tolist(), "p": top.values.exp().mul(1e4).round().div(1e4).tolist(),
                   "loss": (-actual[:, 0]).mul(1e4).round().div(1e4).tolist(), "rank": rank.tolist()}
    return predictions, set(top.indices.flatten().tolist())


def _fill(data: dict) -> str:
    """The page: the template with ``data`` as JSON in place of its marker."""
    text = json.dumps(data, separators=(",", ":")).replace("<", "\\u003c")  # ASCII, inert inside <script>
    template = resources.files("selfattn.analysis").joinpath("explore.html").read_text(encoding="utf-8")
    head, marker, tail = template.partition("__SELFATTN_DATA__")
    if not marker:
        raise RuntimeError("explore.html lost its __SELFATTN_DATA__ marker")
    return head + text + tail


def _token_info(tokenizer, token: int) -> list[str]:
    """[label, the token's bytes in hex]; the id itself when there is no tokenizer."""
    if tokenizer is None:
        return [f"#{token}", ""]
    raw = tokenizer.token_bytes(token)
    return [token_label(raw), raw.hex(" ")]


def _pack(codes: Tensor) -> dict:
    """The bytes of ``codes`` deflated and written in :data:`ALPHABET`."""
    deflated = zlib.compress(codes.numpy().tobytes(), 6)
    return {"bytes": codes.numel(), "deflated": len(deflated), "text": base85(deflated)}


def base85(data: bytes) -> str:
    """``base64.b85encode(data, pad=True)`` in :data:`ALPHABET`, vectorised (the standard
    library's encoder is a Python loop, seconds for megabytes): each 4 bytes, big-endian,
    become 5 digits, most significant first."""
    import numpy as np

    words = np.frombuffer(data + bytes(-len(data) % 4), dtype=">u4").astype(np.int64)  # (n,)
    digits = np.empty((words.size, 5), dtype=np.uint8)
    for k in range(4, -1, -1):
        words, digits[:, k] = np.divmod(words, 85)
    return np.frombuffer(ALPHABET.encode(), dtype=np.uint8)[digits].tobytes().decode()
