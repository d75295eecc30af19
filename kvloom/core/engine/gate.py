"""The engine's admission gate: engine-wide caps on the waiting queue and per-API-key quotas (token
buckets of requests and tokens per minute, concurrency), checked at ``AddRequest``. They live here,
in the one engine process, so however many API workers and gateways feed it no race between them
can admit more than a cap allows. Pure bookkeeping: no torch."""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field
from typing import Callable

from kvloom.core.messages import RateLimitInfo

QUEUE_FULL_RETRY_S = 1.0  # a full queue drains by finished requests: seconds, not minutes
QUEUE_WAIT_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60)


class Refusal(Exception):
    """A request the gate turns away. ``kind`` is the TokenDelta ``error_kind`` the frontend maps to a
    status: ``queue_full`` and ``rate_limited`` (429, retry after ``retry_after`` seconds) or
    ``rejected`` (400: it can never pass, e.g. it alone is over a per-minute quota)."""

    def __init__(self, kind: str, message: str, retry_after: float | None = None,
                 rate_limit: RateLimitInfo | None = None) -> None:
        super().__init__(message)
        self.kind = kind
        self.message = message
        self.retry_after = retry_after
        self.rate_limit = rate_limit


@dataclass(frozen=True)
class KeyQuota:
    """One API key's limits (None: unlimited), by the key's name; ``[[api_keys]]`` in the config file."""

    name: str
    requests_per_minute: int | None = None
    tokens_per_minute: int | None = None
    max_concurrent: int | None = None


class TokenBucket:
    """``per_minute`` units, refilled continuously; starts full (a fresh key may burst its minute)."""

    def __init__(self, per_minute: int, now: float) -> None:
        self.capacity = float(per_minute)
        self.level = float(per_minute)
        self.rate = per_minute / 60.0
        self.stamp = now

    def refill(self, now: float) -> None:
        self.level = min(self.capacity, self.level + (now - self.stamp) * self.rate)
        self.stamp = now

    def wait_for(self, amount: float) -> float:
        """Seconds until ``amount`` units are in the bucket (0 if they are now)."""
        return max(0.0, (amount - self.level) / self.rate)

    def reset_in(self) -> float:
        """Seconds until the bucket is full again."""
        return (self.capacity - self.level) / self.rate


@dataclass
class _KeyState:
    quota: KeyQuota
    requests: TokenBucket | None
    tokens: TokenBucket | None
    in_flight: int = 0


@dataclass
class _Charge:
    key: _KeyState | None
    tokens: int  # charged at admission: prompt + max_tokens


@dataclass
class GateCounters:
    rejected_queue_full: int = 0
    rate_limited: dict[str, int] = field(default_factory=dict)  # key name -> refusals
    queue_wait_buckets: list[int] = field(default_factory=lambda: [0] * (len(QUEUE_WAIT_BUCKETS) + 1))
    queue_wait_sum: float = 0.0


class AdmissionGate:
    def __init__(self, max_queued_requests: int | None = None, max_queued_tokens: int | None = None,
                 quotas: list[KeyQuota] = (), clock: Callable[[], float] = time.monotonic) -> None:
        self.max_queued_requests = max_queued_requests
        self.max_queued_tokens = max_queued_tokens
        self.clock = clock
        now = clock()
        self.keys = {q.name: _KeyState(q, _bucket(q.requests_per_minute, now), _bucket(q.tokens_per_minute, now))
                     for q in quotas}
        self.charges: dict[str, _Charge] = {}
        self.counters = GateCounters()
        # The engine's inbox thread refuses over-cap requests while the loop runs a step
        # (``refuse_if_queue_full``); the counters it bumps are shared with the loop's thread.
        self._count_lock = threading.Lock()

    def admit(self, request_id: str, key_name: str, num_prompt_tokens: int, max_tokens: int,
              queued_requests: int, queued_tokens: int) -> None:
        """Take the request in (charging its key) or raise Refusal. ``queued_*``: the engine's waiting
        queue now, without this request."""
        self._check_queue(num_prompt_tokens, queued_requests, queued_tokens)
        key = self.keys.get(key_name) if key_name else None
        charge = num_prompt_tokens + max_tokens
        if key is not None:
            self._charge_key(key, charge)
        self.charges[request_id] = _Charge(key, charge)

    def _check_queue(self, num_prompt_tokens: int, queued_requests: int, queued_tokens: int) -> None:
        cap = self.max_queued_tokens
        if cap is not None and num_prompt_tokens > cap:
            raise Refusal("rejected", f"the prompt has {num_prompt_tokens} tokens, over max_queued_tokens={cap}: "
                          "it could never wait in the queue")
        refusal = self.refuse_if_queue_full(queued_requests)
        if refusal is not None:
            raise refusal
        if cap is not None and queued_tokens + num_prompt_tokens > cap:
            self._count_queue_full()
            raise Refusal("queue_full", f"the engine's queue is full ({queued_tokens} prompt tokens waiting + "
                          f"{num_prompt_tokens} > max_queued_tokens={cap}); retry later", QUEUE_FULL_RETRY_S)

    def refuse_if_queue_full(self, queued_requests: int) -> Refusal | None:
        """The refusal (counted) of one more request when ``queued_requests`` already wait and
        ``max_queued_requests`` allows no more; None while there is room. Safe from any thread."""
        cap = self.max_queued_requests
        if cap is None or queued_requests < cap:
            return None
        self._count_queue_full()
        return Refusal("queue_full", f"the engine's queue is full ({queued_requests} requests waiting, "
                       f"max_queued_requests={cap}); retry later", QUEUE_FULL_RETRY_S)

    def _count_queue_full(self) -> None:
        with self._count_lock:
            self.counters.rejected_queue_full += 1

    def _charge_key(self, key: _KeyState, tokens: int) -> None:
        q = key.quota
        now = self.clock()
        for bucket in (key.requests, key.tokens):
            if bucket is not None:
                bucket.refill(now)
        if key.tokens is not None and tokens > key.tokens.capacity:
            raise Refusal("rejected", f"the request asks for {tokens} tokens (prompt + max_tokens), over the "
                          f"key {q.name!r}'s tokens_per_minute={q.tokens_per_minute}: lower max_tokens")
        problem, wait = None, 0.0
        if q.max_concurrent is not None and key.in_flight >= q.max_concurrent:
            problem, wait = f"{key.in_flight} requests in flight, max_concurrent={q.max_concurrent}", 1.0
        elif key.requests is not None and key.requests.level < 1:
            problem, wait = f"requests_per_minute={q.requests_per_minute}", key.requests.wait_for(1)
        elif key.tokens is not None and key.tokens.level < tokens:
            problem = (f"tokens_per_minute={q.tokens_per_minute} ({tokens} asked, "
                       f"{int(key.tokens.level)} left)")
            wait = key.tokens.wait_for(tokens)
        if problem is not None:
            self.counters.rate_limited[q.name] = self.counters.rate_limited.get(q.name, 0) + 1
            raise Refusal("rate_limited", f"rate limit reached for API key {q.name!r}: {problem}; retry in "
                          f"{max(wait, 0.001):.3g}s", max(wait, 0.001), self._info(key))
        if key.requests is not None:
            key.requests.level -= 1
        if key.tokens is not None:
            key.tokens.level -= tokens
        key.in_flight += 1

    def _info(self, key: _KeyState) -> RateLimitInfo:
        r, t = key.requests, key.tokens
        return RateLimitInfo(
            limit_requests=int(r.capacity) if r else None, remaining_requests=int(r.level) if r else None,
            reset_requests=r.reset_in() if r else None, limit_tokens=int(t.capacity) if t else None,
            remaining_tokens=max(0, int(t.level)) if t else None, reset_tokens=t.reset_in() if t else None)

    def release(self, request_id: str, used_tokens: int) -> None:
        """The request is over, having used ``used_tokens`` (prompt + generated): free its concurrency
        slot and give back what it was charged but did not use (a request that stopped early paid for
        its whole max_tokens at admission)."""
        charge = self.charges.pop(request_id, None)
        if charge is None or charge.key is None:
            return
        key = charge.key
        key.in_flight -= 1
        if key.tokens is not None:
            key.tokens.refill(self.clock())
            key.tokens.level = min(key.tokens.capacity, key.tokens.level + max(0, charge.tokens - used_tokens))

    def observe_queue_wait(self, seconds: float) -> None:
        c = self.counters
        c.queue_wait_sum += seconds
        index = next((i for i, b in enumerate(QUEUE_WAIT_BUCKETS) if seconds <= b), len(QUEUE_WAIT_BUCKETS))
        c.queue_wait_buckets[index] += 1


def _bucket(per_minute: int | None, now: float) -> TokenBucket | None:
    return None if per_minute is None else TokenBucket(per_minute, now)

