"""``generate``: continue prompts token by token through the model's KV cache.

The prompt is prefilled once; then each step feeds the token just chosen and reads the next
logits (:class:`~selfattn.generation.steps.Steps`, compiled after
:func:`~selfattn.generation.compiled.compile_decode`), and :mod:`selfattn.generation.sampling`
chooses the next token. With ``speculative=``, a drafter proposes several tokens and one forward
checks them all (:mod:`selfattn.generation.speculative`).
"""
from __future__ import annotations

from collections.abc import Iterator

import torch
from torch import Tensor

from selfattn._util import validate as _validate
from selfattn.generation.sampling import check_sampling, next_token
from selfattn.generation.speculative import Speculative, resolve
from selfattn.generation.speculative import decode as speculative_decode
from selfattn.generation.steps import Steps, decode_cache, steps_of
from selfattn.model import GPT


def generate(model: GPT, idx: Tensor, max_new_tokens: int, *, temperature: float = 1.0, top_k: int | None = None,
             top_p: float | None = None, eos_token: int | None = None, generator: torch.Generator | None = None,
             attention_mask: Tensor | None = None,
             speculative: str | GPT | Speculative | None = None) -> Iterator[Tensor]:
    """Continue each prompt of ``idx`` with ``model``, one token a row per step.

    Args:
        model: a :class:`~selfattn.model.GPT`.
        idx: the prompts, ``(B, T)`` token ids.
        max_new_tokens: at most this many new tokens a row.
        temperature: 0 = greedy; otherwise logits / temperature, then ``top_k``, then
            ``top_p`` (see :mod:`selfattn.generation.sampling`), drawn with ``generator``.
        eos_token: a row that produces it is finished and yields ``eos_token`` from then on;
            the iterator stops early once every row has finished.
        attention_mask: ``(B, T)`` for left-padded prompts (the last column must be real);
            each row then generates what its prompt would alone.
        speculative: lossless speculative decoding (:mod:`selfattn.generation.speculative`): ``"lookup"``
            (prompt lookup), ``"self:N"`` (the first N blocks draft), a draft GPT of the same
            vocabulary, or a :class:`~selfattn.generation.speculative.Speculative` (to set the draft
            length and read its ``stats``). Greedy, the same tokens as without it; sampling, the
            same distribution.

    Returns:
        an iterator yielding one ``(B,)`` int64 tensor of new tokens per step, as they come.

    Arguments are checked here, before the first step. Decoding runs under
    ``torch.inference_mode`` in the model's current train/eval mode (call ``model.eval()``
    first when dropout is on). The prompt plus all but the last new token must fit in
    ``block_size``, except for sliding-window models without learned positions
    (``model.max_positions`` None), which decode through a rolling cache for as long as asked.
    """
    if not isinstance(model, GPT):
        raise TypeError(f"generate needs a selfattn GPT, got {type(model).__name__}")
    model.check_idx(idx)
    B, T = idx.shape
    _validate.count("max_new_tokens", max_new_tokens)
    check_sampling(temperature, top_k, top_p)
    vocab = model.config.vocab_size
    if eos_token is not None and (not isinstance(eos_token, int) or not 0 <= eos_token < vocab):
        raise ValueError(f"eos_token must be a token id in [0, {vocab}), got {eos_token!r}")
    total = T + max_new_tokens - 1  # positions the model sees: the last new token is never fed back
    if model.max_positions is not None and total > model.max_positions:
        raise ValueError(f"prompt of {T} tokens + {max_new_tokens} new tokens needs {total} positions, "
                         f"more than block_size={model.config.block_size}")
    mask = None
    if attention_mask is not None:
        prompt_mask = model.check_attention_mask(attention_mask, B, T, idx.device)
        if not prompt_mask[:, -1].all():
            raise ValueError("generate needs left padding: the last prompt position of every row must be "
                             "a real token (attention_mask[:, -1] == 1)")
        if not prompt_mask.all():  # without padding the mask would only cost time
            mask = torch.ones(B, max(total, T), dtype=torch.bool, device=idx.device)  # (B, S_max)
            mask[:, :T] = prompt_mask
    sample = dict(temperature=temperature, top_k=top_k, top_p=top_p, generator=generator)
    if speculative is not None:
        spec = resolve(speculative, model, max(total, T))
        return speculative_decode(model, spec, idx, max_new_tokens, mask, eos_token, sample)
    return _decode(model, idx, max_new_tokens, mask, eos_token, sample)


@torch.inference_mode()
def _decode(model: GPT, idx: Tensor, max_new_tokens: int, mask: Tensor | None, eos_token: int | None,
            sample: dict) -> Iterator[Tensor]:
    """The generation loop over checked arguments; ``mask`` ``(B, S_max)`` or None."""
    if max_new_tokens == 0:
        return
    B, T = idx.shape
    step_logits = steps_of(model).step
    cache = decode_cache(model, B, T + max_new_tokens - 1)
    finished = None if eos_token is None else torch.zeros(B, dtype=torch.bool, device=idx.device)  # (B,)
    logits = Steps(model).step(idx, None if mask is None else mask[:, :T], cache, 0)  # (B, V) the prefill, eager
    for step in range(max_new_tokens):
        tok = next_token(logits, **sample)  # (B,)
        if finished is not None:
            tok = tok.masked_fill(finished, eos_token)
            finished |= tok == eos_token
        yield tok
        if step == max_new_tokens - 1 or (finished is not None and bool(finished.all())):
            return
        S = T + step + 1  # positions after feeding this token
        logits = step_logits(tok[:, None], None if mask is None else mask[:, :S], cache, S - 1)  # (B, V)
