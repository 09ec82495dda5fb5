"""The answers' JSON, as OpenAI writes it: a chat completion and its stream of chunks, a text
completion and its chunks, their ``logprobs`` and ``usage``; and the server-sent events that
carry a stream (``data: {...}`` lines, ``data: [DONE]`` last)."""
from __future__ import annotations

import json
import secrets
import time
from dataclasses import dataclass, field

from selfattn.serve.jobs import Alternatives, Failed, Finished, Prompt, Token


@dataclass
class Answer:
    """One choice as its events arrive (:meth:`add`): its text, tokens and their log-probabilities
    (the prompt's first when it asked for them), its finish reason and token counts."""
    text: str = ""
    tokens: list[int] = field(default_factory=list)
    logprobs: list[float | None] = field(default_factory=list)
    top: list[Alternatives | None] = field(default_factory=list)
    reason: str | None = None
    prompt_tokens: int = 0
    completion_tokens: int = 0
    failure: str | None = None

    def add(self, event) -> str:
        """Take ``event`` (of :mod:`selfattn.serve.jobs`); the text it adds."""
        if isinstance(event, Token):
            self.tokens.append(event.id)
            self.logprobs.append(event.logprob)
            self.top.append(event.top)
            added = event.text
        elif isinstance(event, Prompt):
            self.tokens += event.ids
            self.logprobs += event.logprobs
            self.top += event.top
            added = ""
        elif isinstance(event, Finished):
            self.reason, self.prompt_tokens, self.completion_tokens = event.reason, event.prompt_tokens, \
                event.completion_tokens
            added = event.text
        else:
            assert isinstance(event, Failed), event
            self.failure, added = event.message, ""
        self.text += added
        return added


def usage(answers: list[Answer]) -> dict:
    prompt, completion = sum(a.prompt_tokens for a in answers), sum(a.completion_tokens for a in answers)
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}


class Writer:
    """Writes the answers of one request for model ``model`` with ``tokenizer`` (for the tokens'
    text in log-probabilities): its id and creation time are shared by every chunk."""

    def __init__(self, model: str, tokenizer, prefix: str):
        self.model, self.tokenizer = model, tokenizer
        self.id, self.created = f"{prefix}-{secrets.token_hex(12)}", int(time.time())

    def _head(self, kind: str) -> dict:
        return {"id": self.id, "object": kind, "created": self.created, "model": self.model}

    def token(self, token: int) -> str:
        """A token's text (bytes that are no whole character as U+FFFD)."""
        return self.tokenizer.token_bytes(token).decode("utf-8", errors="replace")

    # chat

    def chat(self, answer: Answer, logprobs: bool) -> dict:
        choice = {"index": 0, "message": {"role": "assistant", "content": answer.text},
                  "logprobs": self.chat_logprobs(answer.tokens, answer.logprobs, answer.top) if logprobs else None,
                  "finish_reason": answer.reason}
        return {**self._head("chat.completion"), "choices": [choice], "usage": usage([answer])}

    def chat_chunk(self, delta: dict, *, reason: str | None = None, logprobs: dict | None = None) -> dict:
        choice = {"index": 0, "delta": delta, "logprobs": logprobs, "finish_reason": reason}
        return {**self._head("chat.completion.chunk"), "choices": [choice]}

    def chat_logprobs(self, tokens: list[int], logprobs: list[float], top: list[Alternatives]) -> dict:
        def entry(token: int, logprob: float) -> dict:
            text = self.token(token)
            return {"token": text, "logprob": logprob, "bytes": list(self.tokenizer.token_bytes(token))}
        return {"content": [{**entry(t, lp), "top_logprobs": [entry(a, alp) for a, alp in alts]}
                            for t, lp, alts in zip(tokens, logprobs, top)]}

    # completions

    def completion(self, answers: list[Answer], texts: list[str], logprobs: bool) -> dict:
        """``texts``: each choice's text (its prompt first when echoed); ``answers[i].tokens`` likewise."""
        choices = [{"index": i, "text": text, "finish_reason": a.reason,
                    "logprobs": self.completion_logprobs(a.tokens, a.logprobs, a.top) if logprobs else None}
                   for i, (a, text) in enumerate(zip(answers, texts))]
        return {**self._head("text_completion"), "choices": choices, "usage": usage(answers)}

    def completion_chunk(self, index: int, text: str, *, reason: str | None = None,
                         logprobs: dict | None = None) -> dict:
        choice = {"index": index, "text": text, "logprobs": logprobs, "finish_reason": reason}
        return {**self._head("text_completion"), "choices": [choice]}

    def completion_logprobs(self, tokens: list[int], logprobs: list[float | None], top: list[Alternatives | None],
                            offset: int = 0) -> dict:
        """OpenAI's legacy form: each token's text, log-probability, alternatives as ``{text: logprob}``
        and where its text starts (from ``offset``)."""
        texts = [self.token(t) for t in tokens]
        starts = [offset + sum(len(t) for t in texts[:i]) for i in range(len(texts))]
        return {"tokens": texts, "token_logprobs": logprobs, "text_offset": starts,
                "top_logprobs": [None if alts is None else {self.token(a): lp for a, lp in alts} for alts in top]}

    def chunk_with_usage(self, kind: str, answers: list[Answer]) -> dict:
        """The last chunk of a stream that asked for usage: no choices, the usage."""
        return {**self._head(kind), "choices": [], "usage": usage(answers)}


def event(data: dict | str) -> str:
    """One server-sent event carrying ``data`` (a JSON object, or ``[DONE]``)."""
    return f"data: {data if isinstance(data, str) else json.dumps(data)}\n\n"
