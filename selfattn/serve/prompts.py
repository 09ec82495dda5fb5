"""From a checked request to what the engine runs: the prompt's token ids (a chat written with the
model's chat template, or completion prompts as text or ids) and how many tokens it may generate."""
from __future__ import annotations

from selfattn.io.loading import Loaded
from selfattn.serve.errors import APIError
from selfattn.serve.schemas import ChatRequest, CompletionRequest, Message
from selfattn.tokenizers.chat import text_messages

COMPLETION_TOKENS = 16  # a completion's max_tokens when not given, as OpenAI's; a chat's is the context left


def chat_ids(loaded: Loaded, messages: list[Message]) -> list[int]:
    """The conversation written with the model's chat template, as token ids (a generation prompt
    after it, as ``selfattn sample --chat`` writes it); 400 for a part that is not text, a role the
    template does not write, or a conversation it refuses."""
    if loaded.chat is None:
        raise APIError(400, f"messages: this model ({loaded.source.name}) has no chat template; use /v1/completions",
                       param="messages")
    try:
        text = loaded.chat.render(text_messages([m.model_dump() for m in messages]), add_generation_prompt=True)
    except (ValueError, TypeError) as e:
        raise APIError(400, f"messages: {e}", param="messages") from None
    return loaded.require_tokenizer().encode(text)


def completion_prompts(prompt) -> list:
    """The prompts of a completion request's ``prompt``: a string or a list of token ids is one
    prompt, a list of either several."""
    if isinstance(prompt, str) or prompt and all(isinstance(p, int) for p in prompt):
        return [prompt]
    if not prompt:
        raise APIError(400, "prompt: an empty list holds no prompt", param="prompt")
    return list(prompt)


def completion_ids(loaded: Loaded, prompts: list) -> list[list[int]]:
    """Each of :func:`completion_prompts` as token ids, text encoded as ``selfattn sample --prompt``
    encodes it; 400 for a prompt of no token or of ids outside the vocabulary."""
    tokenizer, vocab = loaded.require_tokenizer(), loaded.model.config.vocab_size
    ids = [tokenizer.encode(p, special=True) if isinstance(p, str) else list(p) for p in prompts]
    for i, prompt in enumerate(ids):
        if not prompt:
            raise APIError(400, f"prompt[{i}]: encodes to no token", param="prompt")
        bad = [t for t in prompt if not 0 <= t < vocab]
        if bad:
            raise APIError(400, f"prompt[{i}]: token ids must be in [0, {vocab}), got {bad[:4]}", param="prompt")
    return ids


def new_tokens(loaded: Loaded, request: ChatRequest | CompletionRequest, prompt_len: int, param: str) -> int:
    """How many tokens a prompt of ``prompt_len`` tokens may generate: what the request asks
    (``max_completion_tokens``, else ``max_tokens``, else the default) cut to the context left, so
    that it ends with ``finish_reason`` "length" where the context ends; 400 when the prompt alone
    is longer than the model's context."""
    model = loaded.model
    limit = model.max_positions  # None: sliding windows only, no limit
    if limit is not None and prompt_len > limit:
        raise APIError(400, f"{param}: the prompt is {prompt_len} tokens, longer than the model's context of "
                            f"{limit} tokens", param=param, code="context_length_exceeded")
    room = None if limit is None else limit - prompt_len + 1  # the last new token is never fed back
    asked = getattr(request, "max_completion_tokens", None)
    asked = request.max_tokens if asked is None else asked
    if asked is None:
        asked = COMPLETION_TOKENS if isinstance(request, CompletionRequest) else room or model.config.block_size
    return asked if room is None else min(asked, room)
