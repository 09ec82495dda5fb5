"""The continuous-batching scheduler: one thread runs the model for every job, a step at a time.

Each step of the loop, at its boundary:

1. cancelled rows leave (their caches are dropped at once);
2. waiting jobs join while there are free rows (up to ``max_batch``): each is prefilled alone into
   a cache of its own (:func:`~selfattn.serve.rows.prefill`);
3. every row chooses its next token from its logits (:func:`~selfattn.generation.sampling.next_token`
   on its own row, with its own generator) and sends it; a row that produced a stop token or string,
   or its ``max_new`` tokens, finishes and leaves;
4. the rows still running decode their tokens together, one forward for all
   (:func:`~selfattn.serve.rows.decode_step`).

So a job joins at the next boundary after it arrives and leaves as soon as it is done, whatever the
others do; a greedy job yields the tokens it would alone (:mod:`selfattn.serve.rows` says where
this holds), and a seeded sampled one the same draws. More jobs than rows wait in a queue of
``queue`` places; past it :meth:`Engine.submit` refuses (:class:`Busy`). A prompt's prefill runs
whole, between two steps: the running rows wait for it.

The server's event loop talks to the thread through :meth:`Engine.submit` and :meth:`Engine.cancel`
(thread-safe) and hears back through each job's ``emit`` (:mod:`selfattn.serve.jobs`).
"""
from __future__ import annotations

import threading
from collections import deque
from dataclasses import dataclass

import torch
from torch import Tensor

from selfattn._util.validate import count, one_line
from selfattn.generation.layout import FEW
from selfattn.generation.sampling import next_token
from selfattn.model import GPT
from selfattn.serve import logprobs
from selfattn.serve.jobs import Failed, Finished, Job, Prompt, Token
from selfattn.serve.rows import RowCache, decode_step, prefill, prepare


class Busy(Exception):
    """Every row is taken and the queue is full: try again later."""


@dataclass
class Stats:
    """What the engine has done: decode ``steps`` run, ``row_steps`` the rows they decoded in all,
    ``most_rows`` the most in one step; ``jobs`` finished."""
    steps: int = 0
    row_steps: int = 0
    most_rows: int = 0
    jobs: int = 0


class _Row:
    """A job's row while it runs: its cache, the logits of its next token ``(V,)``, its tokens so far."""

    def __init__(self, job: Job, cache: RowCache, logits: Tensor, device: torch.device):
        self.job, self.cache, self.logits, self.tokens = job, cache, logits, []
        self.generator = None
        if job.sampling.temperature > 0:
            self.generator = torch.Generator(device)
            if job.sampling.seed is None:
                self.generator.seed()
            else:
                self.generator.manual_seed(job.sampling.seed)


class Engine:
    """Continuous batching over ``model`` (prepared in place: :func:`~selfattn.serve.rows.prepare`):
    up to ``max_batch`` rows (1 .. :data:`~selfattn.generation.layout.FEW`: the most whose products
    keep each row's bits) decode together, ``queue`` more jobs wait. :meth:`start` starts its thread,
    :meth:`stop` ends it."""

    def __init__(self, model: GPT, *, max_batch: int = 8, queue: int = 64):
        if not (isinstance(max_batch, int) and not isinstance(max_batch, bool) and 1 <= max_batch <= FEW):
            raise ValueError(f"max_batch must be an int in 1..{FEW} (the most rows whose products keep each "
                             f"row's bits), got {max_batch!r}")
        self.queue = count("queue", queue)
        self.model, self.max_batch = prepare(model), max_batch
        self.device = model.wte.weight.device
        self.stats = Stats()
        self._waiting: deque[Job] = deque()
        self._running = 0  # jobs taken from the queue and not yet finished
        self._stopping = False
        self._wake = threading.Condition()
        self._thread = threading.Thread(target=self._loop, name="selfattn-serve-engine", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self, timeout: float = 30.0) -> bool:
        """Cancel every job, running or waiting, and end the thread at its next step boundary (within
        ``timeout`` seconds); whether it ended. The server drains its requests before calling this."""
        with self._wake:
            self._stopping = True
            for job in self._waiting:
                job.cancelled = True
            self._waiting.clear()
            self._wake.notify()
        if self._thread.is_alive():
            self._thread.join(timeout)
        return not self._thread.is_alive()

    def submit(self, jobs: list[Job]) -> None:
        """Queue ``jobs`` (all or none): :class:`Busy` when the rows and the queue cannot take them all,
        RuntimeError once stopped."""
        with self._wake:
            if self._stopping:
                raise RuntimeError("the engine has stopped")
            if self._running + len(self._waiting) + len(jobs) > self.max_batch + self.queue:
                raise Busy(f"{self._running} rows run and {len(self._waiting)} jobs wait (at most "
                           f"{self.max_batch} and {self.queue})")
            self._waiting.extend(jobs)
            self._wake.notify()

    def cancel(self, job: Job) -> None:
        """Stop ``job``: it leaves its row (or the queue) at the next step boundary and hears nothing more."""
        with self._wake:
            job.cancelled = True
            if job in self._waiting:
                self._waiting.remove(job)

    def load(self) -> dict:
        """Rows running, jobs waiting, and :class:`Stats`, as a JSON-ready dict."""
        with self._wake:
            return {"rows": self._running, "waiting": len(self._waiting), "max_batch": self.max_batch,
                    "queue": self.queue, **vars(self.stats)}

    def _loop(self) -> None:
        rows: list[_Row] = []
        with torch.inference_mode():
            while True:
                with self._wake:
                    while not (self._waiting or rows or self._stopping):
                        self._wake.wait()
                    if self._stopping:
                        return
                    joining = [self._waiting.popleft() for _ in range(min(len(self._waiting),
                                                                          self.max_batch - len(rows)))]
                    self._running += len(joining)
                rows = [row for row in rows if not row.job.cancelled]
                rows += [row for row in map(self._join, joining) if row is not None]
                rows = [row for row in rows if self._advance(row)]
                if rows:
                    self._step(rows)
                with self._wake:
                    self._running = len(rows)

    def _join(self, job: Job) -> _Row | None:
        """Prefill ``job``'s prompt alone into a cache of its own: its row, or None when it needs no
        row (cancelled, failed, or nothing to generate)."""
        if job.cancelled:
            return None
        try:
            cache = RowCache(self.model, max(len(job.ids), len(job.ids) + job.max_new - 1))
            h = prefill(self.model, job.ids, cache)  # (1, T, C)
            if job.prompt_logprobs is not None:
                self._send(job, Prompt(job.ids, *logprobs.of_prompt(self.model, h, job.ids, job.prompt_logprobs)))
            if job.max_new == 0:
                self._finish(job, "length", 0)
                return None
            return _Row(job, cache, self.model.logits(h[:, -1])[0], self.device)  # (V,) as generate computes it
        except Exception as e:  # a job the model fails on fails alone; the server goes on
            self._send(job, Failed(one_line(e)))
            return None

    def _advance(self, row: _Row) -> bool:
        """Choose ``row``'s next token and send it; whether the row goes on."""
        job = row.job
        if job.cancelled:
            return False
        try:
            s = job.sampling
            token = int(next_token(row.logits[None], temperature=s.temperature, top_k=s.top_k, top_p=s.top_p,
                                   generator=row.generator))  # (1, V) -> (1,)
            row.tokens.append(token)
            stop = token in job.stop_tokens  # sent too (its log-probability counts), without its text
            picked = (None, None) if job.logprobs is None else \
                logprobs.chosen(row.logits[None], torch.tensor([token], device=self.device), job.logprobs)[0]
            self._send(job, Token(token, "" if stop else job.text.push(token), *picked))
        except Exception as e:  # a token the tokenizer cannot write, say: the job fails alone
            self._send(job, Failed(one_line(e)))
            return False
        if stop or job.text.stopped or len(row.tokens) == job.max_new:
            self._finish(job, "stop" if stop or job.text.stopped else "length", len(row.tokens))
            return False
        return not job.cancelled

    def _step(self, rows: list[_Row]) -> None:
        """Decode the last token of every row in one forward; a failure fails them all."""
        try:
            tokens = torch.tensor([row.tokens[-1] for row in rows], device=self.device)  # (B,)
            logits = decode_step(self.model, tokens, [row.cache for row in rows])  # (B, V)
        except Exception as e:  # the rows fail, the server goes on
            for row in rows:
                self._send(row.job, Failed(one_line(e)))
                row.job.cancelled = True
            return
        for row, row_logits in zip(rows, logits):
            row.logits = row_logits
        self.stats.steps += 1
        self.stats.row_steps += len(rows)
        self.stats.most_rows = max(self.stats.most_rows, len(rows))

    def _finish(self, job: Job, reason: str, generated: int) -> None:
        """Send ``job``'s last event: its row leaves."""
        self._send(job, Finished(reason, job.text.flush(), len(job.ids), generated))
        self.stats.jobs += 1

    @staticmethod
    def _send(job: Job, event) -> None:
        """``job.emit(event)``; a job whose listener has gone (its event loop closed) is cancelled."""
        try:
            job.emit(event)
        except RuntimeError:
            job.cancelled = True
