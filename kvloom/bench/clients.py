"""The load generator's processes: one level's streams split over client processes (spawned, so each
has its own interpreter and event loop), each sending requests and timing their SSE chunks, their
per-request records merged into one list. One Python process cannot read and time the SSE events of a
few hundred streams on a fast server; then the timings it reports are its own, not the server's."""

from __future__ import annotations

import asyncio
import json
import math
import multiprocessing as mp
import queue
import random
import time
import traceback
from dataclasses import asdict, dataclass
from typing import Any, Callable

import httpx

from kvloom.bench.metrics import RequestResult
from kvloom.bench.request import timed_request
from kvloom.core.worker.cpu_threads import available_cores

STREAMS_PER_CLIENT = 64  # streams one client process times faithfully (the default split)
MAX_CLIENT_PROCESSES = 256
SATURATED_BUSY = 0.9  # a client using more than this fraction of a core is the bottleneck of its own timings
# A client whose event loop wakes this late (90th percentile) stamps its chunks that late: with many streams a
# loop can be far behind while its process still idles part of the time (docs/benchmarks.md).
SATURATED_LAG_MS = 2.0
# A late loop that waited this share of the level for a CPU was held up by other processes (a busy host),
# not by its own work; without that figure, one that late while this idle cannot be late of its own doing.
HOST_WAIT_SHARE = 0.1
SELF_LAG_MIN_BUSY = 0.25
LAG_PROBE_S = 0.005  # how often the loop-lag probe asks to be woken
READY_TIMEOUT_S = 120.0  # a spawned client imports httpx and numpy: seconds on a loaded machine
START_DELAY_S = 0.05  # the shared start time lies this far after the last client is ready

Bodies = list[tuple[dict[str, Any], "int | None"]]


def level_streams(level: dict[str, Any], num_requests: int) -> int:
    """The most requests a level can have in flight."""
    return min(level.get("concurrency") or level.get("max_concurrency") or num_requests, num_requests)


def client_count(level: dict[str, Any], num_requests: int, requested: int | None) -> int:
    """Processes for a level: the number asked for, or one per STREAMS_PER_CLIENT streams capped by the
    available cores; never more than the level's streams (a process needs at least one)."""
    streams = level_streams(level, num_requests)
    n = requested if requested is not None else min(math.ceil(streams / STREAMS_PER_CLIENT), available_cores())
    return max(1, min(n, streams))


def _split(total: int, parts: int) -> list[int]:
    return [total // parts + (i < total % parts) for i in range(parts)]


@dataclass
class ClientShare:
    """One client process's part of a level: its streams (closed loop) or its rate and cap (open loop).
    Rates add up (independent Poisson processes at R/N merge into one at R); caps and streams add up."""

    index: int
    concurrency: int | None = None
    request_rate: float | None = None
    max_concurrency: int | None = None
    quota: int | None = None  # requests this client may take (all-at-once arrivals only)
    seed: str = "0"

    @property
    def streams(self) -> int | None:
        return self.concurrency or self.max_concurrency


def split_level(level: dict[str, Any], n: int, num_requests: int, seed: int) -> list[ClientShare]:
    """The level split over ``n`` client processes."""
    seeds = [f"{seed}-{i}" for i in range(n)]
    if "concurrency" in level:
        return [ClientShare(i, concurrency=c, seed=seeds[i]) for i, c in enumerate(_split(level["concurrency"], n))]
    rate, cap = level["request_rate"], level.get("max_concurrency")
    caps = _split(cap, n) if cap is not None else [None] * n
    # All-at-once arrivals are split by count: otherwise the first client to start would take them all.
    quotas = _split(num_requests, n) if not math.isfinite(rate) else [None] * n
    return [ClientShare(i, request_rate=rate / n, max_concurrency=caps[i], quota=quotas[i], seed=seeds[i])
            for i in range(n)]


class RequestCounter:
    """Hands out the level's request indices, across processes when given a shared ``value``: the level's
    --num-requests holds in total, and a client whose streams free up first takes the next request."""

    def __init__(self, total: int, quota: int | None = None, value: Any = None) -> None:
        self.total, self.quota, self.taken = total, quota, 0
        self._value = value
        self._local = 0

    def take(self) -> int | None:
        if self.quota is not None and self.taken >= self.quota:
            return None
        if self._value is None:
            i, self._local = self._local, self._local + 1
        else:
            with self._value.get_lock():
                i = self._value.value
                self._value.value = i + 1
        if i >= self.total:
            return None
        self.taken += 1
        return i


def cpu_wait_seconds() -> float | None:
    """Seconds this thread has spent runnable but waiting for a CPU (Linux's schedstat), None elsewhere."""
    try:
        with open("/proc/thread-self/schedstat") as f:
            return int(f.read().split()[1]) / 1e9
    except (OSError, IndexError, ValueError):
        return None


@dataclass
class ClientLoad:
    """How busy one client process was over the level: CPU seconds against wall seconds, how late its
    event loop woke for a timer (each chunk it timed was stamped up to that late), and how long the loop
    waited for a CPU that other processes held (``cpu_wait_s``; None where the OS does not say)."""

    index: int
    streams: int | None
    requests: int
    cpu_s: float
    wall_s: float
    lag_p50_ms: float = 0.0
    lag_p90_ms: float = 0.0
    lag_max_ms: float = 0.0
    cpu_wait_s: float | None = None

    @property
    def busy(self) -> float:
        return self.cpu_s / self.wall_s if self.wall_s > 0 else 0.0

    @property
    def cpu_wait_share(self) -> float | None:
        return None if self.cpu_wait_s is None or self.wall_s <= 0 else self.cpu_wait_s / self.wall_s

    @property
    def late_cause(self) -> str | None:
        """Why this client's timings are not the server's alone: "client" (its own work: more client
        processes help), "host" (other processes held the CPUs: they would not), or None."""
        if self.busy > SATURATED_BUSY:
            return "client"
        if self.lag_p90_ms <= SATURATED_LAG_MS:
            return None
        if self.cpu_wait_share is not None:
            return "host" if self.cpu_wait_share >= HOST_WAIT_SHARE else "client"
        return "host" if self.busy < SELF_LAG_MIN_BUSY else "client"

    @property
    def saturated(self) -> bool:
        return self.late_cause == "client"

    @property
    def host_busy(self) -> bool:
        return self.late_cause == "host"

    def as_dict(self) -> dict[str, Any]:
        return {**asdict(self), "busy": round(self.busy, 3), "saturated": self.saturated,
                "host_busy": self.host_busy}


class LoopLag:
    """Measures this event loop's lag: a task asks to be woken every LAG_PROBE_S and records how late it
    woke. A loop busy parsing other streams' chunks wakes late for every one of them alike."""

    def __init__(self) -> None:
        self.lags: list[float] = []
        self._task: asyncio.Task | None = None

    def start(self) -> None:
        self._task = asyncio.create_task(self._probe())

    async def _probe(self) -> None:
        while True:
            due = time.monotonic() + LAG_PROBE_S
            await asyncio.sleep(LAG_PROBE_S)
            self.lags.append(max(0.0, time.monotonic() - due))

    async def stop(self) -> dict[str, float]:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
        if not self.lags:
            return {}
        ordered = sorted(self.lags)
        at = lambda q: ordered[min(len(ordered) - 1, int(q * len(ordered)))] * 1000  # noqa: E731
        return {"lag_p50_ms": round(at(0.5), 3), "lag_p90_ms": round(at(0.9), 3), "lag_max_ms": round(ordered[-1] * 1000, 3)}


async def drive(spec, endpoint: str, bodies: Bodies, share: ClientShare, counter: RequestCounter, t0: float,
                on_done: Callable[[], None] | None = None) -> tuple[list[RequestResult], ClientLoad]:
    """Send this client's part of a level, timed against the shared start ``t0`` (time.monotonic(), which
    is one clock for every process of the machine); requests still running at the deadline are cut off."""
    deadline = t0 + spec.max_duration_s
    results: list[RequestResult] = []
    await asyncio.sleep(max(0.0, t0 - time.monotonic()))
    cpu0, wait0 = time.process_time(), cpu_wait_seconds()
    lag = LoopLag()
    lag.start()

    async def one(client: httpx.AsyncClient, index: int) -> None:
        body, prompt_len = bodies[index]
        result = RequestResult(start=time.monotonic() - t0, client=share.index)
        results.append(result)
        try:
            await timed_request(client, spec, endpoint, body, result, prompt_len)
        except asyncio.CancelledError:
            result.incomplete = True
            raise
        finally:
            if on_done is not None:
                on_done()

    async def stream(client: httpx.AsyncClient) -> None:  # closed loop: one request after another
        while time.monotonic() < deadline and (index := counter.take()) is not None:
            await one(client, index)

    async def arrival(client: httpx.AsyncClient, index: int, gate: asyncio.Semaphore) -> None:
        async with gate:
            if time.monotonic() < deadline:
                await one(client, index)

    limit = share.streams or len(bodies)
    limits = httpx.Limits(max_connections=limit, max_keepalive_connections=limit)
    async with httpx.AsyncClient(limits=limits, timeout=spec.request_timeout_s) as client:
        if share.concurrency is not None:
            tasks = [asyncio.create_task(stream(client)) for _ in range(share.concurrency)]
        else:
            rng, gate, tasks = random.Random(share.seed), asyncio.Semaphore(limit), []
            next_arrival = t0
            while True:
                if math.isfinite(share.request_rate):
                    next_arrival += rng.expovariate(share.request_rate)  # Poisson arrivals
                    await asyncio.sleep(max(0.0, min(next_arrival, deadline) - time.monotonic()))
                if time.monotonic() >= deadline or (index := counter.take()) is None:
                    break
                tasks.append(asyncio.create_task(arrival(client, index, gate)))
        if tasks:
            _, pending = await asyncio.wait(tasks, timeout=max(0.0, deadline - time.monotonic()))
            for task in pending:
                task.cancel()
            await asyncio.gather(*pending, return_exceptions=True)
    wait1 = cpu_wait_seconds()
    load = ClientLoad(share.index, share.streams, len(results), time.process_time() - cpu0, time.monotonic() - t0,
                      **await lag.stop(), cpu_wait_s=None if wait0 is None or wait1 is None else round(wait1 - wait0, 4))
    return results, load


def _client_main(spec, endpoint: str, bodies: Bodies, share: ClientShare, shared_counter, total: int,
                 start, ready, results) -> None:
    """A spawned client process: report ready, wait for the shared start time, run, send back plain data
    (JSON text: the per-request records and this process's CPU load)."""
    try:
        counter = RequestCounter(total, share.quota, shared_counter)
        ready.put(share.index)
        if not start["event"].wait(READY_TIMEOUT_S * 2):
            raise RuntimeError("the other client processes were not ready in time")
        records, load = asyncio.run(drive(spec, endpoint, bodies, share, counter, start["t0"].value))
        results.put(json.dumps({"index": share.index, "load": asdict(load),
                                "requests": [asdict(r) for r in records]}))
    except BaseException as e:  # the parent waits for every client: tell it, never leave it hanging
        results.put(json.dumps({"index": share.index, "error": f"{type(e).__name__}: {e}\n{traceback.format_exc()}"}))


def run_level_in_processes(spec, endpoint: str, bodies: Bodies, shares: list[ClientShare], progress=None
                           ) -> tuple[list[RequestResult], list[ClientLoad]]:
    """Run one level's ``shares`` in as many spawned processes; the records come back merged, in the
    order the clients sent them."""
    ctx = mp.get_context("spawn")  # no fork: the parent may hold threads (tqdm, httpx) and event loops
    shared_counter = ctx.Value("q", 0)
    start = {"event": ctx.Event(), "t0": ctx.Value("d", 0.0)}
    ready, results = ctx.Queue(), ctx.Queue()
    procs = [ctx.Process(target=_client_main, name=f"kvloom-bench-client-{s.index}", daemon=True,
                         args=(spec, endpoint, bodies, s, shared_counter, len(bodies), start, ready, results))
             for s in shares]
    try:
        for p in procs:
            p.start()
        for _ in procs:
            _get(ready, procs, READY_TIMEOUT_S, "start")
        start["t0"].value = time.monotonic() + START_DELAY_S
        start["event"].set()
        replies = []
        timeout = spec.max_duration_s + spec.request_timeout_s + READY_TIMEOUT_S
        deadline = time.monotonic() + timeout
        while len(replies) < len(procs):
            reply = _get(results, procs, max(0.0, deadline - time.monotonic()), "finish", poll=0.25,
                         on_poll=(lambda: progress(shared_counter.value)) if progress else None)
            replies.append(json.loads(reply))
        for p in procs:
            p.join(10)
    finally:
        for p in procs:
            if p.is_alive():
                p.terminate()
                p.join(5)
    errors = [r["error"] for r in replies if "error" in r]
    if errors:
        raise RuntimeError(f"a bench client process failed: {errors[0]}")
    replies.sort(key=lambda r: r["index"])
    records = [RequestResult(**rec) for r in replies for rec in r["requests"]]
    return records, [ClientLoad(**r["load"]) for r in replies]


def _get(q, procs, timeout: float, what: str, poll: float = 1.0, on_poll=None):
    """``q.get`` that notices a client process that died without a word."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            return q.get(timeout=min(poll, max(0.01, deadline - time.monotonic())))
        except queue.Empty:
            if on_poll is not None:
                on_poll()
            dead = [p for p in procs if p.exitcode not in (None, 0)]
            if dead:
                raise RuntimeError(f"bench client process {dead[0].name} exited with code {dead[0].exitcode} "
                                   f"before it could {what}") from None
            if time.monotonic() >= deadline:
                raise RuntimeError(f"bench client processes did not {what} within {timeout:g}s") from None
