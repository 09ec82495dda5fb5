"""Text from a model as it comes: :func:`new_tokens` generates past the model's ``block_size`` by
sliding the context, and :func:`text_pieces` turns tokens into text: a character whose UTF-8 bytes
span several tokens is emitted whole once its last byte arrives.
"""
from __future__ import annotations

import codecs
from collections.abc import Iterable, Iterator

import torch

from selfattn.generation.generate import generate
from selfattn.model import GPT


def new_tokens(model: GPT, ids: list[int], max_new_tokens: int, **sampling) -> Iterator[int]:
    """New tokens of ``model`` (a :class:`~selfattn.model.GPT`) one at a time after ``ids``.
    Past ``block_size`` the context slides: it is cut to its last half and read again (a model
    without a position limit, ``max_positions`` None, just goes on)."""
    device = model.wte.weight.device
    if model.max_positions is None:
        for token in generate(model, torch.tensor([list(ids)], device=device), max_new_tokens, **sampling):
            yield int(token)
        return
    block = model.config.block_size
    context = list(ids)
    remaining = max_new_tokens
    while remaining > 0:
        if len(context) >= block:
            context = context[-(block // 2):]  # keep the last half; the model reads it afresh
        n = min(remaining, block - len(context) + 1)  # the last new token is never fed back
        for token in generate(model, torch.tensor([context], device=device), n, **sampling):
            context.append(int(token))
            yield context[-1]
        remaining -= n


def text_pieces(tokenizer, tokens: Iterable[int]) -> Iterator[str]:
    """One string per token: the characters its bytes complete (possibly ""), then whatever an
    unfinished character at the end decodes to. Invalid UTF-8 becomes U+FFFD."""
    decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
    for token in tokens:
        yield decoder.decode(tokenizer.token_bytes(token))
    tail = decoder.decode(b"", final=True)
    if tail:
        yield tail
