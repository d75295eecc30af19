"""The ZMQ gateway: a frontend for non-HTTP services. Text in, streamed text out, as msgpack messages on
a ROUTER socket (docs/protocol.md); any language with ZeroMQ and msgpack can use it."""

from __future__ import annotations

import argparse
import asyncio
import logging
import signal
import sys
from typing import Any

import msgspec
import zmq
import zmq.asyncio

from kvloom.core.config import EngineConfig
from kvloom.core.messages import (
    Cancel,
    Generate,
    Ping,
    Pong,
    RequestFailed,
    TextChunk,
    Usage,
    decode_gateway_request,
    encode,
)
from kvloom.frontends.admission import KeyRing, effective_priority, parse_api_keys
from kvloom.frontends.config import ServerConfig
from kvloom.frontends.frontend_core import FrontendCore, PreparedRequest, RequestError
from kvloom.frontends.model_cores import close_cores, core_for, start_model_cores

logger = logging.getLogger("kvloom.gateway")

SEND_QUEUE_LIMIT = 100_000  # replies queued for one client that does not read before its requests stop


def _request_id_of(data: bytes) -> str:
    """The ``request_id`` of a message that did not validate, if it is a map with a string one."""
    try:
        raw = msgspec.msgpack.decode(data)
    except (msgspec.DecodeError, RecursionError):
        return ""
    rid = raw.get("request_id") if isinstance(raw, dict) else None
    return rid if isinstance(rid, str) else ""


class Gateway:
    """Serves every model in ``cores`` (by served name; a ``Generate`` naming none goes to the first)."""

    def __init__(self, cores: dict[str, FrontendCore] | None, address: str, max_message_bytes: int = 16 * 2**20,
                 keys: KeyRing | None = None) -> None:
        self.cores = cores or {}
        self.keys = keys or KeyRing([])  # empty: no key needed (gateway_require_api_key is off)
        self.address = address
        self.max_message_bytes = max_message_bytes
        self.ctx = zmq.asyncio.Context()
        self.socket = self.ctx.socket(zmq.ROUTER)
        self.socket.setsockopt(zmq.ROUTER_MANDATORY, 1)  # replies to a vanished client raise
        self.socket.setsockopt(zmq.LINGER, 2000)  # deliver the last chunks of a drained request on exit
        self.socket.setsockopt(zmq.SNDHWM, SEND_QUEUE_LIMIT)
        try:
            self.socket.bind(address)
        except zmq.ZMQError as e:
            self.socket.close(linger=0)
            self.ctx.term()
            raise OSError(f"cannot bind the gateway to {address}: {e}") from None
        # (client identity, the client's request id) -> the task streaming it
        self.tasks: dict[tuple[bytes, str], asyncio.Task] = {}
        self.cancelled: set[tuple[bytes, str]] = set()
        self.accepting = True

    async def serve(self, stop: asyncio.Event, drain_timeout: float) -> None:
        """Answer clients until ``stop`` is set, then refuse new requests and let running ones finish."""
        stopping = asyncio.create_task(stop.wait())
        try:
            while self.accepting or self.tasks:
                receiving = asyncio.ensure_future(self.socket.recv_multipart())
                await asyncio.wait({receiving, stopping}, return_when=asyncio.FIRST_COMPLETED)
                if receiving.done():
                    self._receive(receiving.result())
                else:
                    receiving.cancel()
                    await asyncio.gather(receiving, return_exceptions=True)
                if stop.is_set() and self.accepting:
                    self.accepting = False
                    logger.info("Draining %d request(s)", len(self.tasks))
                    asyncio.get_running_loop().call_later(drain_timeout, self._cancel_all)
                    stopping = asyncio.create_task(self._all_done())
        finally:
            stopping.cancel()
            self._cancel_all()
            await asyncio.gather(*self.tasks.values(), return_exceptions=True)
            self.socket.close()
            self.ctx.term()

    async def _all_done(self) -> None:
        while self.tasks:
            await asyncio.gather(*self.tasks.values(), return_exceptions=True)

    def _cancel_all(self) -> None:
        for task in self.tasks.values():
            task.cancel()

    # --- requests ----------------------------------------------------------------------------------
    def _receive(self, frames: list[bytes]) -> None:
        """[identity, message] is the protocol; any other frame count is refused without touching the rest."""
        if len(frames) == 2:
            self._handle(*frames)
            return
        ident = frames[0]
        logger.warning("Refused a message of %d frames from client %r (expected one frame)", len(frames) - 1, ident)
        refusal = encode(RequestFailed(request_id="", status=400, message=(
            f"expected each message as one frame, got {len(frames) - 1}: connect with a DEALER socket and send "
            "one msgpack message per frame (docs/protocol.md)")))
        # A REQ socket's envelope is [identity, b"", message]: answer in it, or the REQ client waits forever.
        envelope = [ident, b""] if len(frames) >= 3 and frames[1] == b"" else [ident]
        self._send(ident, [*envelope, refusal])

    def _handle(self, ident: bytes, data: bytes) -> None:
        if len(data) > self.max_message_bytes:
            self._reply(ident, RequestFailed(request_id="", status=413, message=(
                f"the message has {len(data)} bytes, over the limit of max_request_body_mb="
                f"{self.max_message_bytes / 2**20:g}")))
            return
        try:
            msg = decode_gateway_request(data)
        except (msgspec.DecodeError, msgspec.ValidationError, RecursionError) as e:
            # A well-formed message with a bad field (an unknown key, a wrong type) still names its request:
            # answer under that id, so the client waiting on it gets the error instead of nothing.
            self._reply(ident, RequestFailed(request_id=_request_id_of(data), message=f"malformed message: {e}",
                                             status=400))
            return
        if isinstance(msg, Generate):
            self._generate(ident, msg)
        elif isinstance(msg, Cancel):
            task = self.tasks.get((ident, msg.request_id))
            if task is not None:
                self.cancelled.add((ident, msg.request_id))
                task.cancel()
        elif isinstance(msg, Ping):
            first = core_for(self.cores, None)
            reasons = [f"{name}: {core.client.unavailable_reason}" if len(self.cores) > 1
                       else core.client.unavailable_reason for name, core in self.cores.items()
                       if not core.client.healthy]
            self._reply(ident, Pong(healthy=any(core.client.healthy for core in self.cores.values()),
                                    model=first.ready.model_name, max_model_len=first.max_model_len,
                                    message="; ".join(reasons) or None, models=list(self.cores)))

    def _generate(self, ident: bytes, msg: Generate) -> None:
        key = (ident, msg.request_id)
        try:
            if not self.accepting:
                raise RequestError(503, "the gateway is shutting down")
            if key in self.tasks:
                raise RequestError(400, f"request id {msg.request_id!r} is already in flight", "request_id")
        except RequestError as e:
            self._reply(ident, RequestFailed(request_id=msg.request_id, message=e.message, status=e.status))
            return
        self.tasks[key] = asyncio.create_task(self._stream(ident, msg))

    async def _prompt_ids(self, core: FrontendCore, msg: Generate) -> list[int]:
        given = [name for name in ("prompt", "messages", "prompt_token_ids") if getattr(msg, name) is not None]
        if len(given) != 1:
            raise RequestError(400, f"give exactly one of prompt, messages, prompt_token_ids (got {given or 'none'})")
        if msg.sampling.n != 1:
            raise RequestError(400, f"n={msg.sampling.n}: the gateway streams one completion per request; "
                               "send n requests", "n")
        if msg.prompt is not None:
            return await core.tokenize_text(msg.prompt)
        if msg.messages is not None:
            return await core.tokenize_chat([{"role": m.role, "content": m.content} for m in msg.messages])
        return core.check_token_ids(msg.prompt_token_ids, "prompt_token_ids")

    async def _stream(self, ident: bytes, msg: Generate) -> None:
        request_id = msg.request_id
        key = (ident, request_id)
        try:
            api_key = self.keys.authenticate(msg.api_key) if self.keys.required else None
            core = core_for(self.cores, msg.model)
            # Tokenized here, in the request's own task, so a long prompt never holds up the receive loop.
            prepared = core.prepare(await self._prompt_ids(core, msg), msg.sampling,
                                    priority=effective_priority(api_key, msg.priority))
            prepared.api_key_name = api_key.name if api_key else ""
            admission = core.admit(1)
            try:
                await self._send_chunks(core, ident, request_id, prepared)
            finally:
                admission.release()
        except RequestError as e:
            retry = e.headers.get("Retry-After")
            self._reply(ident, RequestFailed(request_id=request_id, message=e.message, status=e.status,
                                             retry_after=float(retry) if retry else None))
        except asyncio.CancelledError:
            if key in self.cancelled:  # the client asked: confirm; otherwise the gateway is stopping
                self._reply(ident, TextChunk(request_id=request_id, text="", finish_reason="abort"))
            else:
                self._reply(ident, RequestFailed(request_id=request_id, message="the gateway is shutting down",
                                                 status=503))
        finally:
            self.tasks.pop(key, None)
            self.cancelled.discard(key)

    async def _send_chunks(self, core: FrontendCore, ident: bytes, request_id: str,
                           prepared: PreparedRequest) -> None:
        # Asked for, prompt logprobs come on the first chunk, [] for a one-token prompt (nothing to score).
        scored = [] if prepared.sampling.prompt_logprobs is not None else None
        async for d in core.generate(prepared):
            usage = None
            if d.finish_reason is not None:
                usage = Usage(prompt_tokens=d.num_prompt_tokens, completion_tokens=d.num_output_tokens,
                              cached_tokens=d.num_cached_tokens)
            self._reply(ident, TextChunk(request_id=request_id, text=d.text, token_ids=d.token_ids,
                                         logprobs=d.logprobs, prompt_logprobs=d.prompt_logprobs or scored,
                                         finish_reason=d.finish_reason, stop_reason=d.stop_reason, usage=usage))
            scored = None

    def _reply(self, ident: bytes, msg) -> None:
        self._send(ident, [ident, encode(msg)])

    def _send(self, ident: bytes, frames: list[bytes]) -> None:
        try:
            self.socket.send_multipart(frames, zmq.NOBLOCK)
        except zmq.ZMQError as e:
            if e.errno not in (zmq.EHOSTUNREACH, zmq.EAGAIN):
                raise
            # The client is gone (or not reading): stop its requests so their KV blocks come back.
            for (owner, rid), task in list(self.tasks.items()):
                if owner == ident:
                    task.cancel()


async def run_gateway(engine_address: str | list[str], address: str, engine: EngineConfig, server: ServerConfig,
                      engine_secret: str | None = None, models: list[dict[str, Any]] | None = None) -> int:
    """``models``: several served models (``{"name", "engine", "addresses"}`` each), all served here."""
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    # Bind before waiting for the engine: an address that cannot be bound fails now, not after the model loads.
    keys = KeyRing(parse_api_keys(server.api_keys, server.api_key) if server.gateway_require_api_key else [])
    gateway = Gateway(None, address, server.max_request_body_bytes, keys)
    gateway.cores = await start_model_cores(engine_address, engine, server, engine_secret, models)
    try:
        logger.info("ZMQ gateway listening on %s (model%s %s)", address, "s" if len(gateway.cores) > 1 else "",
                    ", ".join(gateway.cores))
        await gateway.serve(stop, server.drain_timeout)
    finally:
        await close_cores(gateway.cores)
    return 0


def main(argv: list[str] | None = None) -> int:
    """``python -m kvloom.frontends.gateway --engine-address ADDR --address GW``, settings as JSON on stdin."""
    from kvloom.launch.child_process import start_child

    parser = argparse.ArgumentParser(prog="kvloom-gateway")
    parser.add_argument("--engine-address", required=True, action="append",
                        help="An engine to feed; repeated for data-parallel replicas.")
    parser.add_argument("--address", required=True, help="Where clients connect, e.g. ipc:///tmp/kvloom.sock.")
    args, engine, server = start_child(parser, argv)
    main_coro = run_gateway(args.engine_address, args.address, engine, server, args.engine_secret, args.models)
    try:
        import uvloop
    except ImportError:
        uvloop = asyncio
    try:
        return uvloop.run(main_coro)
    except OSError as e:
        logger.error("%s", e)
        return 1


if __name__ == "__main__":
    sys.exit(main())
