"""One request's jobs in flight: submitted to the engine, their events carried from the engine's
thread into the request's event loop, cancelled when the request ends early (the client left, the
server stopped waiting)."""
from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable

from selfattn.serve.engine import Busy, Engine
from selfattn.serve.errors import APIError
from selfattn.serve.jobs import Failed, Finished, Job

RETRY_AFTER = 1  # seconds a request refused for a full queue is told to wait (the Retry-After header)


class Channel:
    """The jobs of one request (numbered 0, 1, ... as its choices); made inside its event loop."""

    def __init__(self, engine: Engine):
        self.engine, self.jobs = engine, []
        self._loop, self._queue = asyncio.get_running_loop(), asyncio.Queue()

    def emitter(self, index: int) -> Callable[[object], None]:
        """The ``emit`` of job ``index``: called in the engine's thread, queues the event in the loop's
        (a RuntimeError once the loop has closed, which cancels the job)."""
        def emit(event) -> None:
            self._loop.call_soon_threadsafe(self._queue.put_nowait, (index, event))
        return emit

    def submit(self, jobs: list[Job]) -> None:
        """Hand ``jobs`` to the engine: 503 with Retry-After when its rows and queue are full or it has stopped."""
        try:
            self.engine.submit(jobs)
        except Busy as e:
            raise APIError(503, f"the server is busy ({e}); retry later", code="server_busy",
                           headers={"Retry-After": str(RETRY_AFTER)}) from None
        except RuntimeError as e:
            raise APIError(503, f"the server is shutting down ({e})", code="shutting_down") from None
        self.jobs = jobs

    async def events(self) -> AsyncIterator[tuple[int, object]]:
        """``(job index, event)`` as they come, until every job has finished or failed."""
        running = len(self.jobs)
        while running:
            index, event = await self._queue.get()
            running -= isinstance(event, (Finished, Failed))
            yield index, event

    def cancel(self) -> None:
        """Cancel every job still running (finished ones are not affected)."""
        for job in self.jobs:
            self.engine.cancel(job)
