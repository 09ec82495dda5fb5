"""Log-probabilities of chosen tokens, with the most probable alternatives: what ``logprobs`` and
``echo`` answer. Always of the model's own distribution (the softmax of its logits, in float32),
whatever temperature or filter chose the token."""
from __future__ import annotations

import torch
from torch import Tensor

from selfattn.serve.jobs import Alternatives

CHUNK = 256  # prompt positions whose logits are held at once: (CHUNK, V) float32


def chosen(logits: Tensor, tokens: Tensor, top: int) -> list[tuple[float, Alternatives]]:
    """For each row of ``logits`` ``(N, V)``: the log-probability of ``tokens[n]`` ``(N,)`` and the
    ``top`` most probable tokens with theirs (``top`` 0: none)."""
    logp = torch.log_softmax(logits.float(), dim=-1)  # (N, V)
    picked = logp.gather(-1, tokens[:, None])[:, 0].tolist()  # (N,)
    best = logp.topk(top, dim=-1) if top else None  # (N, top) values and ids
    alternatives = [() for _ in picked] if best is None else [
        tuple(zip(ids, values)) for ids, values in zip(best.indices.tolist(), best.values.tolist())]
    return list(zip(picked, alternatives))


def of_prompt(model, h: Tensor, ids: list[int], top: int) -> tuple[list[float | None], list[Alternatives | None]]:
    """The log-probability of each token of ``ids`` given those before it, from the prompt's hidden
    states ``h`` ``(1, T, C)``, and its ``top`` alternatives; None for the first token. The logits
    are computed :data:`CHUNK` positions at a time."""
    target = torch.tensor(ids[1:], device=h.device)  # (T - 1,) each position's next token
    n = len(target)
    found = [chosen(model.logits(h[0, i:min(i + CHUNK, n)]), target[i:i + CHUNK], top)  # (c, C) -> (c, V)
             for i in range(0, n, CHUNK)]
    pairs = [pair for chunk in found for pair in chunk]
    return [None] + [lp for lp, _ in pairs], [None] + [alt for _, alt in pairs]
