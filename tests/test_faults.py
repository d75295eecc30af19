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

from tests.server_utils import EngineServer, alive, free_port


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
    engine = server.child_running("kvloom.core.engine_process")
    try:
        with httpx.Client(timeout=60) as http, ThreadPoolExecutor(4) as pool:
            started = threading.Semaphore(0)
            streams = [pool.submit(stream_events, server, http, LONG, started) for _ in range(2)]
            for _ in streams:
                assert started.acquire(timeout=30)
            os.kill(engine, signal.SIGSTOP)  # nothing in flight can finish before the drain runs out
            plain = [pool.submit(http.post, server.url + "/v1/completions", json=LONG) for _ in range(2)]
            time.sleep(1.0)
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
