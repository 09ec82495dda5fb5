"""What a request may say, and how its body is read: at most :data:`MAX_BODY` bytes of one JSON object,
checked field by field (:func:`parse`), fields the server does not know ignored.

Types are strict, as OpenAI's are: ``"max_tokens": "5"`` or ``"stream": 1`` are refused, naming the
field, not converted. A field the server knows but cannot honour (``n`` > 1, ``tools``, penalties) is
refused too (:func:`refuse_unsupported`), not ignored.
"""
from __future__ import annotations

import json

from pydantic import BaseModel, ConfigDict, Field, ValidationError
from starlette.requests import Request

from selfattn.serve.errors import APIError

MAX_BODY = 1 << 20  # bytes of a request body: 1 MiB, some 250 K tokens of text; a longer body is answered 413


class _Body(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)


class StreamOptions(_Body):
    include_usage: bool | None = None


class Generating(_Body):
    """The fields both generation endpoints take; None: the default."""
    model: str | None = None
    max_tokens: int | None = Field(None, ge=0)
    temperature: float | None = Field(None, ge=0, le=2, allow_inf_nan=False)
    top_p: float | None = Field(None, gt=0, le=1, allow_inf_nan=False)
    top_k: int | None = Field(None, gt=0)  # not OpenAI's: vLLM's and llama-server's
    seed: int | None = Field(None, ge=-(1 << 63), lt=1 << 64)  # what torch.Generator.manual_seed takes
    stop: str | list[str] | None = None
    n: int | None = Field(None, ge=1)
    stream: bool | None = None
    stream_options: StreamOptions | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    logit_bias: dict[str, float] | None = None

    def stops(self) -> tuple[str, ...]:
        """The stop strings, empty ones left out."""
        stops = [self.stop] if isinstance(self.stop, str) else self.stop or []
        return tuple(s for s in stops if s)

    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)


class Message(_Body):
    """A chat message; its role and parts are checked as ``train`` checks a chat file's
    (:func:`selfattn.tokenizers.chat.text_messages`, the template's roles)."""
    role: str
    content: str | list[dict]  # a string, or text parts: [{"type": "text", "text": ...}]


class ChatRequest(Generating):
    messages: list[Message] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=0)
    logprobs: bool | None = None
    top_logprobs: int | None = Field(None, ge=0, le=20)
    tools: list | None = None
    functions: list | None = None
    response_format: dict | None = None


class CompletionRequest(Generating):
    prompt: str | list[str] | list[int] | list[list[int]]
    logprobs: int | None = Field(None, ge=0, le=20)
    echo: bool | None = None
    best_of: int | None = Field(None, ge=1)
    suffix: str | None = None


class TokenizeRequest(_Body):
    prompt: str | None = None
    messages: list[Message] | None = None
    add_special_tokens: bool | None = None


class DetokenizeRequest(_Body):
    tokens: list[int]


def refuse_unsupported(request: Generating) -> None:
    """An :class:`APIError` naming the first field set to something this server does not do."""
    refused = [("n", request.n not in (None, 1), "only n=1 is served; send the request n times"),
               ("presence_penalty", bool(request.presence_penalty), "penalties are not served"),
               ("frequency_penalty", bool(request.frequency_penalty), "penalties are not served"),
               ("logit_bias", bool(request.logit_bias), "logit_bias is not served")]
    if isinstance(request, ChatRequest):
        refused += [("tools", bool(request.tools), "tools are not served"),
                    ("functions", bool(request.functions), "functions are not served"),
                    ("response_format", (request.response_format or {}).get("type", "text") != "text",
                     "only a response_format of type 'text' is served")]
    if isinstance(request, CompletionRequest):
        refused += [("best_of", request.best_of not in (None, 1), "only best_of=1 is served"),
                    ("suffix", bool(request.suffix), "suffix (insertion) is not served")]
    for name, bad, why in refused:
        if bad:
            raise APIError(400, f"{name}: {why}, got {getattr(request, name)!r}", param=name)


async def read_json(request: Request) -> dict:
    """The body as a JSON object: 413 past :data:`MAX_BODY` bytes (the body is read to its end but
    not kept, so that the client reads the answer), 400 when it is not a JSON object."""
    size, chunks = 0, []
    async for chunk in request.stream():
        size += len(chunk)
        if size <= MAX_BODY:
            chunks.append(chunk)
    if size > MAX_BODY:
        raise APIError(413, f"the request body holds {size} bytes, more than the {MAX_BODY} this server reads",
                       code="request_too_large")
    try:
        body = json.loads(b"".join(chunks))
    except ValueError as e:  # JSONDecodeError and UnicodeDecodeError
        raise APIError(400, f"the request body is not valid JSON: {e}") from None
    if not isinstance(body, dict):
        raise APIError(400, f"the request body must be a JSON object, got {type(body).__name__}")
    return body


def parse(schema: type[_Body], body: dict) -> _Body:
    """``body`` checked against ``schema``; the first fault as an :class:`APIError` naming its field."""
    try:
        return schema.model_validate(body)
    except ValidationError as e:
        error = e.errors(include_url=False)[0]
        param = _param(error["loc"], schema)
        got = "" if error["type"] == "missing" else f", got {json.dumps(error['input'])[:80]}"
        raise APIError(400, f"{param}: {error['msg']}{got}", param=param) from None


def _param(loc: tuple, schema: type[_Body]) -> str:
    """The field at ``loc`` as OpenAI names it (``messages[0].content``): list indices in brackets;
    the names pydantic adds for the alternatives of a union left out."""
    fields = {name for model in (schema, Message, StreamOptions) for name in model.model_fields}
    param = str(loc[0])
    for part in loc[1:]:
        if isinstance(part, int):
            param += f"[{part}]"
        elif part in fields:
            param += f".{part}"
    return param
