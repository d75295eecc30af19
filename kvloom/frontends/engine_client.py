"""A frontend's asyncio connection to the engine process: one task reads engine output and routes each
request's deltas to its own queue; engine death (an ``EngineError`` or a lost connection) ends every
in-flight request with an error instead of leaving it waiting."""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import os
import secrets
import signal
import time
from typing import Any, AsyncIterator

import zmq
import zmq.asyncio
from zmq.utils.monitor import parse_monitor_message

from kvloom.core.messages import (
    AbortRequest,
    AddRequest,
    EngineError,
    EngineReady,
    EngineStats,
    Heartbeat,
    PoolingParams,
    RegisterFrontend,
    StepOutputs,
    TokenDelta,
    Utility,
    UtilityResult,
    decode_engine_message,
    encode,
)
from kvloom.core.sampling_params import SamplingParams

logger = logging.getLogger("kvloom.frontend")


class EngineUnavailable(RuntimeError):
    """The engine process is gone (or never came up); the message says why."""


class UtilityError(RuntimeError):
    """An engine utility call failed; ``kind`` is the engine's ``error_kind`` (``not_found``, ``conflict``
    or None)."""

    def __init__(self, message: str, kind: str | None = None) -> None:
        super().__init__(message)
        self.kind = kind


class AsyncEngineClient:
    def __init__(self, address: str, frontend_id: str | None = None, heartbeat_timeout: float | None = None,
                 secret: str | None = None, reconnect: bool = False) -> None:
        self.address = address
        self.reconnect = reconnect  # the launcher restarts a dead engine (restart_engine): serve it again
        self.secret = secret
        self.heartbeat_timeout = heartbeat_timeout
        self.hung_reason: str | None = None  # set while the engine is silent past heartbeat_timeout
        self._last_heard = time.monotonic()
        self.frontend_id = frontend_id or f"fe{os.getpid()}-{secrets.token_hex(3)}"
        self.ready: EngineReady | None = None
        self.dead_reason: str | None = None
        self.last_stats: EngineStats | None = None
        self._queues: dict[str, asyncio.Queue[TokenDelta]] = {}
        self._ended: set[str] = set()  # ended here (end_all) while the engine may still run them
        self._calls: dict[int, asyncio.Future] = {}
        self._call_ids = itertools.count()
        self._ready_event = asyncio.Event()
        self._tasks: list[asyncio.Task] = []
        self._ctx = zmq.asyncio.Context()
        self._sock = self._ctx.socket(zmq.DEALER)
        self._sock.setsockopt(zmq.IDENTITY, self.frontend_id.encode())
        self._sock.setsockopt(zmq.LINGER, 0)
        self._sock.setsockopt(zmq.SNDHWM, 0)
        self._sock.setsockopt(zmq.RCVHWM, 0)
        self._monitor = self._sock.get_monitor_socket(zmq.EVENT_DISCONNECTED | zmq.EVENT_CONNECTED)

    @property
    def healthy(self) -> bool:
        return self.ready is not None and self.dead_reason is None and self.hung_reason is None

    @property
    def unavailable_reason(self) -> str | None:
        """Why requests are refused now (engine gone or hung), or None when the engine is healthy."""
        if self.ready is None and self.dead_reason is None:
            return "the engine is not ready"
        return self.dead_reason or self.hung_reason

    async def start(self, timeout: float) -> EngineReady:
        """Connect, register and wait for ``EngineReady`` (the engine may still be loading the model)."""
        self._sock.connect(self.address)
        self._tasks = [asyncio.create_task(self._read()), asyncio.create_task(self._watch_connection())]
        if self.heartbeat_timeout is not None:
            self._tasks.append(asyncio.create_task(self._watch_heartbeat(self.heartbeat_timeout)))
        self._send(RegisterFrontend(frontend_id=self.frontend_id, pid=os.getpid(), secret=self.secret or ""))
        try:
            await asyncio.wait_for(self._ready_event.wait(), timeout)
        except asyncio.TimeoutError:
            raise EngineUnavailable(f"the engine at {self.address} was not ready within {timeout:g}s") from None
        if self.dead_reason is not None:
            raise EngineUnavailable(self.dead_reason)
        return self.ready

    async def close(self) -> None:
        for t in self._tasks:
            t.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        self._monitor.close(linger=0)
        self._sock.close(linger=0)
        self._ctx.term()

    # --- requests ----------------------------------------------------------------------------------
    async def generate(self, request_id: str, prompt_token_ids: list[int], sampling: SamplingParams,
                       priority: int = 0, arrival_time: float = 0.0, *, deadline: float | None = None,
                       queue_deadline: float | None = None, api_key_name: str = "",
                       lora_name: str = "", pooling: PoolingParams | None = None) -> AsyncIterator[TokenDelta]:
        """The deltas of one request, ending with the one that has ``finish_reason``. Leaving the loop
        early (or being cancelled) aborts the request in the engine, which frees its KV blocks."""
        if not self.healthy:
            raise EngineUnavailable(self.unavailable_reason)
        if request_id in self._queues:
            raise ValueError(f"request id {request_id!r} is already in flight")
        queue: asyncio.Queue[TokenDelta] = asyncio.Queue()
        self._queues[request_id] = queue
        finished = False
        try:
            self._send(AddRequest(request_id=request_id, prompt_token_ids=prompt_token_ids, sampling=sampling,
                                  priority=priority, arrival_time=arrival_time, deadline=deadline,
                                  queue_deadline=queue_deadline, api_key_name=api_key_name,
                                  lora_name=lora_name, pooling=pooling))
            while not finished:
                delta = await queue.get()
                finished = delta.finish_reason is not None
                yield delta
        finally:
            self._queues.pop(request_id, None)
            ended_here = request_id in self._ended
            self._ended.discard(request_id)
            if (not finished or ended_here) and self.dead_reason is None:
                self._send(AbortRequest(request_ids=[request_id]))

    async def utility(self, method: str, *args: Any, timeout: float = 10.0) -> Any:
        """Call an allow-listed EngineCore method (``stats``, ``reset_prefix_cache``) in the engine."""
        if not self.healthy:
            raise EngineUnavailable(self.unavailable_reason)
        call_id = next(self._call_ids)
        future = asyncio.get_running_loop().create_future()
        self._calls[call_id] = future
        try:
            self._send(Utility(call_id=call_id, method=method, args=list(args)))
            result: UtilityResult = await asyncio.wait_for(future, timeout)
        finally:
            self._calls.pop(call_id, None)
        if result.error is not None:
            raise UtilityError(result.error, result.error_kind)
        return result.result

    @property
    def num_in_flight(self) -> int:
        return len(self._queues)

    # --- plumbing ----------------------------------------------------------------------------------
    def _send(self, msg) -> None:
        # With no high-water mark a DEALER send never blocks, so this completes now and in order.
        self._sock.send(encode(msg))

    async def _read(self) -> None:
        try:
            while True:
                msg = decode_engine_message(await self._sock.recv())
                self._heard()
                if isinstance(msg, Heartbeat):
                    continue
                if isinstance(msg, StepOutputs):
                    if msg.stats is not None:
                        self.last_stats = msg.stats
                    for delta in msg.outputs:
                        queue = self._queues.get(delta.request_id)
                        if queue is not None:
                            queue.put_nowait(delta)
                elif isinstance(msg, UtilityResult):
                    future = self._calls.get(msg.call_id)
                    if future is not None and not future.done():
                        future.set_result(msg)
                elif isinstance(msg, EngineReady):
                    if self.dead_reason is not None:
                        logger.warning("The engine is back (pid %d); serving requests", msg.pid)
                        self.dead_reason = None
                        self.last_stats = None  # the old engine's: the new one counts from zero
                    self.ready = msg
                    self._ready_event.set()
                elif isinstance(msg, EngineError):
                    self._fail(msg.message)
        except asyncio.CancelledError:
            raise
        except Exception as e:  # noqa: BLE001 - a reader that dies silently would hang every request
            logger.exception("Reading from the engine failed")
            self._fail(f"reading from the engine failed: {e!r}")

    async def _watch_connection(self) -> None:
        while True:
            event = parse_monitor_message(await self._monitor.recv_multipart())
            if event["event"] == zmq.EVENT_DISCONNECTED:
                self._fail("the engine process went away (connection lost)")
                if not self.reconnect:
                    return
            elif event["event"] == zmq.EVENT_CONNECTED and self.dead_reason is not None and self.reconnect:
                # A restarted engine at the same address (ZeroMQ reconnects by itself): register again;
                # its EngineReady makes this client healthy.
                logger.warning("Reconnected to the engine; registering again")
                self._send(RegisterFrontend(frontend_id=self.frontend_id, pid=os.getpid(), secret=self.secret or ""))

    def _heard(self) -> None:
        self._last_heard = time.monotonic()
        if self.hung_reason is not None:
            logger.warning("The engine answers again; serving requests")
            self.hung_reason = None

    async def _watch_heartbeat(self, timeout: float) -> None:
        """A silent engine past ``timeout`` is hung: end its requests now and refuse new ones (503)
        until it is heard from again (SIGCONT, a long stall that ended)."""
        while True:
            await asyncio.sleep(timeout / 8)
            silent = time.monotonic() - self._last_heard
            if self.ready is None or self.dead_reason is not None or self.hung_reason is not None:
                continue
            # Unread messages mean this process was the slow one, not the engine: read them first.
            if silent <= timeout or self._sock.getsockopt(zmq.EVENTS) & zmq.POLLIN:
                continue
            self.hung_reason = (f"the engine has not answered for {silent:.1f}s (engine_heartbeat_timeout="
                                f"{timeout:g}s): it is hung or overloaded")
            logger.error("Engine unavailable: %s", self.hung_reason)
            self.end_all(self.hung_reason)  # their aborts are delivered if it wakes up: KV blocks come back
            if self.reconnect and self.ready.pid:
                # restart_engine: a hung engine is ended like a dead one, and the launcher starts a new one.
                logger.error("Stopping the hung engine (pid %d) so that it is restarted", self.ready.pid)
                with contextlib.suppress(OSError):
                    os.kill(self.ready.pid, signal.SIGKILL)
            for future in self._calls.values():
                if not future.done():
                    future.set_exception(EngineUnavailable(self.hung_reason))

    def end_all(self, reason: str) -> None:
        """End every in-flight request now with ``reason`` (the engine is told to abort each)."""
        for rid, queue in self._queues.items():
            self._ended.add(rid)
            queue.put_nowait(TokenDelta(request_id=rid, new_token_ids=[], finish_reason="error", error=reason,
                                        error_kind="unavailable"))

    def _fail(self, reason: str) -> None:
        """The engine is gone: end every in-flight request and utility call with ``reason``."""
        if self.dead_reason is not None:
            return
        self.dead_reason = reason
        logger.warning("Engine unavailable: %s", reason)
        for rid, queue in self._queues.items():
            queue.put_nowait(TokenDelta(request_id=rid, new_token_ids=[], finish_reason="error", error=reason,
                                        error_kind="unavailable"))
        for future in self._calls.values():
            if not future.done():
                future.set_exception(EngineUnavailable(reason))
        self._ready_event.set()
