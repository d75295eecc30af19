"""Admission against the real server (2 API workers where it matters): the engine-wide queue cap under a
burst, per-key quotas holding across workers, wrong keys on every route (HTTP and gateway), and the
deadlines the engine enforces (queue_timeout drops unrun requests; a run deadline ends a stream)."""

from __future__ import annotations

import asyncio
import json
import time

import httpx

from tests.server_utils import EngineServer, free_port, kv_blocks, metric_samples

BURST = 64
CAP = 8


def start_server(model, tmp_path, extra: str = "", workers: int = 2, heartbeat: float = 300.0) -> EngineServer:
    port = free_port()
    config = tmp_path / "serve.toml"
    config.write_text(f'model = "{model}"\nport = {port}\napi_workers = {workers}\nnum_kv_blocks = 256\n'
                      f"engine_heartbeat_timeout = {heartbeat}\n{extra}")
    return EngineServer(["--config", str(config)], tmp_path, port=port).wait_ready()


def engine_metric(server: EngineServer, name: str) -> float:
    return metric_samples(server.url).get(name, 0.0)


async def burst(url: str, bodies: list[dict], headers: dict | None = None) -> list[tuple[httpx.Response, float]]:
    """Send every body at once, each on its own connection (so both workers take some); each response
    with the time it came back."""
    async def one(body):
        async with httpx.AsyncClient(timeout=300, headers=headers) as http:
            r = await http.post(url + "/v1/completions", json=body)
            return r, time.monotonic()

    return await asyncio.gather(*(one(b) for b in bodies))


def test_the_engine_wide_queue_cap_holds_for_two_workers_under_a_burst(tiny_llama, tmp_path):
    server = start_server(tiny_llama, tmp_path, f"max_queued_requests = {CAP}\nmax_num_seqs = 2\n")
    body = {"prompt": "Once upon a time", "max_tokens": 200, "ignore_eos": True}
    try:
        results = asyncio.run(burst(server.url, [body] * BURST))
        refused_by_engine = engine_metric(server, "kvloom_engine_rejected_queue_full_total")
        free, total = kv_blocks(server.url)
    finally:
        server.stop()
    statuses = [r.status_code for r, _ in results]
    ok = [(r, t) for r, t in results if r.status_code == 200]
    refused = [(r, t) for r, t in results if r.status_code == 429]
    assert len(ok) + len(refused) == BURST, sorted(set(statuses))
    for r, _ in refused:
        error = r.json()["error"]
        assert error["code"] == 429 and error["type"] == "rate_limit_error" and "max_queued_requests=8" in error["message"]
        assert int(r.headers["retry-after"]) >= 1
    for r, _ in ok:  # every admitted request ran to its end
        assert r.json()["usage"]["completion_tokens"] == 200
    # The engine counted exactly the refusals the clients saw, across both workers.
    assert refused_by_engine == len(refused)
    # Admitted: the queue's 8, plus those that had left the queue for a running slot (2) or finished
    # while refusals were still being given out. Never more: no worker admits behind another's back.
    last_refusal = max(t for _, t in refused)
    finished_meanwhile = sum(1 for _, t in ok if t < last_refusal)
    assert CAP <= len(ok) <= CAP + 2 + finished_meanwhile, (len(ok), finished_meanwhile)
    assert free == total


def test_key_quotas_hold_across_two_workers_and_wrong_keys_get_401(tiny_llama, tmp_path):
    gateway = f"ipc://{tmp_path}/gw.sock"
    server = start_server(tiny_llama, tmp_path, f'''gateway = "{gateway}"
gateway_require_api_key = true
[[api_keys]]
key = "sk-requests"
name = "by-requests"
requests_per_minute = 4
[[api_keys]]
key = "sk-tokens"
name = "by-tokens"
tokens_per_minute = 100
priority = 3
''')
    body = {"prompt": [5, 6, 7, 8], "max_tokens": 16, "ignore_eos": True}  # charged 4 + 16 = 20 tokens
    try:
        by_requests = asyncio.run(burst(server.url, [body] * 10, {"Authorization": "Bearer sk-requests"}))
        by_tokens = asyncio.run(burst(server.url, [body] * 10, {"Authorization": "Bearer sk-tokens"}))
        samples = metric_samples(server.url)
        admitted = labelled_samples(server.url, "kvloom_api_key_requests_total")
        rejections = labelled_samples(server.url, "kvloom_rejections_total")
        unauthorized = check_wrong_keys(server, gateway)
    finally:
        server.stop()
    # A fresh bucket holds one minute: 4 requests, and 100 / 20 = 5 token charges; the minute refills
    # one request every 15 s and 20 tokens every 12 s, so at most one more can come in during the test.
    n_ok = [r.status_code for r, _ in by_requests].count(200)
    assert 4 <= n_ok <= 5 and [r.status_code for r, _ in by_requests].count(429) == 10 - n_ok
    refused = next(r for r, _ in by_requests if r.status_code == 429)
    assert refused.headers["x-ratelimit-limit-requests"] == "4"
    assert int(refused.headers["x-ratelimit-remaining-requests"]) == 0
    assert refused.headers["x-ratelimit-reset-requests"].endswith("s") and int(refused.headers["retry-after"]) >= 1
    assert "requests_per_minute=4" in refused.json()["error"]["message"]
    n_ok = [r.status_code for r, _ in by_tokens].count(200)
    assert 5 <= n_ok <= 6 and [r.status_code for r, _ in by_tokens].count(429) == 10 - n_ok
    refused = next(r for r, _ in by_tokens if r.status_code == 429)
    assert refused.headers["x-ratelimit-limit-tokens"] == "100" and "x-ratelimit-limit-requests" not in refused.headers
    assert samples['kvloom_engine_rate_limited_total'] >= 5
    # /metrics of either worker counts both workers' requests per key, admitted and refused.
    for name, statuses in (("by-requests", [r.status_code for r, _ in by_requests]),
                           ("by-tokens", [r.status_code for r, _ in by_tokens])):
        assert admitted[(("api_key", name),)] == statuses.count(200), admitted
        assert rejections[(("api_key", name), ("reason", "rate_limited"))] == statuses.count(429), rejections
    assert unauthorized == {"ok"}


def labelled_samples(url: str, name: str) -> dict[tuple, float]:
    """``name``'s samples by their labels (the model label left out), summed over the served model."""
    from prometheus_client.parser import text_string_to_metric_families

    out: dict[tuple, float] = {}
    for fam in text_string_to_metric_families(httpx.get(url + "/metrics", timeout=10).text):
        for sample in fam.samples:
            if sample.name == name:
                key = tuple(sorted((k, v) for k, v in sample.labels.items() if k != "model"))
                out[key] = out.get(key, 0.0) + sample.value
    return out


def check_wrong_keys(server: EngineServer, gateway: str) -> set[str]:
    """Every non-health route answers 401 to a wrong or missing key (HTTP and gateway); health does not."""
    import zmq

    from kvloom.core.messages import Generate, Ping, decode_gateway_reply, encode
    from kvloom.core.sampling_params import SamplingParams

    routes = [("POST", "/v1/completions", {"prompt": "hi", "max_tokens": 1}),
              ("POST", "/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 1}),
              ("GET", "/v1/models", None), ("GET", "/v1/models/anything", None),
              ("POST", "/tokenize", {"prompt": "hi"}), ("POST", "/detokenize", {"tokens": [5]}),
              ("POST", "/reset_prefix_cache", None)]
    with httpx.Client(base_url=server.url, timeout=30) as http:
        for headers in ({}, {"Authorization": "Bearer sk-wrong"}, {"Authorization": "sk-requests"}):
            for method, path, body in routes:
                r = http.request(method, path, json=body, headers=headers)
                assert r.status_code == 401 and r.json()["error"]["type"] == "authentication_error", (path, r.text)
        for path in ("/health", "/version", "/metrics"):
            assert http.get(path).status_code == 200
        assert http.get("/v1/models", headers={"Authorization": "Bearer sk-tokens"}).status_code == 200
    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.RCVTIMEO, 30_000)
    sock.connect(gateway)
    try:
        for i, key in enumerate((None, "sk-wrong")):
            sock.send(encode(Generate(request_id=f"r{i}", prompt="hi", api_key=key)))
            reply = decode_gateway_reply(sock.recv())
            assert reply.status == 401 and reply.request_id == f"r{i}", reply
        sock.send(encode(Ping()))
        assert decode_gateway_reply(sock.recv()).healthy  # the gateway's health check needs no key
        # Charged 2 + 90 tokens: the minute refills that many only after 55 s, however slow the checks above.
        sock.send(encode(Generate(request_id="good", prompt_token_ids=[5, 6], api_key="sk-tokens",
                                  sampling=SamplingParams(max_tokens=90, ignore_eos=True))))
        while True:
            reply = decode_gateway_reply(sock.recv())
            if getattr(reply, "finish_reason", None) or hasattr(reply, "status"):
                break
        # The tokens key's minute is spent by the HTTP burst: the gateway is held to the same bucket.
        assert getattr(reply, "status", None) == 429 and reply.retry_after > 0, reply
    finally:
        sock.close(linger=0)
        ctx.term()
    return {"ok"}


def test_queue_timeout_drops_a_waiting_request_unrun_and_frees_its_blocks(tiny_llama, tmp_path):
    # The tiny model decodes 480 tokens in well under a second here, so the deadline is a fifth of a
    # second: the long request still holds the one seat when the short one's wait runs out.
    server = start_server(tiny_llama, tmp_path, "queue_timeout = 0.2\nmax_num_seqs = 1\n", workers=1)
    long = {"prompt": "Once upon a time", "max_tokens": 480, "ignore_eos": True, "stream": True}
    try:
        with httpx.Client(base_url=server.url, timeout=120) as http:
            with http.stream("POST", "/v1/completions", json=long) as stream:
                lines = stream.iter_lines()
                assert next(line for line in lines if line.startswith("data:"))  # it runs: the one seat is taken
                started = time.monotonic()
                r = http.post("/v1/completions", json={"prompt": "hi", "max_tokens": 4})
                waited = time.monotonic() - started
                assert r.status_code == 408, (r.status_code, r.text, waited)
                error = r.json()["error"]
                assert "queue_timeout=0.2s" in error["message"] and "before it ran" in error["message"]
                assert 0.2 <= waited < 10.0
                assert engine_metric(server, "kvloom_engine_expired_in_queue_total") == 1
                assert engine_metric(server, "kvloom_engine_expired_running_total") == 0
            # The stream is closed; the long request is aborted and every block comes back.
            deadline = time.monotonic() + 20
            while kv_blocks(server.url)[0] != kv_blocks(server.url)[1]:
                assert time.monotonic() < deadline, kv_blocks(server.url)
                time.sleep(0.1)
            rejections = metric_samples(server.url)
    finally:
        server.stop()
    assert rejections["kvloom_queue_wait_seconds_count"] >= 1  # the long one's wait; the dropped one had none


def test_a_run_deadline_ends_a_running_stream_with_an_error_event_and_frees_its_blocks(tiny_llama, tmp_path):
    server = start_server(tiny_llama, tmp_path, "request_timeout = 60.0\n", workers=1)
    body = {"prompt": "Once upon a time", "max_tokens": 480, "ignore_eos": True, "stream": True, "timeout": 0.3}
    try:
        with httpx.Client(base_url=server.url, timeout=120) as http:
            events = []
            with http.stream("POST", "/v1/completions", json=body) as r:
                assert r.status_code == 200
                events = [line[5:].strip() for line in r.iter_lines() if line.startswith("data:")]
            assert events[-1] == "[DONE]"
            error = json.loads(events[-2])["error"]
            assert error["code"] == 408 and "timeout=0.3s" in error["message"]
            tokens = sum(len(json.loads(e)["choices"][0]["text"]) > 0 for e in events[:-2])
            assert tokens > 0  # it was running when the deadline came
            assert engine_metric(server, "kvloom_engine_expired_running_total") == 1
            free, total = kv_blocks(server.url)
            assert free == total
            too_long = http.post("/v1/completions", json={"prompt": "hi", "timeout": 61})
            assert too_long.status_code == 400 and "request_timeout=60s" in too_long.json()["error"]["message"]
    finally:
        server.stop()


def test_restart_engine_brings_a_killed_or_hung_engine_back_and_the_frontends_serve_again(tiny_llama, tmp_path):
    import os
    import signal

    started = time.monotonic()
    server = start_server(tiny_llama, tmp_path, "restart_engine = true\n", workers=2, heartbeat=5.0)
    start_up = time.monotonic() - started
    body = {"prompt": "hi", "max_tokens": 4, "ignore_eos": True, "temperature": 0}
    try:
        with httpx.Client(base_url=server.url, timeout=60) as http:
            before = http.post("/v1/completions", json=body)
            assert before.status_code == 200
            # kill -9 (dead), then SIGSTOP (hung: silent past the heartbeat timeout, killed and restarted).
            for fault, noticed_within in ((signal.SIGKILL, 10), (signal.SIGSTOP, 5.0 + 10)):
                engine = server.child_running("kvloom.launch.engine_process")
                os.kill(engine, fault)
                hit = time.monotonic()
                while http.get("/health").status_code == 200:
                    assert time.monotonic() - hit < noticed_within, f"{fault!r} of the engine was never noticed"
                    time.sleep(0.05)
                while http.get("/health").status_code != 200:
                    assert time.monotonic() - hit < start_up + 60, f"not back within the start-up time:\n{server.log()}"
                    assert server.proc.poll() is None, server.log()
                    time.sleep(0.2)
                assert server.child_running("kvloom.launch.engine_process") != engine
                # Both workers serve again (separate connections land on either).
                for _ in range(6):
                    with httpx.Client(base_url=server.url, timeout=60) as fresh:
                        r = fresh.post("/v1/completions", json=body)
                        assert r.status_code == 200
                        assert r.json()["choices"][0]["text"] == before.json()["choices"][0]["text"]
    finally:
        server.stop()
    assert server.log().count("restarting it") == 2 and "Stopping the hung engine" in server.log()
