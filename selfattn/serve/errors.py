"""The server's errors, as OpenAI writes them: ``{"error": {"message", "type", "param", "code"}}``
with a 4xx or 5xx status. A message names the field at fault (``param``) and the value it got."""
from __future__ import annotations

from starlette.responses import JSONResponse

TYPES = {400: "invalid_request_error", 401: "authentication_error", 404: "not_found_error",
         405: "invalid_request_error", 413: "invalid_request_error", 503: "server_error", 500: "server_error"}


class APIError(Exception):
    """A request the server does not honour: ``status`` and ``message``, the field ``param`` at fault
    (None: none), a machine-readable ``code`` (None: none) and extra response ``headers``."""

    def __init__(self, status: int, message: str, *, param: str | None = None, code: str | None = None,
                 headers: dict[str, str] | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.code, self.headers = status, message, param, code, headers

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": TYPES.get(self.status, "invalid_request_error"),
                          "param": self.param, "code": self.code}}

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status, headers=self.headers)
