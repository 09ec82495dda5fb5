"""Running the app on uvicorn: a socket bound before the model's first request (so that a port in use
is an error at once), and a stop on SIGTERM or Ctrl-C that drains the requests in flight (for up to
:data:`DRAIN_SECONDS`, then cancels the rest) and returns, so that the command exits 0. A second
Ctrl-C stops at once."""
from __future__ import annotations

import contextlib
import signal
import socket
import threading

try:
    import uvicorn
except ImportError as e:  # the optional extra is missing
    raise ImportError("selfattn serve needs FastAPI and uvicorn: pip install 'selfattn[serve]'") from e

DRAIN_SECONDS = 30  # how long a stopping server waits for its requests in flight before cancelling them
BACKLOG = 2048  # connections the kernel queues before the app accepts them (uvicorn's default)


def listen(host: str, port: int) -> socket.socket:
    """A TCP socket bound to ``host`` and ``port`` (0: a free port; ``getsockname()`` tells which) and
    listening: a client that connects before the server runs waits in the backlog instead of being
    refused."""
    if not isinstance(port, int) or not 0 <= port <= 65535:
        raise ValueError(f"port must be in 0..65535, got {port!r}")
    try:
        family, kind, proto, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
    except socket.gaierror as e:
        raise ValueError(f"host {host!r} cannot be resolved: {e}") from None
    sock = socket.socket(family, kind, proto)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind(address)
        sock.listen(BACKLOG)
    except OSError as e:
        sock.close()
        raise OSError(f"cannot listen on {host}:{port}: {e.strerror}") from None
    return sock


class Server(uvicorn.Server):
    """uvicorn's server (``Server(uvicorn.Config(app, ...)).run(sockets=[sock])``), whose SIGTERM and
    SIGINT stop it and return (uvicorn would raise the signal again once stopped, and the process
    would die of it)."""

    @contextlib.contextmanager
    def capture_signals(self):
        if threading.current_thread() is not threading.main_thread():  # signals reach the main thread only
            yield
            return

        def stop(signum, frame) -> None:
            self.force_exit = self.should_exit  # the second signal: stop at once
            self.should_exit = True

        previous = {sig: signal.signal(sig, stop) for sig in (signal.SIGINT, signal.SIGTERM)}
        try:
            yield
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)


def server(app, *, log_level: str = "info") -> Server:
    """A :class:`Server` for ``app`` that drains for :data:`DRAIN_SECONDS` when stopped."""
    config = uvicorn.Config(app, timeout_graceful_shutdown=DRAIN_SECONDS, backlog=BACKLOG, log_level=log_level,
                            lifespan="on")
    return Server(config)
