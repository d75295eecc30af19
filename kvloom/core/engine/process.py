"""The engine process: runs the EngineCore loop and talks to frontends only through msgspec messages
over one ZeroMQ ROUTER socket (``ipc://`` by default). It never sees text.

The socket belongs to an inbox thread (ZeroMQ sockets are not shared between threads): it receives
and validates messages and hands them to the loop through a queue, sends what the loop gives it, and
refuses requests over the queue cap at once, so a 429 never waits for the step that is running (a
step of a loaded CPU engine can take seconds). Every other decision stays with the loop."""

from __future__ import annotations

import contextlib
import hmac
import logging
import os
import queue
import signal
import threading
import time
import traceback
from collections import defaultdict

import msgspec
import zmq

from kvloom.core.config import EngineConfig
from kvloom.core.engine.pooling import pooling_info
from kvloom.core.engine.stats_log import EngineStatsLog
from kvloom.core.messages import (
    AbortRequest,
    AddRequest,
    EngineError,
    EngineReady,
    Heartbeat,
    RegisterFrontend,
    Shutdown,
    StepOutputs,
    TokenDelta,
    Utility,
    UtilityResult,
    decode_frontend_message,
    encode,
)
from kvloom.core.peer_warnings import PeerWarnings

logger = logging.getLogger("kvloom.engine")

# What a frontend may call through ``Utility``; anything else is refused by name.
UTILITY_METHODS = ("stats", "reset_prefix_cache", "load_lora_adapter", "unload_lora_adapter", "list_lora_adapters")
IDLE_POLL_MS = 100  # how often an idle engine wakes up to notice signals
FAILED_START_GRACE_S = 15.0  # how long an engine that failed to load waits for a frontend to tell why
HEAP_TRIM_INTERVAL_S = 60.0  # a CPU engine hands its heap's free pages back this often (cpu_malloc)
_STOP = b"stop"  # loop -> inbox thread: send what is queued, then close the socket
_GONE = object()  # inbox thread -> loop: a frontend can no longer be reached


class EngineServer:
    """Owns the ROUTER socket and the loop: drain the inbox (blocking only when idle), step, send one
    ``StepOutputs`` per frontend that has news."""

    def __init__(self, config: EngineConfig, address: str, model_name: str | None = None,
                 heartbeat_interval: float | None = None, secret: str | None = None, gate=None, *, build) -> None:
        """``build(config)`` makes the ``EngineCore`` at ``load()`` (``kvloom.builder.build_engine``)."""
        self.config = config
        self.build = build
        self.gate = gate  # engine-wide caps and per-key quotas (core/engine/gate.py), set on the core at load
        self.secret = secret  # when set, only frontends that registered with it are heard
        self.warnings = PeerWarnings(logger)  # per peer: junk in a loop must not flood the log
        self.heartbeat_interval = heartbeat_interval
        self._next_beat = 0.0
        self.model_name = model_name or config.model
        self.ctx = zmq.Context()
        self.socket = self.ctx.socket(zmq.ROUTER)
        # A send to a frontend that is gone raises instead of vanishing, so its requests can be aborted.
        self.socket.setsockopt(zmq.ROUTER_MANDATORY, 1)
        self.socket.setsockopt(zmq.SNDHWM, 0)
        self.socket.setsockopt(zmq.RCVHWM, 0)
        self.socket.setsockopt(zmq.LINGER, 2000)
        self.socket.bind(address)
        # The loop's sends go to the inbox thread over inproc, in order; messages come back in a queue.
        self._outbound_address = f"inproc://engine-outbound-{id(self)}"
        self._outbound_pull = self.ctx.socket(zmq.PULL)
        self._outbound_pull.bind(self._outbound_address)
        self._outbound = self.ctx.socket(zmq.PUSH)
        self._outbound.setsockopt(zmq.SNDHWM, 0)
        self._outbound.setsockopt(zmq.LINGER, 0)  # closed after the inbox thread took all it will take
        self._outbound.connect(self._outbound_address)
        self.inbound: queue.SimpleQueue = queue.SimpleQueue()
        self._pending_adds = 0  # AddRequests in ``inbound`` the loop has not taken yet
        self._pending_lock = threading.Lock()
        self._loop_seen = time.monotonic()  # the loop's last turn: a stale one means it may be hung
        self._inbox_thread = threading.Thread(target=self._inbox, name="kvloom-engine-inbox", daemon=True)
        self._inbox_thread.start()
        self.core = None
        self.ready: EngineReady | None = None
        self.frontends: dict[bytes, str] = {}  # ZeroMQ identity -> frontend id
        self.owners: dict[str, bytes] = {}  # request id -> identity of the frontend that sent it
        self.outbox: dict[bytes, list[TokenDelta]] = defaultdict(list)
        self.draining = False  # finish what is running, refuse new requests, then exit
        self.stop_now = False
        self.stats_log = EngineStatsLog(config.stats_log_interval)
        self._next_trim: float | None = None  # a CPU engine's next heap trim (time.monotonic())

    # --- lifecycle ---------------------------------------------------------------------------------
    def load(self) -> None:
        from kvloom.core.worker.cpu_threads import prepare_openmp

        prepare_openmp()  # before torch loads OpenMP, which reads its settings then
        self.core = self.build(self.config)  # torch and the model code load here only
        if self.core.adapters is not None and self.model_name in self.core.adapters.by_name:
            raise ValueError(f"LoRA adapter {self.model_name!r} has the served model's name; give it another")
        if self.gate is not None:
            self.core.gate = self.gate
        self.ready = EngineReady(
            model_name=self.model_name, max_model_len=self.core.max_model_len, vocab_size=self.core.vocab_size,
            num_kv_blocks=self.core.kv.num_blocks, block_size=self.core.config.block_size,
            eos_token_ids=list(self.core.eos_token_ids), plugins=list(self.config.plugins), pid=os.getpid(),
            max_loras=self.config.max_loras if self.config.enable_lora else 0, task=self.core.task,
            pooling=pooling_info(self.core.pooling_config, self.core.hf_config.hidden_size)
            if self.core.pooling_config is not None else None,
        )
        if self.core.device.type == "cpu":
            self._next_trim = time.monotonic() + HEAP_TRIM_INTERVAL_S

    def request_shutdown(self, drain: bool = True) -> None:
        if drain and not self.draining:
            self.draining = True
            logger.info("Draining: finishing in-flight requests, refusing new ones")
        else:
            self.stop_now = True

    def run(self) -> None:
        core = self.core
        while not self.stop_now and not (self.draining and not core.has_unfinished()):
            self._loop_seen = time.monotonic()
            self._drain_inbox(block=not core.has_unfinished())
            if self.stop_now:
                break
            core.check_health()  # a dead tensor-parallel worker ends the loop, idle or not
            self._flush()  # refusals (queue full, over quota) go now, not after a step: milliseconds
            if core.has_unfinished():
                deltas = core.step()
                for delta in deltas:
                    self._route(delta)
                self.stats_log.record_step(core.last_step_tokens, sum(len(d.new_token_ids) for d in deltas))
            self._flush()
            self.stats_log.maybe_log(core.stats)
            self._trim_heap()
            self._beat()
        if core.has_unfinished():
            for delta in core.abort_requests(list(self.owners)):
                self._route(delta)
            self._flush()

    def _trim_heap(self) -> None:
        if self._next_trim is None or time.monotonic() < self._next_trim:
            return
        from kvloom.core.worker.cpu_malloc import release_free_memory

        release_free_memory()
        self._next_trim = time.monotonic() + HEAP_TRIM_INTERVAL_S

    def _beat(self) -> None:
        # Sent from the loop itself, between steps: a loop stuck in one step (or stopped) stops beating.
        if self.heartbeat_interval is None or time.monotonic() < self._next_beat:
            return
        self._next_beat = time.monotonic() + self.heartbeat_interval
        beat = Heartbeat(num_unfinished=len(self.owners))
        for ident in list(self.frontends):
            self._send(ident, beat)

    def close(self, message: str) -> None:
        """Tell every frontend the engine is gone (its in-flight requests are over), then close."""
        self.fail_frontends(message)
        if self.core is not None:
            self.core.shutdown()
        # NOBLOCK: an inbox thread that died has closed its end, and a blocking send would wait for ever.
        with contextlib.suppress(zmq.Again):
            self._outbound.send_multipart([_STOP], zmq.NOBLOCK)
        self._inbox_thread.join(timeout=10)
        self._outbound.close()
        self.ctx.term()

    def wait_for_a_frontend(self, timeout: float) -> None:
        """Read the inbox until a frontend has said hello (or ``timeout``), so a reason sent now reaches it: a model
        that fails at once can fail before the frontends started with it have connected (a busy machine)."""
        deadline = time.monotonic() + timeout
        self._drain_inbox(block=False)
        while not self.frontends and time.monotonic() < deadline:
            self._drain_inbox(block=True)
        self._drain_inbox(block=True)  # the other workers of a frontend that connected with it

    def fail_frontends(self, message: str) -> None:
        for ident in list(self.frontends):
            self._send(ident, EngineError(message=message))
        self.frontends.clear()

    # --- inbox -------------------------------------------------------------------------------------
    def _drain_inbox(self, block: bool) -> None:
        try:
            item = self.inbound.get(timeout=IDLE_POLL_MS / 1000) if block else self.inbound.get_nowait()
        except queue.Empty:
            return
        while True:
            ident, msg = item
            if msg is _GONE:
                self._forget_frontend(ident)
            else:
                if isinstance(msg, AddRequest):
                    with self._pending_lock:
                        self._pending_adds -= 1
                if isinstance(msg, Exception):
                    self._reject_malformed(ident, *msg.args)
                else:
                    self._handle(ident, msg)
            try:
                item = self.inbound.get_nowait()
            except queue.Empty:
                return

    # --- the inbox thread: owns the socket --------------------------------------------------------
    def _inbox(self) -> None:
        poller = zmq.Poller()
        poller.register(self.socket, zmq.POLLIN)
        poller.register(self._outbound_pull, zmq.POLLIN)
        try:
            while True:
                ready = dict(poller.poll())
                if self._outbound_pull in ready and not self._send_outbound():
                    return
                if self.socket in ready:
                    self._receive()
        except zmq.ContextTerminated:
            return
        except Exception:  # noqa: BLE001 - a dead inbox would leave every frontend waiting for ever
            logger.exception("The engine's inbox thread failed; stopping the engine")
            self.stop_now = True
        finally:
            self.socket.close()
            self._outbound_pull.close()

    def _send_outbound(self) -> bool:
        """Send everything the loop queued; False once the loop said stop."""
        while True:
            try:
                frames = self._outbound_pull.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return True
            if frames == [_STOP]:
                return False
            try:
                self.socket.send_multipart(frames, zmq.NOBLOCK)
            except zmq.ZMQError as e:
                if e.errno != zmq.EHOSTUNREACH:
                    raise
                self.inbound.put((frames[0], _GONE))

    def _receive(self) -> None:
        while True:
            try:
                frames = self.socket.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return
            if len(frames) != 2:  # [identity, message] is the whole protocol; anything else is not ours
                self.warnings.warning(frames[0], "Dropped a message of %d frames from %r (expected one frame)",
                                      len(frames) - 1, frames[0])
                continue
            ident, data = frames
            try:
                msg = decode_frontend_message(data)
            except (msgspec.DecodeError, msgspec.ValidationError, RecursionError) as e:
                self.inbound.put((ident, _Malformed(data, e)))
                continue
            if isinstance(msg, AddRequest):
                if self._refuse_now(ident, msg):
                    continue
                with self._pending_lock:
                    self._pending_adds += 1
            self.inbound.put((ident, msg))

    def _refuse_now(self, ident: bytes, msg: AddRequest) -> bool:
        """Refuse ``msg`` from this thread when the queue cap already turns it away: the waiting queue
        plus the requests handed to the loop and not yet taken. Only while the loop turns (a loop
        silent for half the frontends' heartbeat timeout may be hung: its requests wait for it, and
        so do the frontends' hang checks, which any message from here would reset)."""
        gate, core = self.gate, self.core
        if gate is None or core is None or gate.max_queued_requests is None or self.draining:
            return False
        if ident not in self.frontends:
            return False  # the loop decides about strangers (it never answers them)
        if self.heartbeat_interval is not None and time.monotonic() - self._loop_seen > 2 * self.heartbeat_interval:
            return False
        with self._pending_lock:
            queued = len(core.scheduler.waiting) + self._pending_adds
        refusal = gate.refuse_if_queue_full(queued)
        if refusal is None:
            return False
        delta = _refusal_delta(msg.request_id, refusal)
        try:
            self.socket.send_multipart([ident, encode(StepOutputs(outputs=[delta]))], zmq.NOBLOCK)
        except zmq.ZMQError as e:
            if e.errno != zmq.EHOSTUNREACH:
                raise
            self.inbound.put((ident, _GONE))
        return True

    def _reject_malformed(self, ident: bytes, data: bytes, error: Exception) -> None:
        """A message that fails validation is dropped; if it was an AddRequest of a registered frontend,
        the frontend is told, so the request ends (and frees its admission slot) instead of waiting for
        outputs that never come. A peer that has not registered is never answered."""
        request_id = _add_request_id(data) if ident in self.frontends else None
        if request_id is None:
            self.warnings.warning(ident, "Dropped a malformed message from %s %r: %s", "frontend"
                                  if ident in self.frontends else "unregistered peer", ident, error)
            return
        self.warnings.warning(ident, "Rejected request %r from frontend %r: %s", request_id, ident, error)
        self.outbox[ident].append(_error_delta(request_id, f"invalid request: {error}", "rejected"))

    def _handle(self, ident: bytes, msg) -> None:
        if isinstance(msg, RegisterFrontend):
            self._register(ident, msg)
            return
        if ident not in self.frontends:  # never obeyed, never answered
            self.warnings.warning(ident, "Ignored %s from %r: not a registered frontend", type(msg).__name__, ident)
            return
        if isinstance(msg, AddRequest):
            self._add(ident, msg)
        elif isinstance(msg, AbortRequest):
            for delta in self.core.abort_requests(msg.request_ids):
                self._route(delta)
        elif isinstance(msg, Utility):
            self._send(ident, self._utility(msg))
        elif isinstance(msg, Shutdown):
            self.request_shutdown(msg.drain)

    def _register(self, ident: bytes, msg: RegisterFrontend) -> None:
        if self.secret is not None and not hmac.compare_digest(msg.secret.encode(), self.secret.encode()):
            logger.warning("Refused frontend %r (pid %d): wrong or missing secret", msg.frontend_id, msg.pid)
            self._send(ident, EngineError(message="authentication failed: this engine only serves the frontends "
                                                  "of the launch that started it"))
            return
        self.frontends[ident] = msg.frontend_id
        logger.info("Frontend %s (pid %d) connected", msg.frontend_id, msg.pid)
        if self.ready is not None:  # None only while reporting a failed start to everyone waiting
            self._send(ident, self.ready)

    def _add(self, ident: bytes, msg: AddRequest) -> None:
        from kvloom.core.engine.core import RequestRejected
        from kvloom.core.engine.gate import Refusal

        if self.draining:
            self.outbox[ident].append(_error_delta(msg.request_id, "the engine is shutting down", "unavailable"))
            return
        try:
            self.core.add_request(msg)
        except RequestRejected as e:
            self.outbox[ident].append(_error_delta(msg.request_id, str(e), e.error_kind))
            return
        except Refusal as e:
            self.outbox[ident].append(_refusal_delta(msg.request_id, e))
            return
        self.owners[msg.request_id] = ident

    def _utility(self, msg: Utility) -> UtilityResult:
        if msg.method not in UTILITY_METHODS:
            return UtilityResult(call_id=msg.call_id, error=f"unknown utility method {msg.method!r}; "
                                 f"allowed: {list(UTILITY_METHODS)}")
        method = getattr(self.core, msg.method, None)
        if method is None:
            return UtilityResult(call_id=msg.call_id, error=f"this engine has no {msg.method!r} "
                                 "(it may need a plugin that is not enabled)")
        try:
            result = method(*msg.args)
            encode(UtilityResult(call_id=msg.call_id, result=result))  # fail here, not in the send
        except Exception as e:  # noqa: BLE001 - the caller gets the message; the engine keeps running
            kind = getattr(e, "error_kind", "not_found" if isinstance(e, LookupError) else None)
            return UtilityResult(call_id=msg.call_id, error=f"{msg.method} failed: {e}", error_kind=kind)
        return UtilityResult(call_id=msg.call_id, result=result)

    # --- outbox ------------------------------------------------------------------------------------
    def _route(self, delta: TokenDelta) -> None:
        ident = self.owners.get(delta.request_id)
        if ident is None:
            return
        if delta.finish_reason is not None:
            del self.owners[delta.request_id]
        self.outbox[ident].append(delta)

    def _flush(self) -> None:
        if not self.outbox:
            return
        stats = self.core.stats()
        for ident, deltas in self.outbox.items():
            self._send(ident, StepOutputs(outputs=deltas, stats=stats))
        self.outbox.clear()

    def _send(self, ident: bytes, msg) -> None:
        # The inbox thread sends it; a frontend found gone comes back through the inbox (_GONE).
        self._outbound.send_multipart([ident, encode(msg)])

    def _forget_frontend(self, ident: bytes) -> None:
        """A frontend went away: stop its requests so their KV blocks come back."""
        name = self.frontends.pop(ident, ident.decode(errors="replace"))
        orphans = [rid for rid, owner in self.owners.items() if owner == ident]
        for rid in orphans:
            del self.owners[rid]
        if orphans and self.core is not None:
            self.core.abort_requests(orphans)
            logger.warning("Frontend %s is gone; aborted its %d request(s)", name, len(orphans))
        else:
            logger.info("Frontend %s is gone", name)


class _Malformed(Exception):
    """A message that failed validation in the inbox thread, passed to the loop as (data, error)."""


def _add_request_id(data: bytes) -> str | None:
    """The ``request_id`` of a message that looks like an AddRequest but failed validation."""
    try:
        raw = msgspec.msgpack.decode(data)
    except (msgspec.DecodeError, RecursionError):
        return None
    if isinstance(raw, dict) and raw.get("type") == "AddRequest" and isinstance(raw.get("request_id"), str):
        return raw["request_id"]
    return None


def _error_delta(request_id: str, message: str, kind: str) -> TokenDelta:
    return TokenDelta(request_id=request_id, new_token_ids=[], finish_reason="error", error=message, error_kind=kind)


def _refusal_delta(request_id: str, refusal) -> TokenDelta:
    """The error delta of a gate ``Refusal``: its kind, message, Retry-After and rate-limit headers."""
    delta = _error_delta(request_id, refusal.message, refusal.kind)
    delta.retry_after, delta.rate_limit = refusal.retry_after, refusal.rate_limit
    return delta


def serve_engine(config: EngineConfig, address: str, model_name: str | None = None,
                 heartbeat_interval: float | None = None, secret: str | None = None, gate=None, *, build) -> int:
    """Bind, load the model (``build(config)``), run until drained or told to stop. Returns the process exit
    code."""
    server = EngineServer(config, address, model_name, heartbeat_interval, secret, gate, build=build)

    def on_signal(signum, frame):  # first signal drains, a second one stops now
        server.request_shutdown(drain=not server.draining)

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    try:
        server.load()
    except Exception as e:  # noqa: BLE001 - reported to the frontends waiting for EngineReady
        logger.error("The engine failed to start: %s", e)
        server.wait_for_a_frontend(FAILED_START_GRACE_S)
        server.close(f"the engine failed to start: {e}")
        return 1
    logger.info("Engine ready at %s", address)
    try:
        server.run()
    except Exception as e:  # noqa: BLE001
        logger.error("The engine loop failed:\n%s", traceback.format_exc())
        server.close(f"the engine failed: {e!r}")
        return 1
    server.close("the engine process has shut down")
    logger.info("Engine stopped")
    return 0
