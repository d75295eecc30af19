"""Data-parallel replicas behind one real server (``engine --data-parallel-size 2`` on a tiny random model):
a burst lands on both replicas with outputs unchanged, same-prefix requests stay on one replica (its
prefix cache hits like one engine's, unlike round-robin's), a replica stopped with SIGSTOP is taken out
and rejoins on SIGCONT, a replica killed with SIGKILL fails only its own requests while the other serves
on and /health says degraded, and with --restart-engine the killed replica comes back and serves again."""

from __future__ import annotations

import contextlib
import json
import os
import queue
import random
import signal
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from tests.server_utils import EngineServer, alive, cmdline, metric_samples

NUM_BLOCKS = 256
# Let a stopped process run for a moment: SIGCONT, sleep, SIGSTOP (argv: pid, seconds).
SLICE = "import os, signal, sys, time; p = int(sys.argv[1]); os.kill(p, signal.SIGCONT); " \
        "time.sleep(float(sys.argv[2])); os.kill(p, signal.SIGSTOP)"
HEARTBEAT_S = 6.0  # the round-robin server's engine_heartbeat_timeout: a SIGSTOPped replica is out after it


def start(model, tmp_path_factory, name: str, *flags: str) -> EngineServer:
    tmp = tmp_path_factory.mktemp(name)
    return EngineServer(["--model", str(model), "--num-kv-blocks", str(NUM_BLOCKS), "--plugins", "prefix_cache",
                         "--max-num-seqs", "8", *flags], tmp)


@pytest.fixture(scope="module")
def single(tiny_llama, tmp_path_factory):
    """One engine: the outputs the replicated servers must give."""
    with start(tiny_llama, tmp_path_factory, "single") as srv:
        yield srv


@pytest.fixture
def restart_server(single, tiny_llama, tmp_path_factory):
    """Two replicas routed round-robin, a killed one restarted: only for its test (the first in this file),
    so that it never runs beside the module's other replicated servers."""
    with start(tiny_llama, tmp_path_factory, "restart", "--data-parallel-size", "2", "--routing-policy",
               "round_robin", "--restart-engine") as srv:
        yield srv


@pytest.fixture(scope="module")
def servers(single, tiny_llama, tmp_path_factory):
    """The single engine, two replicas routed by prefix affinity, two replicas routed round-robin; the last
    two started together so their model loads overlap."""
    started = {
        "affinity": start(tiny_llama, tmp_path_factory, "affinity", "--data-parallel-size", "2"),
        "round_robin": start(tiny_llama, tmp_path_factory, "rr", "--data-parallel-size", "2",
                             "--routing-policy", "round_robin", "--engine-heartbeat-timeout", str(HEARTBEAT_S)),
    }
    try:
        for s in started.values():
            s.wait_ready()
        yield {"single": single, **started}
    finally:
        for s in started.values():
            s.stop()


def complete(server: EngineServer, prompt: list[int], max_tokens: int = 8, **extra) -> dict:
    body = {"prompt": prompt, "max_tokens": max_tokens, "ignore_eos": True, "temperature": 0.0, **extra}
    r = httpx.post(server.url + "/v1/completions", json=body, timeout=120)
    assert r.status_code == 200, r.text
    return r.json()


def replicas(server: EngineServer) -> list[dict]:
    r = httpx.get(server.url + "/health", timeout=10)
    return r.json()["replicas"]


def hit_rate_delta(server: EngineServer, before: dict[str, float]) -> float:
    after = metric_samples(server.url)
    queries = after["kvloom_prefix_cache_queries_total"] - before["kvloom_prefix_cache_queries_total"]
    hits = after["kvloom_prefix_cache_hits_total"] - before["kvloom_prefix_cache_hits_total"]
    return hits / queries


def test_killed_replica_restarts_and_rejoins(restart_server, single):
    server = restart_server
    engines = replica_engines(server)
    errors, finished = one_stream_per_replica_then(server, engines[0], signal.SIGKILL)
    assert len(errors) == 1 and errors[0]["code"] == 503 and "went away" in errors[0]["message"]
    assert finished == ["length"]
    # A new engine process imports torch and loads the model before it answers: out until then.
    assert [r["healthy"] for r in wait_for_health(server, "degraded", 5)["replicas"]] == [False, True]
    for _ in range(3):  # served by the other replica while the launcher restarts this one
        assert complete(server, [9, 10, 11], 4)["choices"][0]["finish_reason"] == "length"
    states = wait_for_health(server, "ok", 180)  # the new engine loads the model, then the frontend rejoins
    assert [r["healthy"] for r in states["replicas"]] == [True, True]
    restarted = replica_engines(server)
    assert restarted[0] != engines[0] and restarted[1] == engines[1]
    burst_lands_on_both(server, single)
    healthy = {s.labels["replica"]: s.value for s in metric_families(server.url, "kvloom_engine_healthy")}
    assert healthy == {"0": 1.0, "1": 1.0}


def test_burst_lands_on_both_replicas_with_outputs_unchanged(servers):
    rng = random.Random(0)
    prompts = [[rng.randrange(3, 300) for _ in range(rng.randrange(4, 40))] for _ in range(16)]
    dp = servers["affinity"]
    health = httpx.get(dp.url + "/health", timeout=10).json()
    assert health["status"] == "ok" and [r["healthy"] for r in health["replicas"]] == [True, True]

    def both(prompt, i):
        greedy = complete(dp, prompt)["choices"][0]["text"]
        seeded = complete(dp, prompt, 12, temperature=1.0, seed=i)["choices"][0]["text"]
        return greedy, seeded

    with ThreadPoolExecutor(8) as pool:
        dp_out = list(pool.map(both, prompts, range(len(prompts))))
    alone = [(complete(servers["single"], p)["choices"][0]["text"],
              complete(servers["single"], p, 12, temperature=1.0, seed=i)["choices"][0]["text"])
             for i, p in enumerate(prompts)]
    assert dp_out == alone
    states = replicas(dp)
    # Both engines ran some of the burst (their own step stats say so), and between them all of it.
    assert all(r["num_routed"] > 0 and r["prefix_cache_queries"] > 0 for r in states), states
    assert sum(r["num_routed"] for r in states) == 2 * len(prompts)


def shared_prefix_workload(seed: int) -> list[list[int]]:
    """3 system prompts of 4 KV blocks (32 tokens each on the CPU), 4 requests each with their own
    question, interleaved: a router that ignores prefixes sends each prompt to both replicas."""
    rng = random.Random(seed)
    prefixes = [[rng.randrange(3, 300) for _ in range(128)] for _ in range(3)]
    return [prefixes[g] + [rng.randrange(3, 300) for _ in range(8)] for _ in range(4) for g in range(3)]


def test_shared_prefix_requests_stay_on_one_replica(servers):
    rates = {}
    for name, server in servers.items():
        before = metric_samples(server.url)
        for prompt in shared_prefix_workload(seed=7):
            complete(server, prompt, 2)
        rates[name] = hit_rate_delta(server, before)
    # One engine misses each prefix once (hits 3 of 4: ~0.7 of prompt tokens); affinity the same;
    # round-robin misses each prefix once per replica (~0.47).
    assert rates["affinity"] >= rates["single"] - 0.02, rates
    assert rates["affinity"] > rates["round_robin"] + 0.15, rates


def replica_engines(server: EngineServer) -> dict[int, int]:
    """{replica index: pid} of the server's engine processes (each is told its socket, engine-I.sock)."""
    engines = {}
    for pid in server.descendants():
        line = cmdline(pid)
        if "kvloom.launch.engine_process" in line:
            engines[0 if "engine-0.sock" in line else 1] = pid
    return engines


def one_stream_per_replica_then(server: EngineServer, engine0: int, sig: signal.Signals,
                                max_tokens: int = 500) -> tuple[list[dict], list[str]]:
    """Open two streams (round-robin: one on each replica), send ``sig`` to replica 0's engine (pid ``engine0``)
    once both have streamed a token, with replica 0's stream mid-way, read both to their end; the errors and
    the finish reasons of those that finished.

    The tiny model streams its 500 tokens in about 2 s here, and under load the client can fall that far
    behind the engine: what it has read says little of what the engine has left. So replica 0's engine is
    held (SIGSTOP) until replica 1's stream has its first token, then let run 20 ms at a time until its own
    has one, and ``sig`` finds it held mid-stream. The slices are timed by a process of their own (this
    one's reader threads could keep a timer here waiting on their lock), and the engine runs at the lowest
    priority meanwhile: a machine too busy to wake the timer on time gives the engine little more."""
    body = {"prompt": [5, 6, 7, 8], "max_tokens": max_tokens, "ignore_eos": True, "stream": True}
    routed_before = [r["num_routed"] for r in replicas(server)]
    firsts: queue.Queue[str] = queue.Queue()
    events: list[list[str]] = [[], []]

    def read(i: int) -> None:
        with httpx.Client(timeout=120) as http, \
                http.stream("POST", server.url + "/v1/completions", json=body) as response:
            for line in response.iter_lines():
                if line.startswith("data:"):
                    if not events[i]:
                        firsts.put(line)
                    events[i].append(line[5:].strip())

    os.kill(engine0, signal.SIGSTOP)
    niceness = os.getpriority(os.PRIO_PROCESS, engine0)
    os.setpriority(os.PRIO_PROCESS, engine0, 19)
    with ThreadPoolExecutor(2) as pool:
        readers = [pool.submit(read, i) for i in range(2)]
        # Inside the pool: a failure here lets replica 0 go on before the pool waits for its stream.
        sent = False
        try:
            first = [firsts.get(timeout=90)]  # replica 1's stream: replica 0 is held
            deadline = time.monotonic() + 90
            while len(first) < 2:
                assert time.monotonic() < deadline, "replica 0's stream streamed nothing"
                subprocess.run([sys.executable, "-c", SLICE, str(engine0), "0.02"], check=True)
                with contextlib.suppress(queue.Empty):
                    first.append(firsts.get(timeout=0.5))
            os.kill(engine0, sig)
            sent = True
        finally:
            if not sent:
                os.kill(engine0, signal.SIGCONT)
            with contextlib.suppress(OSError):  # gone, or raising a priority back needs a privilege
                os.setpriority(os.PRIO_PROCESS, engine0, niceness)
        assert all('"text"' in line for line in first), first  # both were generating when sig was sent
        t0 = time.monotonic()
        for r in readers:
            r.result(timeout=90)
        assert time.monotonic() - t0 < 90
    routed = [r["num_routed"] for r in replicas(server)]
    assert [x - y for x, y in zip(routed, routed_before)] == [1, 1], (routed_before, routed)
    endings = []
    for stream in events:
        assert stream[-1] == "[DONE]", stream[-3:]
        endings.append(json.loads(stream[-2]))
    errors = [e["error"] for e in endings if "error" in e]
    return errors, [e["choices"][0]["finish_reason"] for e in endings if "choices" in e]


def wait_for_health(server: EngineServer, status: str, timeout: float) -> dict:
    deadline = time.monotonic() + timeout
    while True:
        body = httpx.get(server.url + "/health", timeout=10).json()
        if body["status"] == status:
            return body
        assert time.monotonic() < deadline, f"/health is still {body} after {timeout:g}s, not {status!r}"
        time.sleep(0.5)


def burst_lands_on_both(server: EngineServer, single: EngineServer) -> None:
    """8 greedy requests at once: both replicas take some (their engines' own stats show it), with
    the outputs of one engine."""
    rng = random.Random(3)
    prompts = [[rng.randrange(3, 300) for _ in range(rng.randrange(20, 40))] for _ in range(8)]
    before = replicas(server)
    with ThreadPoolExecutor(8) as pool:
        out = list(pool.map(lambda p: complete(server, p)["choices"][0]["text"], prompts))
    assert out == [complete(single, p)["choices"][0]["text"] for p in prompts]
    after = replicas(server)
    assert all(a["num_routed"] > b["num_routed"] for a, b in zip(after, before)), (before, after)
    assert all(a["prefix_cache_queries"] > 0 for a in after), after


def test_stopped_replica_is_taken_out_and_rejoins_on_sigcont(servers):
    server = servers["round_robin"]
    engines = replica_engines(server)
    assert len(engines) == 2
    errors, finished = one_stream_per_replica_then(server, engines[0], signal.SIGSTOP)
    try:
        assert len(errors) == 1 and errors[0]["code"] == 503 and "has not answered" in errors[0]["message"]
        assert finished == ["length"]
        states = wait_for_health(server, "degraded", 5)
        assert [r["healthy"] for r in states["replicas"]] == [False, True]
        assert "engine_heartbeat_timeout" in states["replicas"][0]["reason"]
        for _ in range(3):  # new requests go to the live replica
            assert complete(server, [9, 10, 11], 4)["choices"][0]["finish_reason"] == "length"
    finally:
        os.kill(engines[0], signal.SIGCONT)
    states = wait_for_health(server, "ok", 30)
    assert [r["healthy"] for r in states["replicas"]] == [True, True]
    burst_lands_on_both(server, servers["single"])


def metric_families(url: str, name: str) -> list:
    from prometheus_client.parser import text_string_to_metric_families

    text = httpx.get(url + "/metrics", timeout=10).text
    return [s for fam in text_string_to_metric_families(text) for s in fam.samples if s.name == name]


def test_killed_replica_fails_its_requests_the_other_serves_on(servers):
    server = servers["round_robin"]
    engines = replica_engines(server)
    assert len(engines) == 2
    errors, finished = one_stream_per_replica_then(server, engines[0], signal.SIGKILL)
    assert len(errors) == 1 and errors[0]["code"] == 503 and "engine" in errors[0]["message"]
    assert finished == ["length"]  # the other replica's request ran to its end
    healthy = {s.labels["replica"]: s.value for s in metric_families(server.url, "kvloom_engine_healthy")}
    assert healthy == {"0": 0.0, "1": 1.0}

    health = httpx.get(server.url + "/health", timeout=10)
    assert health.status_code == 200
    states = health.json()
    assert states["status"] == "degraded"
    assert [r["healthy"] for r in states["replicas"]] == [False, True]
    assert "went away" in states["replicas"][0]["reason"]
    for _ in range(4):  # every new request goes to the live replica
        assert complete(server, [9, 10, 11], 4)["choices"][0]["finish_reason"] == "length"

    # SIGTERM drains what is left and stops every process; the lost replica makes the exit non-zero.
    children = server.descendants()
    assert server.stop(timeout=60) == 1
    deadline = time.monotonic() + 10
    while any(alive(pid) for pid in children):
        assert time.monotonic() < deadline, f"orphans left: {[p for p in children if alive(p)]}"
        time.sleep(0.1)
