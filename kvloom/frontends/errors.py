"""The error every frontend raises for a request that fails, in HTTP's terms."""

from __future__ import annotations

_REASONS = {400: "bad_request", 401: "unauthorized", 404: "bad_request", 408: "deadline", 413: "bad_request",
            429: "too_many_in_flight", 503: "unavailable"}


class RequestError(ValueError):
    """A request that fails; ``status`` follows HTTP (400 bad input, 401 wrong API key, 404 unknown
    model, 408 timeout, 413 body too large, 429 too many in flight, a full queue or a key's quota, 503
    engine unavailable) and ``param`` names the offending field. ``headers`` go on the response (e.g.
    Retry-After); ``reason`` labels the refusal in the metrics. A ValueError, as kvloom.LLM raises it.
    """

    def __init__(self, status: int, message: str, param: str | None = None, *,
                 headers: dict[str, str] | None = None, reason: str | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.headers = headers or {}
        self.reason = reason or _REASONS.get(status, "error")
