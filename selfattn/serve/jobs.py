"""What the server asks of the engine and what it hears back: a :class:`Job` (one prompt's tokens,
how to choose the next token and when to stop) and the events the engine sends about it.

The engine sends a job's events from its own thread through ``job.emit``, in this order: a
:class:`Prompt` first when the job asked for the prompt's log-probabilities, a :class:`Token` for
each token generated, and last one :class:`Finished` (or one :class:`Failed`). A job cancelled
(:meth:`~selfattn.serve.engine.Engine.cancel`) hears nothing more.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from selfattn.serve.stops import Detokenizer

Alternatives = tuple[tuple[int, float], ...]  # (token, log-probability), most probable first


@dataclass(frozen=True)
class Sampling:
    """How the next token is chosen: greedy at ``temperature`` 0, else drawn (``top_k``, ``top_p``:
    None keeps every token) with a generator seeded by ``seed`` (None: a fresh seed)."""
    temperature: float = 1.0
    top_k: int | None = None
    top_p: float | None = None
    seed: int | None = None


@dataclass(eq=False)
class Job:
    """One prompt to continue. ``max_new``: tokens to generate at most (0: none; the prompt's
    log-probabilities alone); ``stop_tokens``: tokens that end the answer (left out of it);
    ``text``: turns the tokens into text and ends it at a stop string; ``emit``: called from the
    engine's thread with each event. ``logprobs``: each generated token's log-probability and this
    many alternatives (None: none); ``prompt_logprobs``: the same for the prompt's tokens."""
    ids: list[int]
    max_new: int
    sampling: Sampling
    stop_tokens: tuple[int, ...]
    text: Detokenizer
    emit: Callable[[object], None]
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    cancelled: bool = field(default=False, init=False)  # set by Engine.cancel, read by the engine's thread


@dataclass(frozen=True)
class Token:
    """A generated token: its id, the text it lets out (possibly ""), and its log-probability and
    alternatives when the job asked for them (else None)."""
    id: int
    text: str
    logprob: float | None = None
    top: Alternatives | None = None


@dataclass(frozen=True)
class Prompt:
    """The prompt's tokens ``ids``, the log-probability of each given those before it, and its
    alternatives (None for the first token, which nothing predicts)."""
    ids: list[int]
    logprobs: list[float | None]
    top: list[Alternatives | None]


@dataclass(frozen=True)
class Finished:
    """The job is done: ``reason`` ``"stop"`` (a stop token or string) or ``"length"`` (``max_new``
    tokens); ``text`` is what the detokenizer still held; the counts are tokens."""
    reason: str
    text: str
    prompt_tokens: int
    completion_tokens: int


@dataclass(frozen=True)
class Failed:
    """The model failed on this job (a one-line message); no more events follow."""
    message: str
