"""Failures and shutdown of the real server: the engine process dying under load, and SIGTERM draining
in-flight requests and leaving no process behind. Each test starts its own server from a config file."""

from __future__ import annotations

import json
import os
import signal
import time
from concurrent.futures import ThreadPoolExecutor

import httpx

from kvloom.client import Client
from tests.server_utils import EngineServer, alive, free_port, wait_engine_requests


def start_server(model, tmp_path, extra: str = "") -> EngineServer:
    port = free_port()
    config = tmp_path / "serve.toml"
    # Serving and engine keys side by side, as the flags name them.
    config.write_text(f'model = "{model}"\nport = {port}\napi_workers = 1\nnum_kv_blocks = 256\n'
                      f'drain_timeout = 30.0\n{extra}')
    return EngineServer(["--config", str(config)], tmp_path, port=port).wait_ready()


def long_stream(server: EngineServer, http: httpx.Client, max_tokens: int = 400):
    body = {"model": None, "prompt": "Once upon a time", "max_tokens": max_tokens, "stream": True,
            "ignore_eos": True}
    return http.stream("POST", server.url + "/v1/completions", json=body)


def refused_within(url: str, timeout: float) -> None:
    """Wait until a new connection to ``url`` is refused (the server stopped listening); one reset before it was
    served counts too (it reached the backlog as the listening socket closed)."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            httpx.get(url, timeout=5)
        except (httpx.ConnectError, httpx.ReadError, httpx.RemoteProtocolError):
            return
        assert time.monotonic() < deadline, f"{url} still accepted connections after {timeout:g}s"
        time.sleep(0.05)


def data_lines(lines, count: int | None = None) -> list[str]:
    out = []
    for line in lines:
        if line.startswith("data:"):
            out.append(line[5:].strip())
            if count is not None and len(out) == count:
                break
    return out


def test_engine_death_fails_requests_and_stops_the_server(tiny_llama, tmp_path):
    # Over TCP this time: the frontends must notice the dead engine there too.
    server = start_server(tiny_llama, tmp_path, f'engine_address = "tcp://127.0.0.1:{free_port()}"\n')
    children = server.descendants()
    try:
        engine_pid = server.child_running("kvloom.launch.engine_process")
        with httpx.Client(timeout=60) as http, ThreadPoolExecutor(1) as pool:
            with long_stream(server, http) as r:
                lines = r.iter_lines()
                assert len(data_lines(lines, 2)) == 2
                waiting = pool.submit(http.post, server.url + "/v1/completions",
                                      json={"prompt": "Hello", "max_tokens": 400, "ignore_eos": True})
                wait_engine_requests(server.url, 2)  # the non-streaming request reached the engine
                os.kill(engine_pid, signal.SIGKILL)
                t0 = time.monotonic()
                rest = data_lines(lines)
            assert time.monotonic() - t0 < 10, "the stream hung after the engine died"
            assert rest[-1] == "[DONE]"
            error = json.loads(rest[-2])["error"]
            assert error["code"] == 503 and "engine" in error["message"]

            blocked = waiting.result(timeout=10)
            assert blocked.status_code == 503
            assert "engine" in blocked.json()["error"]["message"]
        # Both were answered before the server went: without restart_engine it exits for its supervisor.
        assert server.proc.wait(timeout=30) == 1, server.log()
    finally:
        server.stop(timeout=60)
    wait_gone(children)


def test_sigterm_drains_in_flight_requests_and_leaves_no_process(tiny_llama, tmp_path):
    gateway = f"ipc://{tmp_path}/gw.sock"
    server = start_server(tiny_llama, tmp_path, f'gateway = "{gateway}"\n')
    children = server.descendants()
    assert len(children) == 3  # the engine process, one HTTP worker, the gateway
    try:
        with httpx.Client(timeout=60) as http, Client(gateway, timeout=60) as gw, ThreadPoolExecutor(1) as pool:
            gw_stream = gw.stream("Once upon a time", max_tokens=200, ignore_eos=True)
            assert next(gw_stream).finish_reason is None
            with long_stream(server, http, max_tokens=200) as r:
                lines = r.iter_lines()
                first = data_lines(lines, 1)
                server.proc.send_signal(signal.SIGTERM)
                gw_rest = pool.submit(list, gw_stream)
                refused_within(server.url + "/health", 30)  # no new connections while draining
                rest = data_lines(lines)
            gw_chunks = gw_rest.result(timeout=60)
        events = [json.loads(e) for e in first + rest[:-1]]
        assert rest[-1] == "[DONE]"
        assert events[-1]["choices"][0]["finish_reason"] == "length"
        assert gw_chunks[-1].finish_reason == "length" and gw_chunks[-1].usage.completion_tokens == 200
        assert server.proc.wait(timeout=60) == 0
    finally:
        server.stop()
    wait_gone(children)


def test_engine_that_cannot_start_stops_the_server_with_its_reason(tiny_llama, tmp_path):
    broken = tmp_path / "broken-model"
    broken.mkdir()
    for f in tiny_llama.iterdir():
        if f.suffix != ".safetensors":
            (broken / f.name).write_bytes(f.read_bytes())
    server = EngineServer(["--model", str(broken)], tmp_path)
    try:
        assert server.proc.wait(timeout=120) == 1
    finally:
        server.stop()
    assert "the engine failed to start: no .safetensors files" in server.log()


def test_killed_launcher_takes_its_children_along(tiny_llama, tmp_path):
    server = start_server(tiny_llama, tmp_path)
    children = server.descendants()
    try:
        server.proc.send_signal(signal.SIGKILL)
        server.proc.wait(timeout=10)
        wait_gone(children)
    finally:
        server.stop()


def wait_gone(pids: list[int], timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while any(alive(pid) for pid in pids):
        assert time.monotonic() < deadline, f"orphans left: {[p for p in pids if alive(p)]}"
        time.sleep(0.1)
