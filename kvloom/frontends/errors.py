"""The error every frontend raises for a request that fails, in HTTP's terms."""

from __future__ import annotations


class RequestError(Exception):
    """A request that fails; ``status`` follows HTTP (400 bad input, 404 unknown model, 408 timeout,
    413 body too large, 429 too many in flight, 503 engine unavailable) and ``param`` names the
    offending field."""

    def __init__(self, status: int, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
