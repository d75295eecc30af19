"""The ZMQ gateway: a frontend for non-HTTP services. Text in, streamed text out, as msgpack messages on
a ROUTER socket (docs/protocol.md); any language with ZeroMQ and msgpack can use it."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import os
import signal
import stat
import sys
from collections import deque
from typing import Any

import msgspec
import zmq
import zmq.asyncio
from zmq.utils.monitor import parse_monitor_message

from kvloom.core.config import EngineConfig
from kvloom.core.messages import (
    Cancel,
    Embed,
    Embeddings,
    Generate,
    Ping,
    PoolingParams,
    Pong,
    RequestFailed,
    TextChunk,
    Usage,
    decode_gateway_request,
    encode,
)
from kvloom.core.peer_warnings import PeerWarnings
from kvloom.frontends.admission import KeyRing, effective_priority, parse_api_keys
from kvloom.frontends.config import ServerConfig, zmq_address_is_loopback
from kvloom.frontends.frontend_core import FrontendCore, PreparedRequest, RequestError
from kvloom.frontends.model_cores import close_cores, core_for, resolve_model, start_model_cores
from kvloom.frontends.validation import check_sampling, validate_pooling

logger = logging.getLogger("kvloom.gateway")

MAX_BACKLOG = 10_000  # last replies kept for one client whose send queue is full, until it reads again
BACKLOG_RETRY_S = 0.05


def _malformed_reply(data: bytes, error: Exception) -> RequestFailed:
    """The 400 for a message that did not validate, under its ``request_id`` when it has one, so the
    client waiting on that id gets the error instead of nothing. A SamplingParams that refused a value
    gives the same message as HTTP does (validation.sampling_error)."""
    try:
        raw = msgspec.msgpack.decode(data)
    except (msgspec.DecodeError, RecursionError):
        raw = None
    rid = raw.get("request_id") if isinstance(raw, dict) else None
    if isinstance(rid, (int, float)) and not isinstance(rid, bool):
        return RequestFailed(request_id=str(rid), status=400, message=(
            f"request_id={rid!r} must be a string (your own id, echoed on every reply); it is echoed here as "
            "text"))
    rid = rid if isinstance(rid, str) else ""
    text = str(error)
    if text.endswith(" - at `$.sampling`"):  # SamplingParams' own check: "top_k=-5 must be ..."
        return RequestFailed(request_id=rid, status=400, message=text[: -len(" - at `$.sampling`")])
    return RequestFailed(request_id=rid, status=400, message=f"malformed message: {text}")


class _Stream:
    """One client request while it runs: its task, why it was stopped (None: it was not) and the
    completion tokens the client has been sent."""

    __slots__ = ("cached_tokens", "delivered", "ended", "prompt_tokens", "task")

    def __init__(self) -> None:
        self.task: asyncio.Task | None = None
        self.ended: str | None = None  # "cancel", "gone", "unread" or "shutdown"
        self.delivered = 0
        self.prompt_tokens = 0
        self.cached_tokens = 0


class _Peer:
    """A connected client: its requests, the connection it speaks on, and the last replies that found
    its send queue full (sent, in order, once it reads again)."""

    __slots__ = ("backlog", "fd", "flusher", "gone", "ident", "streams")

    def __init__(self, ident: bytes) -> None:
        self.ident = ident
        self.streams: dict[str, _Stream] = {}
        self.backlog: deque[bytes] = deque()
        self.fd: int | None = None
        self.gone = False
        self.flusher: asyncio.Task | None = None


class Gateway:
    """Serves every model in ``cores`` (by served name; a ``Generate`` naming none goes to the first).

    Replies never wait: a reply to a client whose connection is gone, or whose queue of unread replies
    is full (``max_unread``), is seen at once, and that client's requests are stopped in the engine.
    A request that lost a reply ends with ``RequestFailed``, never with a final chunk that counts tokens
    the client did not get."""

    def __init__(self, cores: dict[str, FrontendCore] | None, address: str, max_message_bytes: int = 16 * 2**20,
                 keys: KeyRing | None = None, max_unread: int = 100_000) -> None:
        self.cores = cores or {}
        self.keys = keys or KeyRing([])  # empty: no key needed
        self.address = address
        self.max_message_bytes = max_message_bytes
        self.max_unread = max_unread
        self.ctx = zmq.asyncio.Context()
        self.socket = self.ctx.socket(zmq.ROUTER)
        self.socket.setsockopt(zmq.ROUTER_MANDATORY, 1)  # a reply to a vanished client is an error, not lost
        self.socket.setsockopt(zmq.LINGER, 2000)  # deliver the last chunks of a drained request on exit
        self.socket.setsockopt(zmq.SNDHWM, max_unread)
        # A client's disconnection, seen without waiting for a reply to fail: the monitor names the
        # connection (its file descriptor), and each message names the connection it came on (SRCFD).
        # Read with a plain socket, drained before each message, so a reused descriptor is never
        # taken for its earlier owner.
        monitor_address = f"inproc://gateway-monitor-{id(self)}"
        self.socket.monitor(monitor_address, zmq.EVENT_DISCONNECTED)
        self.monitor = zmq.Context.shadow(self.ctx.underlying).socket(zmq.PAIR)
        self.monitor.connect(monitor_address)
        self._bound = False  # only a socket file this gateway bound is removed on exit
        try:
            self.socket.bind(address)
        except zmq.ZMQError as e:
            self._close_sockets(linger=0)
            raise OSError(f"cannot bind the gateway to {address}: {e}") from None
        self._bound = True
        self.peers: dict[bytes, _Peer] = {}
        self.by_fd: dict[int, bytes] = {}  # connection -> the client identity last heard on it
        self.warnings = PeerWarnings(logger)
        self.accepting = True

    @property
    def num_streams(self) -> int:
        return sum(len(p.streams) for p in self.peers.values())

    async def serve(self, stop: asyncio.Event, drain_timeout: float) -> None:
        """Answer clients until ``stop`` is set, then refuse new requests and let running ones finish."""
        loop = asyncio.get_running_loop()
        loop.add_reader(self.monitor.getsockopt(zmq.FD), self._drain_monitor)
        stopping = asyncio.create_task(stop.wait())
        receiving = None
        try:
            while self.accepting or self.num_streams:
                receiving = asyncio.ensure_future(self.socket.recv_multipart(copy=False))
                await asyncio.wait({receiving, stopping}, return_when=asyncio.FIRST_COMPLETED)
                if receiving.done():
                    self._receive(receiving.result())
                else:
                    receiving.cancel()
                    await asyncio.gather(receiving, return_exceptions=True)
                receiving = None
                if stop.is_set() and self.accepting:
                    self.accepting = False
                    logger.info("Draining %d request(s)", self.num_streams)
                    loop.call_later(drain_timeout, self._cancel_all)
                    stopping = asyncio.create_task(self._all_done())
        finally:
            loop.remove_reader(self.monitor.getsockopt(zmq.FD))
            stopping.cancel()
            if receiving is not None:
                receiving.cancel()
            self._cancel_all()
            tasks = [s.task for p in self.peers.values() for s in p.streams.values() if s.task is not None]
            await asyncio.gather(*tasks, return_exceptions=True)
            for peer in self.peers.values():
                if peer.flusher is not None:
                    peer.flusher.cancel()
            self._close_sockets()

    def _close_sockets(self, linger: int | None = None) -> None:
        with contextlib.suppress(zmq.ZMQError):
            self.socket.disable_monitor()
        self.monitor.close(linger=0)
        self.socket.close(linger=linger)
        self.ctx.term()
        self._remove_ipc_file()

    def _remove_ipc_file(self) -> None:
        """An ipc:// socket file outlives its socket; remove it, so the path is free and nothing looks
        like a live gateway there."""
        if not self._bound or not self.address.startswith("ipc://"):
            return
        path = self.address[len("ipc://"):]
        with contextlib.suppress(OSError):
            if stat.S_ISSOCK(os.lstat(path).st_mode):
                os.unlink(path)

    async def _all_done(self) -> None:
        while self.num_streams:
            await asyncio.gather(*(s.task for p in self.peers.values() for s in p.streams.values()
                                   if s.task is not None), return_exceptions=True)

    def _cancel_all(self) -> None:
        for peer in self.peers.values():
            self._stop_streams(peer, "shutdown")

    # --- connections -------------------------------------------------------------------------------
    def _drain_monitor(self) -> None:
        while True:
            try:
                event = parse_monitor_message(self.monitor.recv_multipart(zmq.NOBLOCK))
            except zmq.Again:
                return
            except zmq.ZMQError:  # closed while shutting down
                return
            if event["event"] == zmq.EVENT_DISCONNECTED:
                ident = self.by_fd.pop(event["value"], None)
                peer = self.peers.get(ident) if ident is not None else None
                if peer is not None and peer.fd == event["value"]:
                    self._peer_gone(peer)

    def _peer(self, ident: bytes, fd: int | None) -> _Peer:
        peer = self.peers.get(ident)
        if peer is None:
            peer = self.peers[ident] = _Peer(ident)
        if fd is not None and peer.fd != fd:
            earlier = self.by_fd.get(fd)
            if earlier is not None and earlier != ident and earlier in self.peers:
                self._peer_gone(self.peers[earlier])  # its connection closed: the descriptor is reused
            peer.fd = fd
            self.by_fd[fd] = ident
        return peer

    def _peer_gone(self, peer: _Peer) -> None:
        """The client disconnected: stop its requests now, so their KV blocks come back."""
        peer.gone = True
        peer.backlog.clear()
        self._stop_streams(peer, "gone")
        self._forget_if_idle(peer)

    def _forget_if_idle(self, peer: _Peer) -> None:
        if peer.streams or peer.backlog:
            return
        if self.peers.get(peer.ident) is peer:
            del self.peers[peer.ident]
        if peer.fd is not None and self.by_fd.get(peer.fd) == peer.ident and peer.gone:
            del self.by_fd[peer.fd]
        if peer.gone:
            self.warnings.forget(peer.ident)

    def _stop_streams(self, peer: _Peer, why: str) -> None:
        current = asyncio.current_task()
        for stream in peer.streams.values():
            if stream.ended is None:
                stream.ended = why
            if stream.task is not None and stream.task is not current:
                stream.task.cancel()

    # --- sending -----------------------------------------------------------------------------------
    def _try_send(self, frames: list) -> Exception | None:
        """Send now or say why not. On this socket a send with NOBLOCK completes at once (no send ever
        waits, so none is queued before it) and its future holds the error: look at it here."""
        future = self.socket.send_multipart(frames, zmq.NOBLOCK)
        if not future.done():  # not expected: let it finish on its own, its error retrieved
            future.add_done_callback(lambda f: f.cancelled() or f.exception())
            return None
        return future.exception()

    def _send_or_fail(self, peer: _Peer, frames: list) -> bool:
        """Send a reply that belongs to a running stream. False when it could not go: the client is gone
        or has stopped reading, and all its requests are being stopped."""
        if peer.gone or peer.backlog:
            self._stop_streams(peer, "gone" if peer.gone else "unread")
            return False
        error = self._try_send(frames)
        if error is None:
            return True
        self._send_failed(peer, error)
        return False

    def _send_failed(self, peer: _Peer, error: Exception) -> None:
        if isinstance(error, zmq.Again):
            running = sum(s.ended is None for s in peer.streams.values())
            if running:
                self.warnings.warning(peer.ident, "Client %r has %d unread replies (gateway_max_unread); "
                                      "stopping its %d request(s)", peer.ident, self.max_unread, running)
            self._stop_streams(peer, "unread")
        elif isinstance(error, zmq.ZMQError) and error.errno == zmq.EHOSTUNREACH:
            self._peer_gone(peer)
        else:
            raise error

    def _send_last(self, peer: _Peer, data: bytes) -> None:
        """Send a reply that ends something (a request's last reply, a refusal, a Pong). It is never
        dropped while the client is connected: a full queue keeps it until the client reads again."""
        if peer.gone:
            self._try_send([peer.ident, data])  # no one may be there to read it; an error means exactly that
            return
        if not peer.backlog:
            error = self._try_send([peer.ident, data])
            if error is None:
                return
            self._send_failed(peer, error)
            if peer.gone:
                return
        if len(peer.backlog) >= MAX_BACKLOG:
            self.warnings.warning(peer.ident, "Dropped a reply to client %r: %d replies wait for it to read",
                                  peer.ident, MAX_BACKLOG)
            return
        peer.backlog.append(data)
        if peer.flusher is None:
            peer.flusher = asyncio.get_running_loop().create_task(self._flush_backlog(peer))

    async def _flush_backlog(self, peer: _Peer) -> None:
        try:
            while peer.backlog and not peer.gone:
                await asyncio.sleep(BACKLOG_RETRY_S)
                while peer.backlog and not peer.gone:
                    error = self._try_send([peer.ident, peer.backlog[0]])
                    if isinstance(error, zmq.Again):
                        break
                    if error is not None:
                        self._send_failed(peer, error)
                        break
                    peer.backlog.popleft()
        finally:
            peer.flusher = None
            if not peer.backlog:
                self._forget_if_idle(peer)

    def _reply(self, peer: _Peer, msg) -> None:
        self._send_last(peer, encode(msg))

    # --- requests ----------------------------------------------------------------------------------
    def _receive(self, frames: list[zmq.Frame]) -> None:
        """[identity, message] is the protocol; any other frame count is refused without touching the rest."""
        self._drain_monitor()  # a connection closed before this message arrived is forgotten first
        try:
            fd = frames[-1].get(zmq.SRCFD)
        except zmq.ZMQError:  # a libzmq without it: a disconnection is then seen when a reply fails
            fd = None
        ident = frames[0].bytes
        peer = self._peer(ident, fd)
        if len(frames) == 2:
            self._handle(peer, frames[1].bytes)
        else:
            self.warnings.warning(ident, "Refused a message of %d frames from client %r (expected one frame)",
                                  len(frames) - 1, ident)
            refusal = encode(RequestFailed(request_id="", status=400, message=(
                f"expected each message as one frame, got {len(frames) - 1}: connect with a DEALER socket and "
                "send one msgpack message per frame (docs/protocol.md)")))
            if len(frames) >= 3 and frames[1].bytes == b"":
                # A REQ socket's envelope is [identity, b"", message]: answer in it, or the REQ client waits
                # for ever. Sent once: a REQ client reads each answer before it sends again.
                error = self._try_send([ident, b"", refusal])
                if error is not None and not isinstance(error, zmq.Again):
                    self._send_failed(peer, error)
            else:
                self._send_last(peer, refusal)
        self._forget_if_idle(peer)

    def _handle(self, peer: _Peer, data: bytes) -> None:
        if len(data) > self.max_message_bytes:
            self._reply(peer, RequestFailed(request_id="", status=413, message=(
                f"the message has {len(data)} bytes, over the limit of max_request_body_mb="
                f"{self.max_message_bytes / 2**20:g}")))
            return
        try:
            msg = decode_gateway_request(data)
        except (msgspec.DecodeError, msgspec.ValidationError, RecursionError) as e:
            self._reply(peer, _malformed_reply(data, e))
            return
        if isinstance(msg, (Generate, Embed)):
            self._generate(peer, msg)
        elif isinstance(msg, Cancel):
            stream = peer.streams.get(msg.request_id)
            if stream is not None and stream.ended is None and stream.task is not None:
                stream.ended = "cancel"
                stream.task.cancel()
        elif isinstance(msg, Ping):
            first = core_for(self.cores, None)
            reasons = [f"{name}: {core.client.unavailable_reason}" if len(self.cores) > 1
                       else core.client.unavailable_reason for name, core in self.cores.items()
                       if not core.client.healthy]
            self._reply(peer, Pong(healthy=any(core.client.healthy for core in self.cores.values()),
                                   model=first.ready.model_name, max_model_len=first.max_model_len,
                                   message="; ".join(reasons) or None, models=list(self.cores)))

    def _generate(self, peer: _Peer, msg: Generate | Embed) -> None:
        try:
            if not self.accepting:
                raise RequestError(503, "the gateway is shutting down")
            if peer.backlog:
                raise RequestError(429, f"this client left replies unread (gateway_max_unread): {len(peer.backlog)} "
                                   "wait for it to read them; read them before sending more requests")
            if msg.request_id in peer.streams:
                raise RequestError(400, f"request id {msg.request_id!r} is already in flight", "request_id")
        except RequestError as e:
            self._reply(peer, RequestFailed(request_id=msg.request_id, message=e.message, status=e.status))
            return
        stream = peer.streams[msg.request_id] = _Stream()
        work = self._stream if isinstance(msg, Generate) else self._embed
        stream.task = asyncio.create_task(self._run(peer, stream, msg, work))

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
        return msg.prompt_token_ids

    async def _run(self, peer: _Peer, stream: _Stream, msg: Generate | Embed, work) -> None:
        """Run a request's ``work`` (``_stream``, ``_embed``): a refusal or a stop answers with its reply."""
        request_id = msg.request_id
        try:
            await work(peer, stream, msg)
        except RequestError as e:
            if stream.ended is None:
                retry = e.headers.get("Retry-After")
                self._reply(peer, RequestFailed(request_id=request_id, message=e.message, status=e.status,
                                                retry_after=float(retry) if retry else None))
            else:
                self._end(peer, stream, request_id)
        except asyncio.CancelledError:
            self._end(peer, stream, request_id)
        except _Undelivered:
            self._end(peer, stream, request_id)
        finally:
            if peer.streams.get(request_id) is stream:
                del peer.streams[request_id]
            self._forget_if_idle(peer)

    async def _embed(self, peer: _Peer, stream: _Stream, msg: Embed) -> None:
        """An ``Embed``: every input pooled by its embedding model, answered with one ``Embeddings``."""
        api_key = self.keys.authenticate(msg.api_key, "send it as Embed.api_key") if self.keys.required else None
        core = core_for(self.cores, msg.model)
        given = [name for name in ("input", "input_token_ids") if getattr(msg, name) is not None]
        if len(given) != 1:
            raise RequestError(400, f"give exactly one of input, input_token_ids (got {given or 'none'})")
        prompts = ([await core.tokenize_text(t, "input") for t in msg.input] if msg.input is not None
                   else msg.input_token_ids)
        prepared = validate_pooling(prompts, core.limits, PoolingParams(dimensions=msg.dimensions,
                                                                        normalize=msg.normalize),
                                    priority=effective_priority(api_key, msg.priority), input_param=given[0])
        for p in prepared:
            p.api_key_name = api_key.name if api_key else ""
        stream.prompt_tokens = tokens = sum(len(p.prompt_token_ids) for p in prepared)
        admission = core.admit(len(prepared))
        try:
            deltas = await core.pool_many(prepared)
        finally:
            admission.release()
        reply = Embeddings(request_id=msg.request_id, data=[d.embedding for d in deltas],
                           usage=Usage(prompt_tokens=tokens, cached_tokens=sum(d.num_cached_tokens for d in deltas)))
        if not self._send_or_fail(peer, [peer.ident, encode(reply)]):
            raise _Undelivered()

    async def _stream(self, peer: _Peer, stream: _Stream, msg: Generate) -> None:
        api_key = self.keys.authenticate(msg.api_key, "send it as Generate.api_key") if self.keys.required \
            else None
        core, lora = await resolve_model(self.cores, msg.model)  # a served model or one of its LoRA adapters
        check_sampling(msg.sampling, core.ready.vocab_size)  # before tokenizing: a cheap refusal stays cheap
        prompt_param = "prompt_token_ids" if msg.prompt_token_ids is not None else "prompt"
        # Tokenized here, in the request's own task, so a long prompt never holds up the receive loop.
        prepared = core.prepare(await self._prompt_ids(core, msg), msg.sampling, prompt_param=prompt_param,
                                priority=effective_priority(api_key, msg.priority), lora_name=lora)
        prepared.api_key_name = api_key.name if api_key else ""
        stream.prompt_tokens = len(prepared.prompt_token_ids)
        admission = core.admit(1)
        try:
            await self._send_chunks(core, peer, stream, msg.request_id, prepared)
        finally:
            admission.release()

    def _end(self, peer: _Peer, stream: _Stream, request_id: str) -> None:
        """The last reply of a request that was stopped, by why it was."""
        why = stream.ended or "shutdown"
        if why == "cancel":  # the client asked: confirm, with what it was sent
            self._reply(peer, TextChunk(request_id=request_id, text="", finish_reason="abort", stop_reason=None,
                                        usage=Usage(prompt_tokens=stream.prompt_tokens,
                                                    completion_tokens=stream.delivered,
                                                    cached_tokens=stream.cached_tokens)))
        elif why == "unread":
            self._reply(peer, RequestFailed(request_id=request_id, status=429, message=(
                f"the request was stopped: this client left {self.max_unread} replies unread "
                f"(gateway_max_unread), so replies to it were lost; {stream.delivered} tokens were sent")))
        elif why == "gone":
            self._reply(peer, RequestFailed(request_id=request_id, status=503, message=(
                "the request was stopped: the client's connection closed")))
        else:
            self._reply(peer, RequestFailed(request_id=request_id, message="the gateway is shutting down",
                                            status=503))

    async def _send_chunks(self, core: FrontendCore, peer: _Peer, stream: _Stream, request_id: str,
                           prepared: PreparedRequest) -> None:
        # Asked for, prompt logprobs come on the first chunk, [] for a one-token prompt (nothing to score).
        scored = [] if prepared.sampling.prompt_logprobs is not None else None
        deltas = core.generate(prepared)
        try:
            async for d in deltas:
                stream.cached_tokens = d.num_cached_tokens
                final = d.finish_reason is not None
                chunk = TextChunk(request_id=request_id, text=d.text, token_ids=d.token_ids, logprobs=d.logprobs,
                                  prompt_logprobs=d.prompt_logprobs or scored)
                if final:
                    sent = stream.delivered + len(d.token_ids)
                    if sent != d.num_output_tokens:  # never a usage the chunks do not add up to
                        logger.error("Request %r of client %r: %d tokens generated, %d sent", request_id,
                                     peer.ident, d.num_output_tokens, sent)
                        raise RequestError(503, f"the gateway lost replies of this request: {d.num_output_tokens} "
                                           f"tokens were generated, {sent} sent")
                    chunk.finish_reason, chunk.stop_reason = d.finish_reason, d.stop_reason
                    chunk.usage = Usage(prompt_tokens=d.num_prompt_tokens, completion_tokens=d.num_output_tokens,
                                        cached_tokens=d.num_cached_tokens)
                if not self._send_or_fail(peer, [peer.ident, encode(chunk)]):
                    raise _Undelivered()
                stream.delivered += len(d.token_ids)
                scored = None
        finally:
            await deltas.aclose()  # aborts the engine's request unless it finished


class _Undelivered(Exception):
    """A reply of a running request could not be sent; ``_Stream.ended`` says why."""


def gateway_keys(server: ServerConfig, address: str) -> KeyRing:
    """The keys the gateway requires: the HTTP server's, unless ``gateway_require_api_key = false``
    turns them off (warned about on TCP, where any local user, or the network, can connect)."""
    keys = parse_api_keys(server.api_keys, server.api_key)
    if server.gateway_keys_required:
        return KeyRing(keys)
    if keys and address.startswith("tcp://"):
        logger.warning("The ZMQ gateway on %s serves without an API key (gateway_require_api_key = false) although "
                       "the HTTP server requires one: anyone who can connect%s bypasses the keys and their "
                       "quotas", address, " from this machine" if zmq_address_is_loopback(address) else "")
    return KeyRing([])


async def run_gateway(engine_address: str | list[str], address: str, engine: EngineConfig, server: ServerConfig,
                      engine_secret: str | None = None, models: list[dict[str, Any]] | None = None) -> int:
    """``models``: several served models (``{"name", "engine", "addresses"}`` each), all served here."""
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    # Bind before waiting for the engine: an address that cannot be bound fails now, not after the model loads.
    gateway = Gateway(None, address, server.max_request_body_bytes, gateway_keys(server, address),
                      server.gateway_max_unread)
    try:
        gateway.cores = await start_model_cores(engine_address, engine, server, engine_secret, models)
    except BaseException:
        gateway._close_sockets(linger=0)
        raise
    try:
        logger.info("ZMQ gateway listening on %s (model%s %s%s)", address, "s" if len(gateway.cores) > 1 else "",
                    ", ".join(gateway.cores), "; API key required" if gateway.keys.required else "")
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
