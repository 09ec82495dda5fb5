"""The HTTP face of the server: an ASGI app (FastAPI) over one :class:`~selfattn.serve.engine.Engine`.

Routes: ``POST /v1/chat/completions`` and ``POST /v1/completions`` (OpenAI's, streamed as
server-sent events with ``"stream": true``), ``GET /v1/models``, ``GET /health`` (with the engine's
rows, queue and step counts), ``POST /tokenize``, ``POST /detokenize`` and ``GET /tokenizer_info``
(vLLM's, which lm-evaluation-harness reads to tokenize through the server). Every error is OpenAI's
error object (:mod:`selfattn.serve.errors`). The app starts the engine's thread when it starts and
stops it when it stops; a request whose client leaves cancels its jobs at once.
"""
from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

from selfattn.io.loading import Loaded
from selfattn.serve import prompts, schemas
from selfattn.serve.auth import RequireKey
from selfattn.serve.channel import Channel
from selfattn.serve.engine import Engine
from selfattn.serve.errors import APIError
from selfattn.serve.jobs import Failed, Finished, Job, Prompt, Sampling, Token
from selfattn.serve.responses import Answer, Writer, event
from selfattn.serve.stops import Detokenizer

try:
    from fastapi import FastAPI, Request
    from fastapi.responses import Response, StreamingResponse
    from starlette.exceptions import HTTPException
except ImportError as e:  # the optional extra is missing
    raise ImportError("selfattn serve needs FastAPI and uvicorn: pip install 'selfattn[serve]'") from e

GONE = 499  # the status of an answer whose client has left (nginx's "client closed request"): nobody reads it


def create_app(loaded: Loaded, engine: Engine, *, name: str, api_key: str | None = None) -> FastAPI:
    """The app serving ``loaded`` (its tokenizer, chat template and eos; its model is ``engine``'s)
    as the model ``name``; with ``api_key``, every request must carry it."""
    tokenizer = loaded.require_tokenizer()
    context = loaded.model.max_positions
    created = int(time.time())

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        engine.start()
        yield
        engine.stop()

    app = FastAPI(title="selfattn", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None)
    app.state.engine = engine
    if api_key is not None:
        app.add_middleware(RequireKey, key=api_key)

    @app.exception_handler(APIError)
    async def api_error(request: Request, e: APIError):
        return e.response()

    @app.exception_handler(HTTPException)
    async def http_error(request: Request, e: HTTPException):  # no such route, or not with this method
        return APIError(e.status_code, f"{request.method} {request.url.path}: {e.detail}").response()

    @app.get("/health")
    async def health():
        return {"status": "ok", **engine.load()}

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": name, "object": "model", "created": created, "owned_by": "selfattn",
                                            "max_model_len": context}]}

    @app.post("/tokenize")
    async def tokenize(request: Request):
        body = schemas.parse(schemas.TokenizeRequest, await schemas.read_json(request))
        if (body.prompt is None) == (body.messages is None):
            raise APIError(400, "prompt or messages: send one of them", param="prompt")
        ids = prompts.chat_ids(loaded, body.messages) if body.messages is not None else \
            tokenizer.encode(body.prompt, special=body.add_special_tokens is not False)
        return {"tokens": ids, "count": len(ids), "max_model_len": context}

    @app.post("/detokenize")
    async def detokenize(request: Request):
        body = schemas.parse(schemas.DetokenizeRequest, await schemas.read_json(request))
        try:
            return {"prompt": tokenizer.decode(body.tokens)}
        except ValueError as e:
            raise APIError(400, f"tokens: {e}", param="tokens") from None

    @app.get("/tokenizer_info")
    async def tokenizer_info():
        def text(token: int | None) -> str | None:
            return None if token is None else tokenizer.token_bytes(token).decode("utf-8", errors="replace")
        return {"eos_token": text(loaded.eos[0] if loaded.eos else None), "bos_token": text(loaded.bos),
                "pad_token": None, "chat_template": loaded.chat and loaded.chat.source, "model_max_length": context}

    @app.post("/v1/chat/completions")
    async def chat(request: Request):
        body = schemas.parse(schemas.ChatRequest, await schemas.read_json(request))
        schemas.refuse_unsupported(body)
        ids = prompts.chat_ids(loaded, body.messages)
        channel, logprobs = Channel(engine), (body.top_logprobs or 0) if body.logprobs else None
        channel.submit([Job(ids, prompts.new_tokens(loaded, body, len(ids), "messages"), _sampling(body), loaded.eos,
                            Detokenizer(tokenizer, body.stops()), channel.emitter(0), logprobs=logprobs)])
        writer = Writer(name, tokenizer, "chatcmpl")
        if body.stream:
            return _sse_response(_chat_chunks(channel, writer, logprobs is not None, body.include_usage()))
        answers = await _answers(request, channel)
        return Response(status_code=GONE) if answers is None else writer.chat(answers[0], logprobs is not None)

    @app.post("/v1/completions")
    async def completions(request: Request):
        body = schemas.parse(schemas.CompletionRequest, await schemas.read_json(request))
        schemas.refuse_unsupported(body)
        given = prompts.completion_prompts(body.prompt)
        ids = prompts.completion_ids(loaded, given)
        channel, echo = Channel(engine), bool(body.echo)
        channel.submit([Job(p, prompts.new_tokens(loaded, body, len(p), "prompt"), _sampling(body), loaded.eos,
                            Detokenizer(tokenizer, body.stops()), channel.emitter(i), logprobs=body.logprobs,
                            prompt_logprobs=body.logprobs if echo else None) for i, p in enumerate(ids)])
        echoed = [(p if isinstance(p, str) else tokenizer.decode(i)) if echo else "" for p, i in zip(given, ids)]
        writer = Writer(name, tokenizer, "cmpl")
        if body.stream:
            return _sse_response(_completion_chunks(channel, writer, echoed, body.logprobs is not None,
                                                body.include_usage()))
        answers = await _answers(request, channel)
        if answers is None:
            return Response(status_code=GONE)
        return writer.completion(answers, [e + a.text for e, a in zip(echoed, answers)], body.logprobs is not None)

    return app


def _sampling(body: schemas.Generating) -> Sampling:
    temperature = 1.0 if body.temperature is None else body.temperature  # OpenAI's default
    return Sampling(temperature, body.top_k, body.top_p, body.seed)


async def _answers(request: Request, channel: Channel) -> list[Answer] | None:
    """Every job's answer once all are done; None when the client left first (its jobs are then
    cancelled); 500 when the model failed on one."""
    answers = [Answer() for _ in channel.jobs]

    async def gather() -> None:
        async for index, e in channel.events():
            answers[index].add(e)

    gathering, leaving = asyncio.ensure_future(gather()), asyncio.ensure_future(_disconnected(request))
    try:
        await asyncio.wait({gathering, leaving}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        leaving.cancel()
        if not gathering.done():
            gathering.cancel()
            channel.cancel()
    failed = [a.failure for a in answers if a.failure]
    if failed:
        raise APIError(500, f"the model failed: {failed[0]}", code="generation_failed")
    return answers if gathering.done() and not gathering.cancelled() else None


async def _disconnected(request: Request) -> None:
    """Returns when the client has gone (the body is read by then: what comes next is the disconnect)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


def _sse_response(chunks: AsyncIterator[str]) -> StreamingResponse:
    return StreamingResponse(chunks, media_type="text/event-stream", headers={"Cache-Control": "no-cache"})


async def _chat_chunks(channel: Channel, writer: Writer, logprobs: bool, include_usage: bool) -> AsyncIterator[str]:
    """A chat answer's chunks: the role, then each token's text (and log-probabilities), the finish
    reason, the usage when asked for, ``[DONE]``. The client leaving cancels the job."""
    answer = Answer()
    try:
        yield event(writer.chat_chunk({"role": "assistant", "content": ""}))
        async for _, e in channel.events():
            text = answer.add(e)
            if isinstance(e, Failed):
                yield event(APIError(500, f"the model failed: {e.message}", code="generation_failed").body())
                break
            lp = writer.chat_logprobs([e.id], [e.logprob], [e.top]) if logprobs and isinstance(e, Token) else None
            if text or lp:
                yield event(writer.chat_chunk({"content": text}, logprobs=lp))
            if isinstance(e, Finished):
                yield event(writer.chat_chunk({}, reason=e.reason))
        if include_usage:
            yield event(writer.chunk_with_usage("chat.completion.chunk", [answer]))
        yield event("[DONE]")
    finally:
        channel.cancel()


async def _completion_chunks(channel: Channel, writer: Writer, echoed: list[str], logprobs: bool,
                             include_usage: bool) -> AsyncIterator[str]:
    """Completion chunks, each naming its choice: the echoed prompt first (with its log-probabilities
    when asked for), each token's text, each choice's finish reason, the usage when asked for, ``[DONE]``."""
    answers = [Answer() for _ in echoed]
    try:
        for index, text in enumerate(echoed):
            if text and not logprobs:  # with log-probabilities, the prompt comes with its own (a Prompt event)
                yield event(writer.completion_chunk(index, text))
        async for index, e in channel.events():
            text = answers[index].add(e)
            if isinstance(e, Failed):
                yield event(APIError(500, f"the model failed: {e.message}", code="generation_failed").body())
                break
            if isinstance(e, Prompt):
                yield event(writer.completion_chunk(index, echoed[index],
                                                    logprobs=writer.completion_logprobs(e.ids, e.logprobs, e.top)))
            elif isinstance(e, Token) and (text or logprobs):
                lp = writer.completion_logprobs([e.id], [e.logprob], [e.top]) if logprobs else None
                yield event(writer.completion_chunk(index, text, logprobs=lp))
            elif isinstance(e, Finished):
                yield event(writer.completion_chunk(index, text, reason=e.reason))
        if include_usage:
            yield event(writer.chunk_with_usage("text_completion", answers))
        yield event("[DONE]")
    finally:
        channel.cancel()
