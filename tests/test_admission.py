"""Admission without a server: the engine's gate (queue caps, per-key token buckets, refunds), the key
ring (sha256 or plain keys, 401s), the config's [[api_keys]] checks, the scheduler dropping expired
requests before a step is spent on them, and the engine's refusals as HTTP errors."""

from __future__ import annotations

import hashlib

import pytest

from kvloom.core.config import ConfigError
from kvloom.core.engine.gate import AdmissionGate, KeyQuota, Refusal
from kvloom.core.engine.kv_cache import KVCacheManager
from kvloom.core.engine.request import Request, RequestStatus
from kvloom.core.engine.scheduler import Scheduler
from kvloom.core.messages import RateLimitInfo, TokenDelta
from kvloom.core.sampling_params import SamplingParams
from kvloom.frontends.admission import KeyRing, check_timeout, effective_priority, engine_refusal, parse_api_keys
from kvloom.frontends.config import ServerConfig
from kvloom.frontends.errors import RequestError
from kvloom.plugins.builtin.fcfs import FCFSPolicy


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def test_queue_caps_refuse_with_retry_after_and_count():
    gate = AdmissionGate(max_queued_requests=2, max_queued_tokens=10)
    gate.admit("a", "", 4, 8, queued_requests=1, queued_tokens=4)
    with pytest.raises(Refusal) as e:
        gate.admit("b", "", 4, 8, queued_requests=2, queued_tokens=8)
    assert e.value.kind == "queue_full" and e.value.retry_after > 0 and "max_queued_requests=2" in e.value.message
    with pytest.raises(Refusal) as e:
        gate.admit("c", "", 7, 8, queued_requests=1, queued_tokens=4)
    assert e.value.kind == "queue_full" and "max_queued_tokens=10" in e.value.message
    with pytest.raises(Refusal) as e:  # could never wait in the queue: not worth a retry
        gate.admit("d", "", 11, 8, queued_requests=0, queued_tokens=0)
    assert e.value.kind == "rejected"
    assert gate.counters.rejected_queue_full == 2


def test_key_buckets_charge_prompt_plus_max_tokens_and_refund_real_usage():
    clock = Clock()
    gate = AdmissionGate(quotas=[KeyQuota("team", requests_per_minute=3, tokens_per_minute=100)], clock=clock)
    gate.admit("r1", "team", 4, 80, 0, 0)  # charged 84 of 100
    with pytest.raises(Refusal) as e:
        gate.admit("r2", "team", 4, 80, 0, 0)
    refusal = e.value
    assert refusal.kind == "rate_limited" and "tokens_per_minute=100" in refusal.message
    info = refusal.rate_limit
    assert (info.limit_requests, info.remaining_requests, info.limit_tokens, info.remaining_tokens) == (3, 2, 100, 16)
    assert refusal.retry_after == pytest.approx((84 - 16) * 60 / 100)
    gate.release("r1", used_tokens=6)  # stopped after 2 tokens: 78 of its 84 come back
    gate.admit("r2", "team", 4, 80, 0, 0)
    gate.release("r2", used_tokens=84)
    gate.admit("r3", "team", 1, 1, 0, 0)
    with pytest.raises(Refusal, match="requests_per_minute=3"):  # three requests in this minute
        gate.admit("r4", "team", 1, 1, 0, 0)
    clock.now += 20.0  # a third of a minute refills one request
    gate.admit("r4", "team", 1, 1, 0, 0)
    assert gate.counters.rate_limited == {"team": 2}
    with pytest.raises(Refusal) as e:  # alone over the minute's tokens: no retry can help
        gate.admit("big", "team", 50, 60, 0, 0)
    assert e.value.kind == "rejected" and "tokens_per_minute=100" in e.value.message
    gate.admit("other", "", 4, 80, 0, 0)  # no key, no quota


def test_max_concurrent_counts_until_release():
    gate = AdmissionGate(quotas=[KeyQuota("k", max_concurrent=2)])
    gate.admit("a", "k", 1, 1, 0, 0)
    gate.admit("b", "k", 1, 1, 0, 0)
    with pytest.raises(Refusal, match="max_concurrent=2"):
        gate.admit("c", "k", 1, 1, 0, 0)
    gate.release("a", 2)
    gate.release("a", 2)  # a second release of the same request gives nothing back
    gate.admit("c", "k", 1, 1, 0, 0)
    with pytest.raises(Refusal, match="max_concurrent=2"):
        gate.admit("d", "k", 1, 1, 0, 0)


def test_keys_from_the_config_plain_or_sha256_and_checked():
    plain, hashed = "sk-plain-1", "sk-hashed-2"
    keys = parse_api_keys([
        {"key": plain, "name": "alice", "requests_per_minute": 10, "priority": 5},
        {"key_sha256": hashlib.sha256(hashed.encode()).hexdigest(), "name": "bob", "tokens_per_minute": 1000},
    ], single_key="sk-admin")
    ring = KeyRing(keys)
    assert ring.authenticate(plain).name == "alice"
    assert ring.authenticate(hashed).name == "bob"
    assert ring.authenticate_header("Bearer sk-admin").name == "default"
    for bad in ("sk-plain-", hashlib.sha256(hashed.encode()).hexdigest(), ""):
        with pytest.raises(RequestError) as e:
            ring.authenticate(bad)
        assert e.value.status == 401
    with pytest.raises(RequestError, match="missing API key"):
        ring.authenticate_header(None)
    assert KeyRing([]).authenticate_header(None) is None  # no keys configured: open
    for entries, message in (
        ([{"name": "x"}], "exactly one of key and key_sha256"),
        ([{"key": "a", "key_sha256": "0" * 64, "name": "x"}], "exactly one"),
        ([{"key": "a"}], "api_keys\\[0\\].name"),
        ([{"key": "a", "name": "x", "requests_per_minute": 0}], "requests_per_minute=0 must be an integer >= 1"),
        ([{"key_sha256": "abc", "name": "x"}], "64 hex digits"),
        ([{"key": "a", "name": "x", "rpm": 3}], "unknown field"),
        ([{"key": "a", "name": "x"}, {"key": "b", "name": "x"}], "used twice"),
        ([{"key": "a", "name": "x", "priority": 1.5}], "priority=1.5"),
    ):
        with pytest.raises(ConfigError, match=message):
            ServerConfig(api_keys=entries).validate()
    with pytest.raises(ConfigError, match="gateway_require_api_key"):
        ServerConfig(gateway_require_api_key=True).validate()


def test_a_keys_priority_is_the_default_and_the_best_its_requests_get():
    keys = parse_api_keys([{"key": "a", "name": "batch", "priority": 10}, {"key": "b", "name": "vip",
                                                                           "priority": -5}])
    batch, vip = keys
    assert effective_priority(batch, 0) == 10 and effective_priority(batch, -100) == 10
    assert effective_priority(batch, 20) == 20  # may ask to run later
    assert effective_priority(vip, 0) == -5
    assert effective_priority(None, 3) == 3


def test_request_timeout_may_shorten_the_servers_never_lengthen():
    assert check_timeout(None, 30.0) == 30.0
    assert check_timeout(5, 30.0) == 5.0
    assert check_timeout(100, None) == 100.0
    for bad, message in ((60, "over this server's request_timeout=30s"), (0, "must be a number"),
                         (-1, "must be a number"), (True, "must be a number")):
        with pytest.raises(RequestError, match=message) as e:
            check_timeout(bad, 30.0)
        assert e.value.status == 400 and e.value.param == "timeout"


def test_engine_refusals_become_http_errors_with_headers():
    limited = TokenDelta(request_id="r", new_token_ids=[], finish_reason="error", error="over quota",
                         error_kind="rate_limited", retry_after=2.2,
                         rate_limit=RateLimitInfo(limit_requests=10, remaining_requests=0, reset_requests=6.0,
                                                  limit_tokens=500, remaining_tokens=3, reset_tokens=0.25))
    e = engine_refusal(limited, None, "request_timeout", None)
    assert e.status == 429 and e.reason == "rate_limited"
    assert e.headers == {"Retry-After": "3", "x-ratelimit-limit-requests": "10", "x-ratelimit-remaining-requests": "0",
                         "x-ratelimit-reset-requests": "6s", "x-ratelimit-limit-tokens": "500",
                         "x-ratelimit-remaining-tokens": "3", "x-ratelimit-reset-tokens": "250ms"}
    full = engine_refusal(TokenDelta(request_id="r", new_token_ids=[], error_kind="queue_full", retry_after=1.0),
                          None, "request_timeout", None)
    assert full.status == 429 and full.headers == {"Retry-After": "1"} and full.reason == "queue_full"
    queued = engine_refusal(TokenDelta(request_id="r", new_token_ids=[], error_kind="queue_timeout"), 9.0,
                            "request_timeout", 1.5)
    assert queued.status == 408 and "queue_timeout=1.5s" in queued.message
    ran = engine_refusal(TokenDelta(request_id="r", new_token_ids=[], error_kind="deadline"), 2.0, "timeout", None)
    assert ran.status == 408 and "timeout=2s" in ran.message


def _scheduler(clock, num_blocks=8, max_num_seqs=1):
    from kvloom.plugins.builtin.free_list import FreeListAllocator

    kv = KVCacheManager(FreeListAllocator(num_blocks), 4, None)
    return Scheduler(kv, FCFSPolicy(), max_num_seqs=max_num_seqs, max_num_batched_tokens=64, max_model_len=64,
                     clock=clock)


def _request(rid, clock, **deadlines):
    return Request(rid, [1, 2, 3, 4, 5], SamplingParams(max_tokens=8), arrival_time=clock.now, max_tokens=8,
                   **deadlines)


def test_expired_requests_are_dropped_before_a_step_and_their_blocks_freed():
    clock = Clock()
    sched = _scheduler(clock)
    first_steps = []
    sched.on_first_step = lambda req, now: first_steps.append(req.request_id)
    finished = []
    sched.on_finish = lambda req: finished.append((req.request_id, req.status))
    running = _request("running", clock, deadline=clock.now + 5)
    waiting = _request("waiting", clock, queue_deadline=clock.now + 1)
    sched.add_request(running)
    sched.add_request(waiting)
    plan = sched.schedule()
    assert [s.request_id for s in plan.seqs] == ["running"]  # max_num_seqs=1: the other one waits
    free_with_one_running = sched.kv.num_free_blocks()
    clock.now += 2
    assert [(r.request_id, kind) for r, kind in sched.expire()] == [("waiting", "queue_timeout")]
    assert first_steps == ["running"]  # the dropped one never had a step
    assert not sched.waiting and sched.kv.num_free_blocks() == free_with_one_running
    clock.now += 4
    assert [(r.request_id, kind) for r, kind in sched.expire()] == [("running", "deadline")]
    assert sched.kv.num_free_blocks() == 8 and not sched.has_unfinished()
    assert finished == [("waiting", RequestStatus.FINISHED_ERROR), ("running", RequestStatus.FINISHED_ERROR)]
    assert sched.expire() == []


def test_a_waiting_request_that_cannot_get_its_first_token_before_its_queue_deadline_goes_now():
    clock = Clock()
    sched = _scheduler(clock)
    sched.add_request(_request("late", clock, queue_deadline=clock.now + 1.0))
    sched.add_request(_request("in-time", clock, queue_deadline=clock.now + 3.0))
    clock.now += 0.5
    # Steps take 0.8 s: scheduled now, "late" would show its first token at 1.3 s, past its 1 s deadline.
    assert [(r.request_id, kind) for r, kind in sched.expire(first_token_s=0.8)] == [("late", "queue_timeout")]
    assert [s.request_id for s in sched.schedule().seqs] == ["in-time"]  # its turn went to one that can make it
    assert sched.expire(first_token_s=0.8) == []


def test_the_gateway_asks_for_the_http_servers_keys_unless_told_not_to(caplog):
    from kvloom.frontends.gateway import gateway_keys

    keyed = ServerConfig(api_key="sk-one")
    assert gateway_keys(keyed, "tcp://127.0.0.1:5557").required
    assert gateway_keys(keyed, "ipc:///tmp/gw.sock").required
    assert not gateway_keys(ServerConfig(), "tcp://127.0.0.1:5557").required  # no keys anywhere
    opted_out = keyed.replace(gateway_require_api_key=False)
    assert not gateway_keys(opted_out, "ipc:///tmp/gw.sock").required
    assert "bypasses the keys" not in caplog.text
    assert not gateway_keys(opted_out, "tcp://127.0.0.1:5557").required
    assert "serves without an API key" in caplog.text and "bypasses the keys" in caplog.text
