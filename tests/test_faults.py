"""Faults of the real server's processes (kill -9 of each, SIGSTOP/SIGCONT of the engine, SIGTERM with a
drain that runs out): what clients see, and that nothing is left behind. Each test starts its own server."""

from __future__ import annotations

import json
import os
import signal
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx

from tests.server_utils import EngineServer, alive, free_port, kv_blocks, wait_engine_requests


def start_server(model, tmp_path, extra: str = "", workers: int = 1) -> EngineServer:
    port = free_port()
    config = tmp_path / "serve.toml"
    config.write_text(f'model = "{model}"\nport = {port}\napi_workers = {workers}\nnum_kv_blocks = 256\n{extra}')
    return EngineServer(["--config", str(config)], tmp_path, port=port).wait_ready()


def stream_events(server: EngineServer, http: httpx.Client, body: dict, started=None) -> list[str]:
    out = []
    with http.stream("POST", server.url + "/v1/completions", json={**body, "stream": True}) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if line.startswith("data:"):
                out.append(line[5:].strip())
                if started is not None:
                    started.release()
                    started = None
    return out


def wait_gone(pids: list[int], timeout: float = 15.0) -> None:
    deadline = time.monotonic() + timeout
    while any(alive(pid) for pid in pids):
        assert time.monotonic() < deadline, f"orphans left: {[p for p in pids if alive(p)]}"
        time.sleep(0.1)


LONG = {"prompt": "Once upon a time", "max_tokens": 400, "ignore_eos": True}


def test_sigterm_with_an_expiring_drain_ends_every_request_cleanly(tiny_llama, tmp_path):
    server = start_server(tiny_llama, tmp_path, "drain_timeout = 2.0\n")
    children = server.descendants()
    engine = server.child_running("kvloom.launch.engine_process")
    try:
        with httpx.Client(timeout=60) as http, ThreadPoolExecutor(4) as pool:
            started = threading.Semaphore(0)
            streams = [pool.submit(stream_events, server, http, LONG, started) for _ in range(2)]
            for _ in streams:
                assert started.acquire(timeout=30)
            plain = [pool.submit(http.post, server.url + "/v1/completions", json=LONG) for _ in range(2)]
            wait_engine_requests(server.url, 4)  # every request reached the engine
            os.kill(engine, signal.SIGSTOP)  # nothing in flight can finish before the drain runs out
            t0 = time.monotonic()
            server.proc.send_signal(signal.SIGTERM)
            answers = [f.result(timeout=30) for f in plain]
            events = [f.result(timeout=30) for f in streams]
            elapsed = time.monotonic() - t0
            os.kill(engine, signal.SIGCONT)
        assert elapsed < 10, f"the drain took {elapsed:.1f}s"
        for r in answers:
            assert r.status_code == 503, r.text
            assert "drain_timeout=2s expired" in r.json()["error"]["message"]
        for ev in events:
            assert ev[-1] == "[DONE]"
            error = json.loads(ev[-2])["error"]
            assert error["code"] == 503 and "drain_timeout" in error["message"]
        server.proc.wait(timeout=60)
        assert "aclose()" not in server.log() and "Unhandled error" not in server.log()
    finally:
        server.stop()
    wait_gone(children)


def wait_for(predicate, timeout: float, what: str):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(0.2)
    raise AssertionError(f"not within {timeout}s: {what}")


def test_sigstop_of_the_engine_is_noticed_and_sigcont_recovers(tiny_llama, tmp_path):
    from kvloom.client import Client

    gateway = f"ipc://{tmp_path}/gw.sock"
    server = start_server(tiny_llama, tmp_path, f'engine_heartbeat_timeout = 2.0\ngateway = "{gateway}"\n')
    engine = server.child_running("kvloom.launch.engine_process")
    try:
        with httpx.Client(timeout=60) as http, ThreadPoolExecutor(2) as pool:
            started = threading.Semaphore(0)
            stream = pool.submit(stream_events, server, http, LONG, started)
            assert started.acquire(timeout=30)
            waiting = pool.submit(http.post, server.url + "/v1/completions", json=LONG)
            wait_engine_requests(server.url, 2)
            os.kill(engine, signal.SIGSTOP)
            t0 = time.monotonic()
            events = stream.result(timeout=30)
            answer = waiting.result(timeout=30)
            noticed = time.monotonic() - t0
            # In-flight requests end with an error naming the heartbeat, within the timeout and a beat.
            assert noticed < 8, f"the hung engine went unnoticed for {noticed:.1f}s"
            assert events[-1] == "[DONE]"
            error = json.loads(events[-2])["error"]
            assert error["code"] == 503 and "engine_heartbeat_timeout=2s" in error["message"]
            assert answer.status_code == 503 and "engine_heartbeat_timeout" in answer.text
            health = http.get(server.url + "/health")
            assert health.status_code == 503 and "hung" in health.json()["error"]["message"]
            refused = http.post(server.url + "/v1/completions", json={"prompt": "hi", "max_tokens": 2})
            assert refused.status_code == 503
            with Client(gateway, timeout=10) as gw:  # the gateway's own watchdog, on its own clock
                pong = wait_for(lambda: (lambda p: p if not p.healthy else None)(gw.ping()), 6, "gateway Pong unhealthy")
                assert "engine_heartbeat_timeout" in pong.message

            os.kill(engine, signal.SIGCONT)
            wait_for(lambda: http.get(server.url + "/health").status_code == 200, 15, "/health 200 after SIGCONT")
            ok = http.post(server.url + "/v1/completions", json={"prompt": "hi", "max_tokens": 3, "ignore_eos": True})
            assert ok.status_code == 200 and ok.json()["usage"]["completion_tokens"] == 3
            # The requests ended while it was stopped were aborted in the engine: every block is free.
            wait_for(lambda: (lambda f, t: f == t)(*kv_blocks(server.url)), 15, "every KV block free")
    finally:
        os.kill(engine, signal.SIGCONT)
        server.stop()


def test_max_pending_requests_is_exact_under_300_simultaneous_requests(tiny_llama, tmp_path):
    import asyncio

    server = start_server(tiny_llama, tmp_path, "max_pending_requests = 50\nengine_heartbeat_timeout = 300.0\n")
    engine = server.child_running("kvloom.launch.engine_process")
    body = {"prompt": "hi", "max_tokens": 2, "ignore_eos": True}

    async def burst():
        limits = httpx.Limits(max_connections=400, max_keepalive_connections=400)
        async with httpx.AsyncClient(timeout=120, limits=limits) as http:
            tasks = [asyncio.create_task(http.post(server.url + "/v1/completions", json=body)) for _ in range(300)]
            # The engine is stopped: admitted requests wait, refused ones are answered at once.
            deadline = time.monotonic() + 60
            while sum(t.done() for t in tasks) < 250 and time.monotonic() < deadline:
                await asyncio.sleep(0.1)
            # A window for wrong answers: anything admitted beyond the cap would show up as more 429s... or fewer.
            await asyncio.sleep(1.0)
            early = [t.result().status_code for t in tasks if t.done()]
            os.kill(engine, signal.SIGCONT)
            return early, [r.status_code for r in await asyncio.gather(*tasks)]

    try:
        os.kill(engine, signal.SIGSTOP)
        early, final = asyncio.run(burst())
    finally:
        os.kill(engine, signal.SIGCONT)
        server.stop()
    assert early.count(429) == 250 and len(early) == 250, sorted(set(early))
    assert final.count(200) == 50 and final.count(429) == 250


def test_kill_9_of_the_engine_ends_requests_and_the_server_exits_non_zero_at_once(tiny_llama, tmp_path):
    # Without restart_engine nothing brings the engine back, so the server exits for its supervisor.
    gateway = f"ipc://{tmp_path}/gw.sock"
    server = start_server(tiny_llama, tmp_path, f'gateway = "{gateway}"\ndrain_timeout = 60.0\n', workers=2)
    children = server.descendants()
    engine = server.child_running("kvloom.launch.engine_process")
    try:
        with httpx.Client(timeout=60) as http, ThreadPoolExecutor(1) as pool:
            started = threading.Semaphore(0)
            stream = pool.submit(stream_events, server, http, LONG, started)
            assert started.acquire(timeout=30)
            os.kill(engine, signal.SIGKILL)
            killed = time.monotonic()
            events = stream.result(timeout=15)
            # The request in flight is told first, in OpenAI's error shape, and the stream ends properly.
            assert events[-1] == "[DONE]" and json.loads(events[-2])["error"]["code"] == 503
        code = server.proc.wait(timeout=30)
        exited_in = time.monotonic() - killed
        assert code == 1, server.log()
        # The drain has nothing to wait for (the engine's requests are over), so it is well under drain_timeout
        # (60 s); the margin is for a loaded machine, where the workers' own exit takes seconds.
        assert exited_in < 30, f"the server took {exited_in:.1f}s to exit after the engine died"
        assert "so that its supervisor restarts it" in server.log()
    finally:
        server.stop()
    wait_gone(children)


def _frontend_pid(server: EngineServer, module: str) -> int:
    return server.child_running(module)


def test_kill_9_of_an_api_worker_stops_the_server_with_its_requests_drained(tiny_llama, tmp_path):
    from kvloom.client import Client

    gateway = f"ipc://{tmp_path}/gw.sock"
    server = start_server(tiny_llama, tmp_path, f'gateway = "{gateway}"\ndrain_timeout = 30.0\n')
    children = server.descendants()
    try:
        with Client(gateway, timeout=60) as gw:
            chunks = gw.stream("Once upon a time", max_tokens=100, ignore_eos=True)
            assert next(chunks).finish_reason is None
            os.kill(_frontend_pid(server, "kvloom.frontends.api_server"), signal.SIGKILL)
            rest = list(chunks)  # the gateway drains: the request finishes as asked
        assert rest[-1].finish_reason == "length" and rest[-1].usage.completion_tokens == 100
        assert server.proc.wait(timeout=60) == 1
        assert "A frontend process exited" in server.log()
    finally:
        server.stop()
    wait_gone(children)


def test_kill_9_of_the_gateway_stops_the_server_with_http_requests_drained(tiny_llama, tmp_path):
    gateway = f"ipc://{tmp_path}/gw.sock"
    server = start_server(tiny_llama, tmp_path, f'gateway = "{gateway}"\ndrain_timeout = 30.0\n')
    children = server.descendants()
    try:
        with httpx.Client(timeout=60) as http, ThreadPoolExecutor(1) as pool:
            started = threading.Semaphore(0)
            stream = pool.submit(stream_events, server, http, {**LONG, "max_tokens": 150}, started)
            assert started.acquire(timeout=30)
            os.kill(_frontend_pid(server, "kvloom.frontends.gateway"), signal.SIGKILL)
            events = stream.result(timeout=60)
        assert events[-1] == "[DONE]"
        assert json.loads(events[-2])["choices"][0]["finish_reason"] == "length"
        assert server.proc.wait(timeout=60) == 1
    finally:
        server.stop()
    wait_gone(children)
