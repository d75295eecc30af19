"""The HTTP frontend's uvicorn server: a drain that ends its requests itself when the drain timeout
expires (every stream gets an error event and [DONE], every other request a 503), before uvicorn would
cancel them mid-write."""

from __future__ import annotations

import asyncio
import logging

import uvicorn

logger = logging.getLogger("kvloom.api")

# Seconds uvicorn waits after the drain timeout, for the responses that the drain ended to be written.
DRAIN_GRACE_S = 5


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
