"""HTTP plumbing of the OpenAI server, apart from OpenAI's semantics: JSON and error responses in
OpenAI's shape, request bodies decoded with clear 400s, server-sent events that stop (and abort their
engine requests) when the client goes away."""

from __future__ import annotations

import asyncio
import re
from typing import Any, AsyncIterator, Awaitable, Callable

import msgspec
from starlette.requests import ClientDisconnect, Request
from starlette.responses import Response

from kvloom.frontends import openai_protocol as api
from kvloom.frontends.errors import RequestError
from kvloom.frontends.limits import check_json_depth, read_body

ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 404: "not_found_error",
               408: "timeout_error", 413: "invalid_request_error", 429: "rate_limit_error",
               503: "service_unavailable"}
_PARAM_AT = re.compile(r" - at `\$\.?([^`]*)`")
_MISSING = re.compile(r"missing required field `([^`]+)`")


class ClientGone(Exception):
    """The HTTP client disconnected before its response was ready."""


def json_response(body: Any, status: int = 200, headers: dict[str, str] | None = None) -> Response:
    return Response(msgspec.json.encode(body), status_code=status, media_type="application/json", headers=headers)


def error_response(status: int, message: str, param: str | None = None,
                   headers: dict[str, str] | None = None) -> Response:
    info = api.ErrorInfo(message=message, type=ERROR_TYPES.get(status, "server_error"), param=param, code=status)
    return json_response(api.ErrorResponse(info), status, headers)


async def _wait_for_disconnect(receive) -> None:
    while (await receive())["type"] != "http.disconnect":
        pass


async def cancel_on_disconnect(receive, awaitable: Awaitable[Any]) -> Any:
    """Await ``awaitable`` unless the client disconnects first; then cancel it (which aborts its engine
    requests and frees their KV blocks) and raise ClientGone."""
    work = asyncio.ensure_future(awaitable)
    watcher = asyncio.ensure_future(_wait_for_disconnect(receive))
    try:
        await asyncio.wait({work, watcher}, return_when=asyncio.FIRST_COMPLETED)
        if work.done():
            return work.result()
        raise ClientGone()
    finally:
        # Also when this task itself is cancelled: ``work`` must be over before its iterators are closed,
        # or closing them fails with "asynchronous generator is already running".
        for task in (work, watcher):
            task.cancel()
        await asyncio.gather(work, watcher, return_exceptions=True)


class EventStream:
    """A server-sent-events response that stops (and aborts its requests) when the client goes away."""

    def __init__(self, events: AsyncIterator[str], headers: dict[str, str],
                 on_close: Callable[[], None] | None = None) -> None:
        self.events = events
        self.on_close = on_close
        self.headers = [(k.lower().encode(), v.encode()) for k, v in headers.items()]

    async def __call__(self, scope, receive, send) -> None:
        await send({"type": "http.response.start", "status": 200, "headers": [
            (b"content-type", b"text/event-stream; charset=utf-8"), (b"cache-control", b"no-cache"), *self.headers]})

        async def stream() -> None:
            async for event in self.events:
                await send({"type": "http.response.body", "body": event.encode(), "more_body": True})
            await send({"type": "http.response.body", "body": b"", "more_body": False})

        try:
            await cancel_on_disconnect(receive, stream())
        except ClientGone:
            pass
        finally:
            await self.events.aclose()
            if self.on_close is not None:
                self.on_close()


def sse(body: Any) -> str:
    return f"data: {msgspec.json.encode(body).decode()}\n\n"


SSE_DONE = "data: [DONE]\n\n"


def _decode_error_param(message: str) -> str | None:
    match = _PARAM_AT.search(message) or _MISSING.search(message)
    return match.group(1) if match else None



async def decode_body(request: Request, typ: type, max_bytes: int, timeout: float) -> tuple[Any, bytes]:
    """The body decoded as ``typ`` (and the raw bytes): size, time and nesting bounded; a bad body is a 400
    naming the field, a client gone mid-body is ClientGone."""
    try:
        body = await read_body(request.stream(), request.headers.get("content-length"), max_bytes, timeout)
    except ClientDisconnect:  # gone mid-body: nothing to answer, and not a server error
        raise ClientGone() from None
    check_json_depth(body)
    try:
        return msgspec.json.decode(body, type=typ), body
    except msgspec.ValidationError as e:
        param = _decode_error_param(str(e))
        message = str(e).split(" - at ")[0]
        raise RequestError(400, f"invalid value for '{param}': {message}" if param and "missing" not in message
                           else message, param) from None
    except msgspec.DecodeError as e:
        raise RequestError(400, f"the request body is not valid JSON: {e}") from None


async def prepend(first, rest: AsyncIterator):
    try:
        yield first
        async for item in rest:
            yield item
    finally:
        await rest.aclose()
