"""The HTTP frontend's uvicorn server: a drain that ends its requests itself when the drain timeout
expires (every stream gets an error event and [DONE], every other request a 503), before uvicorn would
cancel them mid-write."""

from __future__ import annotations

import asyncio
import logging

import uvicorn
from uvicorn.protocols.http.h11_impl import H11Protocol

logger = logging.getLogger("kvloom.api")

# Seconds uvicorn waits after the drain timeout, for the responses that the drain ended to be written.
DRAIN_GRACE_S = 5


def header_timeout_protocol(header_timeout: float) -> type[H11Protocol]:
    """uvicorn's h11 protocol with a deadline for the request line and headers: a connection that has
    not sent a whole request head within ``header_timeout`` seconds of opening (or of its first byte
    after a keep-alive pause) is closed, so half-sent requests cannot hold connections open for ever.
    uvicorn has no such limit of its own; its keep-alive timer only runs between requests."""

    class HeaderTimeoutProtocol(H11Protocol):
        _head_timer: asyncio.TimerHandle | None = None

        def connection_made(self, transport) -> None:
            super().connection_made(transport)
            self._arm()

        def data_received(self, data: bytes) -> None:
            if self.cycle is None or self.cycle.response_complete:  # the head of a new request is coming
                self._arm()
            super().data_received(data)
            if self.cycle is not None and not self.cycle.response_complete:  # its head is complete
                self._disarm()

        def connection_lost(self, exc) -> None:
            self._disarm()
            super().connection_lost(exc)

        def _arm(self) -> None:
            if self._head_timer is None:
                self._head_timer = self.loop.call_later(header_timeout, self._expire)

        def _disarm(self) -> None:
            if self._head_timer is not None:
                self._head_timer.cancel()
                self._head_timer = None

        def _expire(self) -> None:
            self._head_timer = None
            if not self.transport.is_closing():
                self.transport.close()

    return HeaderTimeoutProtocol


class DrainingServer(uvicorn.Server):
    def __init__(self, config: uvicorn.Config, app_server, drain_timeout: float) -> None:
        super().__init__(config)
        self.app_server = app_server  # the OpenAIServer, whose FrontendCore ends the requests
        self.drain_timeout = drain_timeout

    async def shutdown(self, sockets=None) -> None:
        core = self.app_server.core
        timer = None
        if core is not None:
            core.start_draining()
            reason = f"the server is shutting down: drain_timeout={self.drain_timeout:g}s expired"
            timer = asyncio.get_running_loop().call_later(self.drain_timeout, core.end_all, reason)
        try:
            await super().shutdown(sockets)
        finally:
            if timer is not None:
                timer.cancel()
