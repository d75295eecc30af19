"""The engine router's choices over fake replicas (no engine process): prefix affinity, the overload
spill, load balance, round-robin, a dead replica taken out and its reason, a dead replica rejoined,
stats summed and per replica."""

from __future__ import annotations

import asyncio

import pytest

from kvloom.core.messages import EngineReady, EngineStats, TokenDelta
from kvloom.core.sampling_params import SamplingParams
from kvloom.frontends.engine_client import EngineUnavailable
from kvloom.frontends.router import EngineRouter, prefix_keys

BLOCK = 4
EVENTS: list[tuple[str, int]] = []


class FakeClient:
    """What the router reads of an AsyncEngineClient; each request finishes at once."""

    def __init__(self, address, frontend_id=None, heartbeat_timeout=None, secret=None, reconnect=False):
        self.address = address
        self.frontend_id = frontend_id
        self.reconnect = reconnect
        self.closed = False
        self.events = EVENTS  # the order clients are started and closed in, over all of them
        self.dead_reason = None
        self.hung_reason = None
        self.last_stats = None
        self.in_flight = 0
        self.served: list[list[int]] = []
        self.ready = EngineReady(model_name="m", max_model_len=64, vocab_size=100, num_kv_blocks=8,
                                 block_size=BLOCK, eos_token_ids=[2])

    @property
    def healthy(self):
        return self.dead_reason is None and self.hung_reason is None

    @property
    def unavailable_reason(self):
        return self.dead_reason or self.hung_reason

    @property
    def num_in_flight(self):
        return self.in_flight

    async def start(self, timeout):
        self.events.append(("start", id(self)))
        return self.ready

    async def generate(self, request_id, prompt_token_ids, sampling, priority=0, arrival_time=0.0, **admission):
        self.served.append(prompt_token_ids)
        yield TokenDelta(request_id=request_id, new_token_ids=[7], finish_reason="length")

    async def utility(self, method, *args, timeout=10.0):
        return {"num_running": 1, "prefix_cache_hits": 3, "kv_usage": 0.5 if self.address == "a" else 0.1}

    def end_all(self, reason):
        pass

    async def close(self):
        self.closed = True
        self.events.append(("close", id(self)))


def make_router(policy="prefix_affinity", n=2) -> EngineRouter:
    router = EngineRouter([chr(ord("a") + i) for i in range(n)], policy=policy, make_client=FakeClient)
    router.ready = router.replicas[0].client.ready  # what start() sets, without its background watcher
    return router


def run(router: EngineRouter, prompt: list[int]) -> int:
    """Send one request; the index of the replica that served it."""
    async def go():
        async for _ in router.generate("r", prompt, SamplingParams(max_tokens=1)):
            pass
    before = [len(r.client.served) for r in router.replicas]
    asyncio.run(go())
    return next(r.index for r, n in zip(router.replicas, before) if len(r.client.served) > n)


def test_prefix_keys_chain_full_blocks_only():
    assert prefix_keys([1, 2, 3], BLOCK) == []
    a, b = prefix_keys([1, 2, 3, 4, 5, 6, 7, 8, 9], BLOCK), prefix_keys([1, 2, 3, 4, 5, 6, 7, 8, 0, 0], BLOCK)
    assert len(a) == 2 and a == b  # the partial block does not count
    other_second = prefix_keys([1, 2, 3, 4, 9, 9, 9, 9], BLOCK)
    assert other_second[0] == a[0] and other_second[1] != a[1]
    # Key 2 names the whole prefix: the same second block after another first block is another key.
    assert prefix_keys([9, 9, 9, 9, 5, 6, 7, 8], BLOCK)[1] != a[1]


def test_same_prefix_goes_to_the_same_replica_and_new_prefixes_spread():
    router = make_router()
    system_a, system_b = [11, 12, 13, 14, 15, 16, 17, 18], [21, 22, 23, 24, 25, 26, 27, 28]
    first_a = run(router, system_a + [1])
    first_b = run(router, system_b + [1])
    assert first_a != first_b  # a new prefix goes to the less-used replica
    for q in range(2, 6):
        assert run(router, system_a + [q]) == first_a
        assert run(router, system_b + [q, q]) == first_b


def test_an_overloaded_owner_spills_to_the_least_loaded_without_losing_the_prefix():
    router = make_router()
    prompt = [1, 2, 3, 4, 5, 6, 7, 8]
    owner = run(router, prompt)
    router.replicas[owner].client.last_stats = EngineStats(num_running=8, num_waiting=3)
    assert run(router, prompt + [9]) != owner
    router.replicas[owner].client.last_stats = EngineStats(num_running=2)
    assert run(router, prompt + [10]) == owner  # the prefix still belongs to its first replica


def test_round_robin_alternates_and_least_loaded_follows_load():
    rr = make_router("round_robin")
    prompt = [1, 2, 3, 4, 5]
    assert [run(rr, prompt) for _ in range(4)] == [0, 1, 0, 1]
    ll = make_router("least_loaded", n=3)
    ll.replicas[0].client.last_stats = EngineStats(num_waiting=5)
    ll.replicas[1].client.last_stats = EngineStats(num_running=1)
    assert run(ll, [1, 2, 3, 4, 5]) == 2


def test_a_dead_replica_is_skipped_and_all_dead_says_why():
    router = make_router()
    router.replicas[0].client.dead_reason = "the engine process went away (connection lost)"
    assert router.healthy and all(run(router, [i, 1, 2, 3, 4]) == 1 for i in range(4))
    states = router.replica_states()
    assert [s["healthy"] for s in states] == [False, True] and "went away" in states[0]["reason"]
    router.replicas[1].client.hung_reason = "the engine has not answered for 31.0s"
    assert not router.healthy
    assert router.unavailable_reason == ("all 2 replicas are unavailable: replica 0: the engine process went "
                                         "away (connection lost); replica 1: the engine has not answered for 31.0s")
    with pytest.raises(EngineUnavailable, match="all 2 replicas"):
        router.choose([1, 2, 3])


@pytest.mark.parametrize("reconnect", [False, True])
def test_a_dead_replica_rejoins(monkeypatch, reconnect):
    """Without ``reconnect`` the router replaces a dead replica's client, closing the old one first (its
    socket would hold this frontend's identity at the engine); with it, the client reconnects itself."""
    from kvloom.frontends import router as router_module

    monkeypatch.setattr(router_module, "REJOIN_INTERVAL_S", 0.01)

    async def go():
        router = EngineRouter(["a", "b"], make_client=FakeClient, reconnect=reconnect)
        await router.start(1.0)
        dead = router.replicas[0].client
        dead.dead_reason = "the engine process went away (connection lost)"
        EVENTS.clear()
        for _ in range(50):
            await asyncio.sleep(0.01)
            if router.replicas[0].client is not dead:
                break
        replaced, events = router.replicas[0].client, list(EVENTS)
        await router.close()
        return dead, replaced, events

    dead, replaced, events = asyncio.run(go())
    if reconnect:  # left alone: not closed, no second client started
        assert replaced is dead and events == []
    else:
        assert replaced is not dead and replaced.healthy
        assert events == [("close", id(dead)), ("start", id(replaced))]


def test_replica_stats_ask_each_live_replica():
    router = make_router()
    router.replicas[1].client.dead_reason = "gone"
    assert asyncio.run(router.replica_stats()) == [
        (0, True, {"num_running": 1, "prefix_cache_hits": 3, "kv_usage": 0.5}), (1, False, None)]


def test_stats_are_summed_over_live_replicas():
    router = make_router()
    stats = asyncio.run(router.utility("stats"))
    assert stats == {"num_running": 2, "prefix_cache_hits": 6, "kv_usage": pytest.approx(0.3)}


def test_replicas_must_agree_on_the_model():
    router = EngineRouter(["a", "b"], make_client=FakeClient)
    router.replicas[1].client.ready = EngineReady(model_name="m", max_model_len=32, vocab_size=100,
                                                  num_kv_blocks=8, block_size=BLOCK, eos_token_ids=[2])
    with pytest.raises(EngineUnavailable, match="replica 1 at b has max_model_len=32 but replica 0 has 64"):
        asyncio.run(router.start(1.0))


def test_unknown_policy_is_refused():
    with pytest.raises(ValueError, match="routing policy 'random' is not one of"):
        EngineRouter(["a"], policy="random")


def test_plan_rows_for_data_parallel_replicas(tmp_path, capsys):
    import json

    from benchmarks.shapes import SHAPES
    from kvloom.cli.main import main

    path = tmp_path / "config.json"
    path.write_text(json.dumps(SHAPES["llama-2-7b"]))
    assert main(["plan", "--config-json", str(path), "--gpu-memory", "80", "--tensor-parallel-sizes", "1,2",
                 "--data-parallel-sizes", "1,4", "--json"]) == 0
    plan = json.loads(capsys.readouterr().out)
    by_tp = {r["tensor_parallel"]: r for r in plan["rows"]}
    assert [(r["data_parallel"], r["tensor_parallel"], r["devices"]) for r in plan["replicas"]] == [(4, 1, 4), (4, 2, 8)]
    for r in plan["replicas"]:  # four whole engines: four times one engine's capacity and weights
        assert r["kv_tokens"] == 4 * by_tp[r["tensor_parallel"]]["kv_tokens"]
        assert r["weight_bytes"] == 4 * plan["weight_bytes"]
        assert r["max_concurrency"] == pytest.approx(4 * by_tp[r["tensor_parallel"]]["max_concurrency"], rel=1e-3)
    assert main(["plan", "--config-json", str(path), "--gpu-memory", "80", "--data-parallel-sizes", "2"]) == 0
    text = capsys.readouterr().out
    assert "DP" in text and "KV tokens (all)" in text
    assert main(["plan", "--config-json", str(path), "--gpu-memory", "80", "--data-parallel-sizes", "0"]) == 2
    assert "--data-parallel-sizes='0': give sizes >= 1" in capsys.readouterr().err
