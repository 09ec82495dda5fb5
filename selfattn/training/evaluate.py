"""A model's loss and perplexity: on a text, over sliding contexts as transformers' guide computes it
(:func:`perplexity`); on sequences with their own targets, such as chat data's assistant tokens
(:func:`masked_perplexity`).

A model reads at most ``block_size`` tokens at once, so a longer text is read in contexts of
``context`` tokens, one starting every ``stride`` tokens (the "sliding window" of
https://huggingface.co/docs/transformers/perplexity; called a context here, as a window is an
attention window everywhere else in this library). Each context predicts only the tokens past the
previous context's end, each from what the context gives it. ``stride == context`` (the default)
reads disjoint contexts, the fewest forwards, but a context's first tokens have little before them
and its very first token is not predicted; a smaller stride gives every predicted token at least
``context - stride`` tokens before it, for about ``context / stride`` times the forwards. The
text's first token is never predicted.

Sequences with targets (:func:`masked_perplexity`) are read one forward each, whole: position t
predicts ``targets[t]`` unless it is -100 (chat data: the assistant's tokens,
:meth:`selfattn.training.chat.Encoded.targets`).

Either way the loss is the negative log-likelihood summed over every predicted token and divided by
their number (not a mean of the contexts' or sequences' means), in nats per token; the perplexity is
its exponential.
"""
from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from selfattn._util import progress
from selfattn._util import validate as _validate
from selfattn.loss import IGNORE
from selfattn.model import GPT


@dataclass(frozen=True)
class Evaluation:
    """What :func:`perplexity` measured."""
    loss: float  # mean negative log-likelihood, nats per predicted token
    perplexity: float  # exp(loss)
    tokens: int  # the tokens predicted
    contexts: int  # the contexts read, one forward each
    context: int  # tokens a context holds at most
    stride: int  # tokens from one context's start to the next


@dataclass(frozen=True)
class MaskedEvaluation:
    """What :func:`masked_perplexity` measured."""
    loss: float  # mean negative log-likelihood, nats per predicted token
    perplexity: float  # exp(loss)
    tokens: int  # the tokens predicted (targets other than -100)
    sequences: int  # the sequences read, one forward each


def perplexity(model: GPT, ids: Sequence[int] | Tensor, *, context: int | None = None,
               stride: int | None = None) -> Evaluation:
    """Loss and perplexity of ``model`` on the token ids ``ids`` (a list or a 1-D tensor, at least
    2 tokens), read in contexts of ``context`` tokens (default: the model's ``block_size``) that
    start every ``stride`` tokens (default: ``context``, disjoint contexts; at most ``context``).

    Runs under ``torch.inference_mode()`` in eval mode, on the model's device, and leaves the
    model in the train or eval mode it was in.
    """
    context = model.config.block_size if context is None else _validate.positive_int("context", context)
    stride = context if stride is None else _validate.positive_int("stride", stride)
    if stride > context:
        raise ValueError(f"stride={stride} is larger than context={context}: the tokens between two contexts "
                         f"would never be predicted")
    if model.max_positions is not None and context > model.max_positions:
        raise ValueError(f"context={context} is longer than the model reads (block_size={model.max_positions})")
    ids = torch.as_tensor(ids)  # (N,)
    if ids.dim() != 1 or (len(ids) and not _validate.is_integer(ids)):
        raise TypeError(f"ids must be a 1-D sequence of token ids, got {ids.dtype} of shape {tuple(ids.shape)}")
    if len(ids) < 2:
        raise ValueError(f"a perplexity needs at least 2 tokens (one read, one predicted), got {len(ids)}")
    ids = ids.to(device=next(model.parameters()).device, dtype=torch.long)
    n = len(ids)
    nll, tokens, contexts, prev_end = 0.0, 0, 0, 0
    was_training = model.training
    model.eval()
    try:
        with torch.inference_mode():
            last = max(0, -(-(n - context) // stride))  # the index of the first context that reaches the end
            for begin in progress.track(range(0, n, stride), "perplexity", total=last + 1, unit="context"):
                end = min(begin + context, n)
                x, y = ids[begin:end - 1], ids[begin + 1:end].clone()  # (T,) tokens, (T,) the next token of each
                seen = max(prev_end, begin + 1) - begin - 1  # targets an earlier context predicted
                y[:seen] = IGNORE
                if len(y) > seen:  # a last context of one token predicts nothing
                    _, loss = model(x[None], y[None])  # (1, T), (1, T): the mean over the unmasked targets
                    nll += loss.item() * (len(y) - seen)
                    tokens += len(y) - seen
                    contexts += 1
                prev_end = end
                if end == n:
                    break
    finally:
        model.train(was_training)
    loss = nll / tokens
    return Evaluation(loss=loss, perplexity=math.exp(loss), tokens=tokens,
                      contexts=contexts, context=context, stride=stride)


def masked_perplexity(model: GPT, sequences: Sequence[tuple[Sequence[int], Sequence[int]]]) -> MaskedEvaluation:
    """Loss and perplexity of ``model`` over the targets of ``sequences``, pairs ``(ids, targets)`` of
    equally long lists (or 1-D tensors) of at most ``block_size`` tokens, ``targets[t]`` the token
    position t predicts or -100 (none); each sequence is one forward. Raises ``ValueError`` when no
    sequence has a target. Runs as :func:`perplexity` does (inference mode, eval mode, the model's
    device, its mode given back)."""
    device = next(model.parameters()).device
    nll, tokens = 0.0, 0
    was_training = model.training
    model.eval()
    try:
        with torch.inference_mode():
            for ids, targets in sequences:
                x = torch.as_tensor(ids, dtype=torch.long, device=device)[None]  # (1, T)
                y = torch.as_tensor(targets, dtype=torch.long, device=device)[None]  # (1, T)
                n = int((y != IGNORE).sum())
                if n:
                    nll += model(x, y)[1].item() * n  # the mean over the n targets, times n
                    tokens += n
    finally:
        model.train(was_training)
    if not tokens:
        raise ValueError(f"none of the {len(sequences)} sequence(s) has a target (all -100): nothing to measure")
    loss = nll / tokens
    return MaskedEvaluation(loss=loss, perplexity=math.exp(loss), tokens=tokens, sequences=len(sequences))
