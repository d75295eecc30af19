"""One client must never take the service down: each test here replays a defect found by a reliability probe against the
real server (or the engine process's loop over a real socket) and checks the answer a user would see,
then that the server still serves."""

from __future__ import annotations

import asyncio
import logging
import threading

import httpx
import msgspec
import pytest
import zmq

from kvloom.builder import build_engine
from kvloom.core import messages as m
from kvloom.core.config import EngineConfig
from kvloom.core.engine.process import EngineServer as EngineLoop
from kvloom.core.sampling_params import SamplingParams
from tests.server_utils import EngineServer, raw_socket

NUM_BLOCKS = 256
GREEDY = {"temperature": 0.0, "max_tokens": 4, "ignore_eos": True}


@pytest.fixture(scope="module")
def server(tiny_llama, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("hardening")
    gateway = f"ipc://{tmp}/gw.sock"
    srv = EngineServer(["--model", str(tiny_llama), "--num-kv-blocks", str(NUM_BLOCKS), "--gateway", gateway,
                        "--max-request-body-mb", "1"], tmp)
    srv.gateway = gateway
    with srv:
        yield srv


@pytest.fixture
def engine(tiny_llama, tmp_path):
    """The engine process's loop in a thread, on an ipc:// socket the test can write raw messages to."""
    address = f"ipc://{tmp_path}/e.sock"
    loop = EngineLoop(EngineConfig(model=str(tiny_llama), num_kv_blocks=64), address, model_name="tiny",
                     build=build_engine)
    loop.load()
    thread = threading.Thread(target=loop.run, daemon=True)
    thread.start()
    loop.address = address
    yield loop
    loop.request_shutdown(drain=False)
    loop.request_shutdown(drain=False)
    thread.join(10)
    assert not thread.is_alive(), "the engine loop did not stop"
    if not loop.socket.closed:
        loop.close("test over")


def finished_delta(sock: zmq.Socket, request_id: str) -> m.TokenDelta:
    while True:
        msg = m.decode_engine_message(sock.recv())
        for d in getattr(msg, "outputs", []):
            if d.request_id == request_id and d.finish_reason is not None:
                return d


def generates(engine_sock: zmq.Socket, request_id: str = "ok") -> list[int]:
    engine_sock.send(m.encode(m.AddRequest(request_id=request_id, prompt_token_ids=[5, 6, 7],
                                           sampling=SamplingParams(max_tokens=3, temperature=0.0,
                                                                   ignore_eos=True))))
    tokens = []
    while True:
        msg = m.decode_engine_message(engine_sock.recv())
        for d in msg.outputs:
            if d.request_id == request_id:
                tokens += d.new_token_ids
                if d.finish_reason is not None:
                    assert d.finish_reason == "length"
                    return tokens


def post(server, path: str, body, **kw) -> httpx.Response:
    return httpx.post(server.url + path, json=body, timeout=30, **kw)


def completes(server) -> None:
    r = post(server, "/v1/completions", {"prompt": "hi", **GREEDY})
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["completion_tokens"] == 4
    assert httpx.get(server.url + "/health", timeout=10).status_code == 200


# --- defect 1: every integer field is bounded, in the frontend and again in the engine -------------
@pytest.mark.parametrize("field,value,bound", [
    ("top_k", 9223372036854775808, "2147483647"),
    ("top_k", 10**30, "2147483647"),
    ("min_tokens", 2**64, "2147483647"),
    ("max_tokens", 2**63, "2147483647"),
    ("priority", 2**63, "2147483647"),
    ("priority", -(2**70), "-2147483648"),
    ("seed", 2**64, "9223372036854775807"),
    ("n", 2**64, "128"),
    ("logprobs", 2**64, "20"),
    ("stop_token_ids", [2**64], "2147483647"),
])
def test_out_of_range_integers_get_400_naming_field_and_bound(server, field, value, bound):
    body = {"prompt": "hi", "max_tokens": 4, field: value}
    r = post(server, "/v1/completions", body)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == field and bound in error["message"], error
    completes(server)


def test_the_issue_body_is_refused_and_the_engine_lives(server):
    r = post(server, "/v1/completions", {"prompt": "hi", "max_tokens": 4, "top_k": 9223372036854775808})
    assert r.status_code == 400
    assert r.json()["error"]["param"] == "top_k" and "2147483647" in r.json()["error"]["message"]
    completes(server)


@pytest.mark.parametrize("sampling,priority,needle", [
    ({"top_k": 2**63}, 0, "top_k="),
    ({"min_tokens": 2**40, "max_tokens": 2**41}, 0, "2147483647"),
    ({"stop_token_ids": [2**40]}, 0, "stop_token_ids"),
    ({"stop_token_ids": [100_000]}, 0, "stop token id 100000"),
    ({}, 2**62, "priority="),
])
def test_engine_rejects_out_of_range_add_request_on_arrival(engine, sampling, priority, needle):
    # Bypass every frontend: the raw message a buggy or hostile client could send.
    sock = raw_socket(engine)
    sock.send(msgspec.msgpack.encode({"type": "AddRequest", "request_id": "bad", "prompt_token_ids": [5, 6],
                                      "sampling": sampling, "priority": priority}))
    rejected = finished_delta(sock, "bad")
    assert (rejected.finish_reason, rejected.error_kind) == ("error", "rejected")
    assert needle in rejected.error
    assert len(generates(sock)) == 3  # the step loop is alive and serves the next request


# --- defect 2: a message of unexpected frames is refused; the gateway and the HTTP server stay up ---
def gateway_socket(server, kind: int = zmq.DEALER) -> zmq.Socket:
    sock = zmq.Context.instance().socket(kind)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.RCVTIMEO, 10_000)
    sock.connect(server.gateway)
    return sock


def test_gateway_refuses_unexpected_frame_counts_and_stays_up(server):
    req = gateway_socket(server, zmq.REQ)  # REQ adds an empty delimiter frame: [identity, b"", message]
    req.send(m.encode(m.Ping()))
    refused = m.decode_gateway_reply(req.recv())
    assert isinstance(refused, m.RequestFailed) and refused.status == 400 and "one frame" in refused.message
    req.close()

    dealer = gateway_socket(server)
    dealer.send_multipart([m.encode(m.Ping()), b"extra"])
    refused = m.decode_gateway_reply(dealer.recv())
    assert isinstance(refused, m.RequestFailed) and "got 2" in refused.message
    dealer.send(m.encode(m.Ping()))
    pong = m.decode_gateway_reply(dealer.recv())
    assert isinstance(pong, m.Pong) and pong.healthy
    dealer.close()
    completes(server)
    assert server.proc.poll() is None


# --- defect 3: booleans are not token ids; a request the engine drops still ends --------------------
@pytest.mark.parametrize("prompt", [[[True]], [True], [[1, False]], [[1], [True]]])
def test_boolean_token_ids_are_400_not_a_hang(server, prompt):
    r = post(server, "/v1/completions", {"prompt": prompt, "max_tokens": 1})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == "prompt"
    completes(server)


def test_gateway_refuses_boolean_token_ids(server):
    sock = gateway_socket(server)
    sock.send(msgspec.msgpack.encode({"type": "Generate", "request_id": "b", "prompt_token_ids": [True]}))
    refused = m.decode_gateway_reply(sock.recv())
    assert isinstance(refused, m.RequestFailed) and refused.status == 400
    sock.close()


@pytest.mark.parametrize("msg, field", [
    ({"type": "Generate", "request_id": "u1", "prompt_token_ids": [1, 2], "sampling": {"prompt_logprob": 3}},
     "prompt_logprob"),
    ({"type": "Generate", "request_id": "u2", "prompt_token_ids": [1, 2], "temperature": 0}, "temperature"),
    ({"type": "Generate", "request_id": "u3", "messages": [{"role": "user", "content": "hi", "name": "x"}]},
     "name"),
    ({"type": "Generate", "request_id": "u4", "prompt": "hi",
      "sampling": {"structured": {"kind": "regex", "spec": "a+", "flags": "i"}}}, "flags"),
])
def test_gateway_unknown_fields_are_400_naming_them_under_the_request_id(server, msg, field):
    """A misspelt or unsupported key is an error the client gets under its own request id, not a field
    silently dropped (which returned a plain completion without what was asked for)."""
    sock = gateway_socket(server)
    sock.send(msgspec.msgpack.encode(msg))
    refused = m.decode_gateway_reply(sock.recv())
    assert isinstance(refused, m.RequestFailed) and refused.status == 400, refused
    assert refused.request_id == msg["request_id"] and f"`{field}`" in refused.message, refused.message
    sock.close()
    completes(server)


def test_a_request_the_engine_cannot_decode_ends_with_an_error(engine):
    sock = raw_socket(engine)
    # Booleans where token ids belong: the engine's typed decoder refuses the whole message.
    sock.send(msgspec.msgpack.encode({"type": "AddRequest", "request_id": "bool", "prompt_token_ids": [True],
                                      "sampling": {}}))
    rejected = finished_delta(sock, "bool")
    assert (rejected.finish_reason, rejected.error_kind) == ("error", "rejected")
    assert "invalid request" in rejected.error
    assert len(generates(sock)) == 3


def test_an_unregistered_peer_is_never_answered_and_its_junk_is_logged_a_few_times(engine, caplog):
    caplog.set_level("WARNING", logger="kvloom.engine")
    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.RCVTIMEO, 10_000)
    sock.connect(engine.address)
    bad_add = msgspec.msgpack.encode({"type": "AddRequest", "request_id": "junk", "prompt_token_ids": [True],
                                      "sampling": {}})
    for _ in range(300):
        sock.send(b"\xc1 not msgpack")
        sock.send(bad_add)  # answered with an error only to a registered frontend
        sock.send_multipart([b"two", b"frames"])
        sock.send(m.encode(m.Utility(call_id=1, method="stats")))
    # Messages are handled in order: the answer to this registration comes after all of the above.
    sock.send(m.encode(m.RegisterFrontend(frontend_id="late")))
    assert isinstance(m.decode_engine_message(sock.recv()), m.EngineReady)
    warnings = [r for r in caplog.records if r.name == "kvloom.engine" and r.levelno == logging.WARNING]
    assert 1 <= len(warnings) <= 10, len(warnings)
    sock.close()


def test_frontend_slot_is_freed_when_the_engine_rejects(engine):
    from kvloom.frontends.engine_client import AsyncEngineClient

    async def main():
        client = AsyncEngineClient(engine.address)
        await client.start(timeout=10)
        # Sent as the frontend would if its own checks were missing: ends, with an error, quickly.
        bad = SamplingParams()
        bad.top_k = 2**62  # attribute assignment skips validation
        deltas = await asyncio.wait_for(_collect(client.generate("x", [5, 6], bad)), 10)
        in_flight = client.num_in_flight
        await client.close()
        return deltas, in_flight

    deltas, in_flight = asyncio.run(main())
    assert deltas[-1].finish_reason == "error" and deltas[-1].error_kind == "rejected"
    assert in_flight == 0


async def _collect(gen):
    return [d async for d in gen]


# --- defect 4: a 4xx where the client is at fault, never a 500 ---------------------------------------
def http_500s(server) -> float:
    text = httpx.get(server.url + "/metrics", timeout=10).text
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith("kvloom_http_requests_total{") and 'status="500"' in line)


@pytest.mark.parametrize("path,body", [
    ("/v1/completions", b'{"prompt":' + b"[" * 1000 + b"]" * 1000 + b"}"),
    ("/v1/chat/completions", b'{"messages":[{"role":"user","content":"hi"}],"response_format":'
     + b'{"a":' * 1000 + b"1" + b"}" * 1000 + b"}"),
    ("/v1/completions", b'{"prompt":"hi","x":' + b"[" * 100_000 + b"]" * 100_000 + b"}"),
    # Found by benchmarks/fuzz_server.py: brackets that never close recursed as deep as they were open.
    ("/v1/chat/completions", b'{"prompt":' + b"[" * 3000 + b"]" * 10 + b"}"),
    ("/v1/completions", b"[" * 5000),
])
def test_deeply_nested_json_is_400(server, path, body):
    before = http_500s(server)
    r = httpx.post(server.url + path, content=body, headers={"content-type": "application/json"}, timeout=30)
    assert r.status_code == 400, r.text
    assert "64 levels" in r.json()["error"]["message"] or "do not balance" in r.json()["error"]["message"]
    assert http_500s(server) == before
    completes(server)


@pytest.mark.parametrize("path,extra", [
    ("/v1/completions", {"prompt": [[2**64 + 5]]}),
    ("/v1/completions", {"prompt": [2**70]}),
    ("/v1/completions", {"prompt": "hi", "priority": 10**40}),
    ("/v1/completions", {"prompt": "hi", "best_of": 10**40}),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "max_completion_tokens": 10**40}),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "top_logprobs": -(10**40),
                              "logprobs": True}),
])
def test_integers_beyond_64_bits_are_400(server, path, extra):
    r = post(server, path, {"max_tokens": 2, **extra})
    assert r.status_code == 400, r.text
    completes(server)


def test_chat_min_tokens_above_the_implied_max_tokens_is_400(server):
    r = post(server, "/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "min_tokens": 100_000})
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == "min_tokens" and "100000" in error["message"]


def test_client_gone_mid_body_is_not_a_server_error(server):
    import socket

    before = http_500s(server)
    for _ in range(3):
        with socket.create_connection(("127.0.0.1", server.port)) as s:
            s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                      b"Content-Length: 1000\r\n\r\n{\"prompt\": \"hel")
    completes(server)
    assert http_500s(server) == before
    assert "Unhandled error" not in server.log()


# --- defect 5: a body limit, prompts that cannot fit refused unread, tokenizing off the event loop -----
def test_body_over_the_limit_is_413(server):
    big = {"prompt": "a" * (2**20 + 10), "max_tokens": 1}
    r = post(server, "/v1/completions", big)
    assert r.status_code == 413 and "max_request_body_mb=1" in r.json()["error"]["message"]

    def chunks():  # no content-length: counted as it arrives
        yield b'{"prompt": "'
        for _ in range(20):
            yield b"a" * 100_000
        yield b'"}'

    r = httpx.post(server.url + "/v1/completions", content=chunks(), timeout=30,
                   headers={"content-type": "application/json"})
    assert r.status_code == 413
    completes(server)


@pytest.mark.parametrize("path,body", [
    ("/v1/completions", {"prompt": "a" * 900_000, "max_tokens": 1}),
    ("/v1/completions", {"prompt": ["hi", "é" * 400_000], "max_tokens": 1}),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "b" * 900_000}], "max_tokens": 1}),
])
def test_prompt_that_cannot_fit_is_refused_before_tokenizing(server, path, body):
    r = post(server, path, body)
    assert r.status_code == 400, r.text
    message = r.json()["error"]["message"]
    assert "needs at least" in message and "maximum context length is 512" in message


def test_gateway_message_over_the_limit_is_413_and_long_prompt_400(server):
    sock = gateway_socket(server)
    sock.send(m.encode(m.Generate(request_id="big", prompt="x" * (3 * 2**20))))
    refused = m.decode_gateway_reply(sock.recv())
    assert isinstance(refused, m.RequestFailed) and refused.status == 413
    sock.send(m.encode(m.Generate(request_id="long", prompt="x" * 900_000)))
    refused = m.decode_gateway_reply(sock.recv())
    assert isinstance(refused, m.RequestFailed) and refused.status == 400 and "needs at least" in refused.message
    sock.send(m.encode(m.Ping()))
    assert m.decode_gateway_reply(sock.recv()).healthy
    sock.close()


def _random_texts(tokenizer, seed: int, count: int) -> list[str]:
    import random

    rng = random.Random(seed)
    vocab = list(tokenizer.get_vocab())
    longest = sorted(vocab, key=len)[-5:]
    texts = []
    for i in range(count):
        if i % 3 == 0:  # any code points, control bytes included
            raw = "".join(chr(rng.randrange(0, 0x110000)) for _ in range(rng.randrange(1, 60)))
            texts.append(raw.encode("utf-8", "ignore").decode())
        else:  # runs of real tokens, the longest ones too: where the bound is tight
            pool = longest if i % 3 == 1 else vocab
            texts.append("".join(tokenizer.convert_tokens_to_string([rng.choice(pool)])
                                 for _ in range(rng.randrange(1, 40))))
    return texts


@pytest.mark.parametrize("which", ["tiny", "smollm2"])
def test_prompt_length_bound_never_exceeds_the_real_token_count(which, tiny_llama):
    from kvloom.frontends.limits import PromptLengthBound
    from kvloom.frontends.text import load_tokenizer

    tokenizer = load_tokenizer(str(tiny_llama) if which == "tiny" else "SmolLM2-135M-Instruct")
    bound = PromptLengthBound(tokenizer)
    assert bound.max_token_bytes is not None  # the rule applies to these tokenizers (else it proves nothing)
    tight = 0
    for text in _random_texts(tokenizer, seed=7, count=1500):
        real = len(tokenizer.encode(text, add_special_tokens=False))
        assert bound.min_tokens(text) <= real, text
        tight += bound.min_tokens(text) == real
    assert tight > 0  # and it is not vacuous: some texts hit it exactly


def test_tokenizing_runs_off_the_event_loop():
    import time

    from kvloom.core.messages import EngineReady
    from kvloom.frontends.frontend_core import FrontendCore

    class SlowTokenizer:
        def encode(self, text, add_special_tokens=True):
            time.sleep(1.0)  # a 10 MB prompt, as far as the event loop is concerned
            return [1] * len(text)

    class Client:
        healthy, dead_reason, num_in_flight = True, None, 0

    ready = EngineReady(model_name="m", max_model_len=100, vocab_size=10, num_kv_blocks=1, block_size=16,
                        eos_token_ids=[])
    core = FrontendCore(Client(), SlowTokenizer(), ready, max_pending_requests=1)

    async def main():
        ticks = 0

        async def ticker():
            nonlocal ticks
            while True:
                await asyncio.sleep(0.05)
                ticks += 1

        task = asyncio.create_task(ticker())
        ids = await core.tokenize_text("abc")
        task.cancel()
        return ids, ticks

    ids, ticks = asyncio.run(main())
    assert ids == [1, 1, 1]
    assert ticks >= 5  # the loop kept serving while the tokenizer ran


# --- defect 8: over TCP only the launch's own frontends may drive the engine; exposed binds warn -----
def test_engine_over_tcp_ignores_unauthenticated_peers(tiny_llama, tmp_path):
    from tests.server_utils import free_port

    engine_address = f"tcp://127.0.0.1:{free_port()}"
    srv = EngineServer(["--model", str(tiny_llama), "--num-kv-blocks", "64", "--engine-address", engine_address],
                       tmp_path).wait_ready()
    try:
        intruder = zmq.Context.instance().socket(zmq.DEALER)
        intruder.setsockopt(zmq.LINGER, 0)
        intruder.setsockopt(zmq.RCVTIMEO, 3000)
        intruder.connect(engine_address)
        # No registration at all: Shutdown, Utility and AddRequest are all ignored.
        intruder.send(m.encode(m.Shutdown(drain=False)))
        intruder.send(m.encode(m.Utility(call_id=1, method="stats")))
        intruder.send(m.encode(m.AddRequest(request_id="x", prompt_token_ids=[5], sampling=SamplingParams())))
        with pytest.raises(zmq.Again):
            intruder.recv()
        # A wrong secret is refused by name, and still nothing it sends is obeyed.
        intruder.send(m.encode(m.RegisterFrontend(frontend_id="intruder", secret="guess")))
        refused = m.decode_engine_message(intruder.recv())
        assert isinstance(refused, m.EngineError) and "authentication failed" in refused.message
        intruder.send(m.encode(m.Shutdown(drain=False)))
        # One peer's messages are handled in order: the answer to a second wrong registration comes after
        # the engine has dealt with (and ignored) that Shutdown.
        intruder.send(m.encode(m.RegisterFrontend(frontend_id="intruder", secret="guess again")))
        assert isinstance(m.decode_engine_message(intruder.recv()), m.EngineError)
        intruder.close()
        completes(srv)
        assert srv.proc.poll() is None
        assert "Ignored Shutdown" in srv.log() and "wrong or missing secret" in srv.log()
    finally:
        srv.stop()


def test_binds_beyond_loopback_are_warned_about():
    from kvloom.frontends.config import ServerConfig
    from kvloom.launch.launcher import exposed_binds

    assert exposed_binds(ServerConfig(engine_address="tcp://127.0.0.1:5555", gateway="ipc:///tmp/g.sock")) == []
    warnings = exposed_binds(ServerConfig(host="0.0.0.0", engine_address="tcp://0.0.0.0:5555",
                                          gateway="tcp://*:5557"))
    assert len(warnings) == 3
    assert "0.0.0.0" in warnings[0] and "engine_address=tcp://0.0.0.0:5555" in warnings[1]
    assert "gateway=tcp://*:5557" in warnings[2]


# --- defect 9: half-sent requests are not held open; uvicorn's limits are flags ----------------------
def test_half_sent_requests_are_closed_after_the_header_and_body_timeouts(tiny_llama, tmp_path):
    import socket
    import time

    srv = EngineServer(["--model", str(tiny_llama), "--num-kv-blocks", "64", "--http-header-timeout", "1",
                        "--http-body-timeout", "1", "--http-limit-concurrency", "500"], tmp_path).wait_ready()
    socks = []
    try:
        for i in range(150):  # slowloris: a request head that never ends
            s = socket.create_connection(("127.0.0.1", srv.port))
            s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n" if i % 3 else b"")
            socks.append(s)
        body_pending = socket.create_connection(("127.0.0.1", srv.port))
        body_pending.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                             b"Content-Length: 100\r\n\r\n{\"prompt\"")
        t0 = time.monotonic()
        for s in socks:
            s.settimeout(15)
            assert s.recv(1024) == b""  # closed by the server
        assert time.monotonic() - t0 < 15
        body_pending.settimeout(15)
        answer = b""
        while b"http_body_timeout" not in answer and (chunk := body_pending.recv(4096)):  # head, body may come apart
            answer += chunk
        assert answer.startswith(b"HTTP/1.1 408") and b"http_body_timeout=1s" in answer
        body_pending.close()
        completes(srv)
    finally:
        for s in socks:
            s.close()
        srv.stop()


# --- defect 10: config errors name the key, and every check runs before anything starts --------------
@pytest.mark.parametrize("toml,needle", [
    ('port = "abc"\n', "port='abc' must be an integer"),
    ("api_workers = 1.5\n", "api_workers=1.5 must be an integer"),
    ('max_num_seqs = "many"\n', "max_num_seqs='many' must be an integer"),
    ("drain_timeout = true\n", "drain_timeout=True must be a number"),
    ('gateway = "tcp://127.0.0.1:notaport"\n', "gateway='tcp://127.0.0.1:notaport' must be ipc://PATH or tcp://"),
])
def test_config_file_type_errors_name_the_key(tmp_path, capsys, toml, needle):
    from kvloom.cli.main import main

    config = tmp_path / "serve.toml"
    config.write_text(toml)
    assert main(["--config", str(config)]) == 2
    assert needle in capsys.readouterr().err


@pytest.mark.parametrize("flags,needle", [
    (["--gateway", "tcp://127.0.0.1:notaport"], "gateway='tcp://127.0.0.1:notaport'"),
    (["--gateway", "tcp://127.0.0.1:70000"], "the port must be in [1, 65535]"),
    (["--gateway", "ipc:///no/such/folder/gw.sock"], "the folder /no/such/folder does not exist"),
    (["--engine-address", "udp://127.0.0.1:5"], "engine_address='udp://127.0.0.1:5' must be"),
])
def test_invalid_addresses_fail_before_any_process_starts(tiny_llama, capsys, flags, needle):
    from kvloom.cli.main import main

    # With a real model: main() would start the engine if the address got past validation.
    assert main(["--model", str(tiny_llama), *flags]) == 2
    assert needle in capsys.readouterr().err


@pytest.mark.parametrize("flags,needle", [
    (["--port", "abc"], "argument --port: invalid int value: 'abc'"),
    (["--api-workers", "1.5"], "argument --api-workers: invalid int value: '1.5'"),
])
def test_cli_type_errors_name_the_flag(capsys, flags, needle):
    from kvloom.cli.main import main

    with pytest.raises(SystemExit) as exit_:
        main(flags)
    assert exit_.value.code == 2 and needle in capsys.readouterr().err


def test_a_gateway_address_in_use_fails_before_the_model_loads(tiny_llama, tmp_path):
    from tests.server_utils import free_port

    taken = zmq.Context.instance().socket(zmq.ROUTER)
    port = free_port()
    taken.bind(f"tcp://127.0.0.1:{port}")
    try:
        # The gateway binds before it waits for the engine, so this fails as soon as it starts.
        srv = EngineServer(["--model", str(tiny_llama), "--gateway", f"tcp://127.0.0.1:{port}"], tmp_path)
        try:
            assert srv.proc.wait(timeout=120) == 1
        finally:
            srv.stop()
        assert f"cannot bind the gateway to tcp://127.0.0.1:{port}: Address already in use" in srv.log()
        assert "Traceback" not in srv.log()
    finally:
        taken.close(linger=0)


def test_peer_warnings_let_a_few_through_per_peer_and_window_and_count_the_rest(caplog):
    from kvloom.core.peer_warnings import PeerWarnings

    now = [0.0]
    warnings = PeerWarnings(logging.getLogger("kvloom.test"), burst=2, window_s=60.0, max_peers=2,
                            clock=lambda: now[0])
    caplog.set_level("WARNING", logger="kvloom.test")
    logged = [warnings.warning(b"a", "junk from %r", b"a") for _ in range(50)]
    assert logged[:2] == [True, True] and not any(logged[2:])
    assert warnings.warning(b"b", "junk from b") and warnings.warning(b"b", "junk from b")
    # A third peer beyond max_peers shares one budget with every other stranger.
    assert warnings.warning(b"c", "junk from c") and warnings.warning(b"d", "junk from d")
    assert not warnings.warning(b"e", "junk from e")
    now[0] = 61.0  # a new window: a's next warning says how many were held back
    assert warnings.warning(b"a", "junk from %r", b"a")
    assert caplog.records[-1].getMessage().endswith("(48 similar warning(s) about this peer were held back)")
    assert len(caplog.records) == 7
