"""What the server's tests share: a tiny chat model built in memory, and a server run in a thread of
the test's process on a free port of 127.0.0.1, stopped (and its engine with it) when the test ends."""
import contextlib
import threading
import time
from pathlib import Path

import torch

from selfattn.config import GPTConfig
from selfattn.generation import generate
from selfattn.io.loading import Loaded
from selfattn.serve import server
from selfattn.serve.app import create_app
from selfattn.serve.engine import Engine
from selfattn.serve.jobs import Failed, Finished, Token
from selfattn.tokenizers import ByteTokenizer
from selfattn.tokenizers.chat import ChatTemplate

from helpers.models import scrambled

TEMPLATE = ("{% for m in messages %}<{{ m.role }}>{{ m.content }}\n{% endfor %}"
            "{% if add_generation_prompt %}>{% endif %}")
EOS = 58  # the byte (":") that ends an answer of the tiny model: some answers end early, some do not
WAIT = 60.0  # seconds anything a test waits for may take (a server starting or stopping, a job, a row freed)


def tiny(**config) -> Loaded:
    """A random GPT reading bytes (vocab 256, context 96 unless ``config`` says otherwise) with a
    chat template: its answers are gibberish, each the model's own and reproducible (seed 0)."""
    torch.manual_seed(0)
    base = dict(vocab_size=256, block_size=96, n_layer=2, n_head=4, n_embd=32, pos="rope", n_kv_head=2)
    model = scrambled(GPTConfig(**{**base, **config}))
    return Loaded(model, ByteTokenizer(), 10, Path("tiny"), eos=(EOS,), chat=ChatTemplate(TEMPLATE, {}, "tiny"))


def chat_ids(loaded: Loaded, content: str) -> list[int]:
    return loaded.tokenizer.encode(loaded.chat.render([{"role": "user", "content": content}]))


def solo(model, ids: list[int], n: int, stops: tuple[int, ...] = (EOS,), **sampling) -> list[int]:
    """What ``generate`` yields for ``ids`` alone (greedy unless told), up to and with the first stop token."""
    out = []
    for token in generate(model, torch.tensor([ids]), n, **{"temperature": 0, **sampling}):
        out.append(int(token))
        if out[-1] in stops:
            break
    return out


class Collector:
    """A job's ``emit``: keeps its events; :meth:`wait` until it has finished (or ``tokens`` came)."""

    def __init__(self):
        self.events, self._changed = [], threading.Condition()

    def __call__(self, event) -> None:
        with self._changed:
            self.events.append(event)
            self._changed.notify_all()

    @property
    def tokens(self) -> list[int]:
        return [e.id for e in self.events if isinstance(e, Token)]

    @property
    def done(self) -> bool:
        return any(isinstance(e, (Finished, Failed)) for e in self.events)

    def wait(self, tokens: int | None = None) -> "Collector":
        with self._changed:
            assert self._changed.wait_for(lambda: self.done or tokens is not None and len(self.tokens) >= tokens,
                                          WAIT), "the job did not advance"
        return self


@contextlib.contextmanager
def serving(loaded: Loaded, *, max_batch: int = 4, queue: int = 8, api_key: str | None = None):
    """Serve ``loaded`` on a free port of 127.0.0.1 in a thread; yields ``(base_url, engine)``. On
    leaving, the server stops (draining) and the test fails if its thread or the engine's outlives it."""
    engine = Engine(loaded.model, max_batch=max_batch, queue=queue)
    app = create_app(loaded, engine, name="tiny", api_key=api_key)
    sock = server.listen("127.0.0.1", 0)
    srv = server.server(app, log_level="warning")
    thread = threading.Thread(target=srv.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + WAIT
    while not srv.started:
        assert thread.is_alive() and time.monotonic() < deadline, "the server did not start"
        time.sleep(0.02)
    try:
        yield f"http://127.0.0.1:{sock.getsockname()[1]}", engine
    finally:
        srv.should_exit = True
        thread.join(WAIT)
        assert not thread.is_alive(), "the server did not stop"
        assert not engine._thread.is_alive(), "the engine's thread did not stop"


def until(condition, what: str) -> None:
    """Wait (polling, up to :data:`WAIT` seconds) until ``condition()`` holds."""
    deadline = time.monotonic() + WAIT
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting until {what}"
        time.sleep(0.01)
