"""The API key every request must carry when the server has one: ``Authorization: Bearer KEY``,
else 401 before any route runs (unknown paths and ``/health`` included)."""
from __future__ import annotations

import hmac

from selfattn.serve.errors import APIError


class RequireKey:
    """ASGI middleware: passes on HTTP requests that carry ``key``, answers the others 401."""

    def __init__(self, app, key: str):
        if not isinstance(key, str) or not key:
            raise ValueError(f"the API key must be a non-empty string, got {key!r}")
        self.app, self._expected = app, f"Bearer {key}".encode()

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] == "http":
            given = dict(scope["headers"]).get(b"authorization", b"")
            if not hmac.compare_digest(given, self._expected):
                error = APIError(401, "a valid API key is needed: send the header 'Authorization: Bearer KEY'",
                                 code="invalid_api_key")
                await error.response()(scope, receive, send)
                return
        await self.app(scope, receive, send)
