"""The ZMQ gateway keeps the HTTP server's promises, on the real server and a real gateway
socket: a client that disconnects or stops reading has its requests stopped at once, nothing it is
sent is silently lost or miscounted, every door refuses a request over a limit with the same 400, and
the gateway asks for the server's API keys."""

from __future__ import annotations

import os
import time

import httpx
import msgspec
import pytest
import zmq

from tests.server_utils import EngineServer, free_port, kv_blocks

NUM_BLOCKS = 512
LONG = {"max_tokens": 500, "ignore_eos": True, "temperature": 0.0}


@pytest.fixture(scope="module")
def server(tiny_llama, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("gateway")
    srv = EngineServer(["--model", str(tiny_llama), "--num-kv-blocks", str(NUM_BLOCKS), "--gateway",
                        f"ipc://{tmp}/gw.sock"], tmp)
    srv.gateway = f"ipc://{tmp}/gw.sock"
    with srv:
        yield srv


def gateway_socket(address: str, timeout_ms: int = 30_000, **options) -> zmq.Socket:
    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.RCVTIMEO, timeout_ms)
    for name, value in options.items():
        sock.setsockopt(getattr(zmq, name), value)
    sock.connect(address)
    return sock


def send(sock: zmq.Socket, msg: dict) -> None:
    sock.send(msgspec.msgpack.encode(msg))


def recv(sock: zmq.Socket) -> dict:
    return msgspec.msgpack.decode(sock.recv())


def generate(request_id: str, **fields) -> dict:
    return {"type": "Generate", "request_id": request_id, **fields}


def wait_until(predicate, timeout: float, what: str) -> float:
    """Poll ``predicate`` until true; the seconds it took (AssertionError past ``timeout``)."""
    start = time.monotonic()
    while not predicate():
        if time.monotonic() - start > timeout:
            raise AssertionError(f"not within {timeout}s: {what}")
        time.sleep(0.01)
    return time.monotonic() - start


def all_blocks_free(url: str) -> bool:
    free, total = kv_blocks(url)
    return free == total


# --- a client that disconnects ---------------------------------------------------------------------
def test_a_disconnecting_client_has_its_requests_aborted_and_blocks_freed_within_half_a_second(server):
    sock = gateway_socket(server.gateway)
    for i in range(12):
        send(sock, generate(f"r{i}", prompt_token_ids=[5, 6, 7], sampling=LONG))
    chunks: dict[str, int] = {}
    while len(chunks) < 12 or min(chunks.values()) < 3:  # all twelve are streaming
        reply = recv(sock)
        assert reply["type"] == "TextChunk" and reply.get("finish_reason") is None, reply
        chunks[reply["request_id"]] = chunks.get(reply["request_id"], 0) + 1
    free, total = kv_blocks(server.url)
    assert free < total  # they hold KV blocks now
    sock.close()  # gone without a word
    took = wait_until(lambda: all_blocks_free(server.url), 5.0, "the gone client's KV blocks are free")
    assert took <= 0.5, f"freed {took:.2f}s after the client left"
    log = server.log()
    assert "never retrieved" not in log and "Traceback" not in log


# --- a client that stops reading -------------------------------------------------------------------
@pytest.fixture(scope="module")
def unread_server(tiny_llama, tmp_path_factory):
    """A gateway that keeps 64 unread replies per client (the default is 100,000), with an HTTP API key
    the gateway is told not to require (on ipc://, a file only this user reaches)."""
    tmp = tmp_path_factory.mktemp("gateway-unread")
    srv = EngineServer(["--model", str(tiny_llama), "--num-kv-blocks", str(NUM_BLOCKS), "--gateway",
                        f"ipc://{tmp}/gw.sock", "--gateway-max-unread", "64", "--api-key", "k",
                        "--no-gateway-require-api-key"], tmp, api_key="k")
    srv.gateway = f"ipc://{tmp}/gw.sock"
    with srv:
        yield srv


def test_a_client_that_stops_reading_is_stopped_and_gets_every_request_whole_or_failed(unread_server):
    server = unread_server
    # Small buffers on the client's side too, so its queue fills within a few hundred replies.
    sock = gateway_socket(server.gateway, RCVHWM=8, RCVBUF=4096)
    requests = [f"r{i}" for i in range(16)]
    for rid in requests:
        send(sock, generate(rid, prompt_token_ids=[5, 6, 7], sampling=LONG))
    # Not reading: the gateway's queue for this client fills, and its requests stop in the engine
    # long before their 16 x 500 tokens could be generated.
    wait_until(lambda: "unread replies (gateway_max_unread)" in server.log(), 60.0, "the gateway sees the full queue")
    wait_until(lambda: all_blocks_free(server.url), 10.0, "the unread client's requests stop")
    tokens: dict[str, int] = {rid: 0 for rid in requests}
    ends: dict[str, dict] = {}
    while len(ends) < len(requests):
        reply = recv(sock)  # a request with no last reply would time out here
        rid = reply["request_id"]
        assert rid not in ends, f"a reply after the last one of {rid}: {reply}"
        if reply["type"] == "RequestFailed":
            ends[rid] = reply
            continue
        tokens[rid] += len(reply.get("token_ids", []))
        if reply.get("finish_reason") is not None:
            ends[rid] = reply
    failed = [rid for rid, end in ends.items() if end["type"] == "RequestFailed"]
    assert failed, "no request was stopped"
    for rid, end in ends.items():
        if end["type"] == "TextChunk":  # whole: its usage counts exactly the tokens it was sent
            assert end["usage"]["completion_tokens"] == tokens[rid] == LONG["max_tokens"], (rid, end, tokens[rid])
        else:
            assert end["status"] == 429 and "unread" in end["message"], end
    assert sum(tokens.values()) < len(requests) * LONG["max_tokens"]
    # Reading again, the client is served as before.
    send(sock, generate("after", prompt_token_ids=[5, 6], sampling={"max_tokens": 3}))
    replies = [recv(sock)]
    while replies[-1].get("finish_reason") is None:
        assert replies[-1]["type"] == "TextChunk", replies[-1]
        replies.append(recv(sock))
    assert replies[-1]["usage"]["completion_tokens"] == 3
    sock.close()
    log = server.log()
    assert "never retrieved" not in log and "Traceback" not in log
    assert log.count("unread replies (gateway_max_unread)") <= 5


def test_the_ipc_socket_file_is_removed_when_the_gateway_stops(unread_server):
    # Keys are configured, and this gateway was told not to ask for them.
    sock = gateway_socket(unread_server.gateway)
    send(sock, generate("open", prompt_token_ids=[5], sampling={"max_tokens": 1}))
    assert recv(sock)["finish_reason"] == "length"
    sock.close()
    path = unread_server.gateway[len("ipc://"):]
    assert os.path.exists(path)
    assert unread_server.stop() == 0
    assert not os.path.exists(path)


# --- one validation, every door ----------------------------------------------------------------------
LIMITS = [  # (sampling field, a value over an HTTP limit, what the message names)
    ("stop", ["x"] * 17, "at most 16"),
    ("stop", ["x" * 1025], "1024"),
    ("stop_token_ids", [1] * 1025, "at most 1024"),
    ("stop_token_ids", [100_000], "[0, 384)"),
    ("temperature", 3.0, "[0.0, 2.0]"),
    ("top_p", 0.0, "(0, 1]"),
    ("top_k", -5, "2147483647"),
    ("min_p", 1.5, "[0.0, 1.0]"),
    ("presence_penalty", 3.0, "[-2.0, 2.0]"),
    ("frequency_penalty", -3.0, "[-2.0, 2.0]"),
    ("repetition_penalty", 0.0, "(0, 10]"),
    ("seed", 2**63, "9223372036854775807"),
    ("max_tokens", 2**31, "2147483647"),
    ("max_tokens", 600, "512 tokens"),
    ("min_tokens", -1, "2147483647"),
    ("logprobs", 21, "[0, 20]"),
    ("n", 200, "[1, 128]"),
    ("logit_bias", {5: 200.0}, "[-100, 100]"),
    ("logit_bias", {i: 1.0 for i in range(1025)}, "at most 1024"),
    ("logit_bias", {100_000: 1.0}, "[0, 384)"),
]


def http_error(server, body: dict) -> tuple[int, str]:
    r = httpx.post(server.url + "/v1/completions", json=body, headers=server.headers, timeout=30)
    return r.status_code, r.json()["error"]["message"]


def gateway_error(server, msg: dict, api_key: str | None = None) -> tuple[int, str]:
    sock = gateway_socket(server.gateway)
    try:
        send(sock, {**msg, "api_key": api_key} if api_key else msg)
        reply = recv(sock)
    finally:
        sock.close()
    assert reply["type"] == "RequestFailed" and reply["request_id"] == str(msg["request_id"]), reply
    return reply["status"], reply["message"]


@pytest.mark.parametrize("field,value,needle", LIMITS, ids=[f"{f}-{i}" for i, (f, _, _) in enumerate(LIMITS)])
def test_a_gateway_request_over_an_http_limit_gets_the_same_400_as_http(server, field, value, needle):
    json_value = {str(k): v for k, v in value.items()} if isinstance(value, dict) else value
    status, message = http_error(server, {"prompt": "hi", "max_tokens": 4, field: json_value})
    assert status == 400 and needle in message, message
    sampling = {"max_tokens": 4, field: value}
    assert gateway_error(server, generate("over", prompt="hi", sampling=sampling)) == (status, message)


def test_prompt_limits_and_priority_get_the_same_400_on_both_doors(server):
    status, message = http_error(server, {"prompt": [5, 100_000], "max_tokens": 4})
    assert (status, message) == (400, "token id 100000 is out of range [0, 384)")
    assert gateway_error(server, generate("tok", prompt_token_ids=[5, 100_000])) == (status, message)
    status, message = http_error(server, {"prompt": "hi", "max_tokens": 4, "priority": 2**40})
    assert status == 400 and "priority=1099511627776" in message
    assert gateway_error(server, generate("prio", prompt="hi", priority=2**40)) == (status, message)


def test_a_million_stop_strings_are_refused_by_the_limit_and_other_clients_are_served(server):
    sock = gateway_socket(server.gateway)
    pinger = gateway_socket(server.gateway)
    try:
        send(sock, generate("huge", prompt="hi", sampling={"max_tokens": 4, "stop": ["ab"] * 1_000_000}))
        send(pinger, {"type": "Ping"})
        assert recv(pinger)["healthy"]
        refused = recv(sock)
        assert refused["status"] == 400 and refused["message"] == "stop has 1000000 strings; at most 16 are allowed"
    finally:
        sock.close()
        pinger.close()


@pytest.fixture(scope="module")
def llm(tiny_llama):
    from kvloom import LLM

    return LLM(str(tiny_llama), num_kv_blocks=64)


@pytest.mark.parametrize("field,value,needle", [case for case in LIMITS if case[0] not in ("n",)][:6] + [
    ("max_tokens", 600, "512 tokens"), ("logit_bias", {100_000: 1.0}, "[0, 384)")])
def test_kvloom_llm_refuses_what_http_refuses_with_the_same_message(server, llm, field, value, needle):
    from kvloom.core.sampling_params import SamplingParams

    json_value = {str(k): v for k, v in value.items()} if isinstance(value, dict) else value
    status, message = http_error(server, {"prompt": "hi", "max_tokens": 4, field: json_value})
    assert status == 400 and needle in message
    with pytest.raises(ValueError) as err:
        llm.generate(["hi"], SamplingParams(**{"max_tokens": 4, field: value}), use_tqdm=False)
    assert str(err.value) == message
    assert not llm.engine.has_unfinished()


# --- the gateway's replies ----------------------------------------------------------------------------
def test_the_last_chunk_always_has_stop_reason_and_every_usage_count(server):
    sock = gateway_socket(server.gateway)
    send(sock, generate("plain", prompt_token_ids=[5, 6], sampling={"max_tokens": 2, "ignore_eos": True}))
    replies = [recv(sock)]
    while replies[-1].get("finish_reason") is None:
        assert "stop_reason" not in replies[-1] and "usage" not in replies[-1]
        replies.append(recv(sock))
    last = replies[-1]
    assert last["finish_reason"] == "length" and "stop_reason" in last and last["stop_reason"] is None
    assert last["usage"] == {"prompt_tokens": 2, "completion_tokens": 2, "cached_tokens": 0}
    # A cancelled request's last chunk counts what it was sent, too.
    send(sock, generate("cancel-me", prompt_token_ids=[5, 6], sampling=LONG))
    first = recv(sock)
    send(sock, {"type": "Cancel", "request_id": "cancel-me"})
    sent = len(first.get("token_ids", []))
    while True:
        reply = recv(sock)
        sent += len(reply.get("token_ids", []))
        if reply.get("finish_reason") is not None:
            break
    assert reply["finish_reason"] == "abort" and reply["stop_reason"] is None
    assert reply["usage"]["completion_tokens"] == sent and reply["usage"]["cached_tokens"] == 0
    sock.close()


def test_a_numeric_request_id_is_400_naming_the_field_under_its_text(server):
    status, message = gateway_error(server, generate(7, prompt="hi"))  # request_id 7: answered as "7"
    assert status == 400 and message.startswith("request_id=7 must be a string")


# --- API keys on every door --------------------------------------------------------------------------
def test_a_tcp_gateway_of_a_server_with_api_keys_requires_them(tiny_llama, tmp_path):
    gateway = f"tcp://127.0.0.1:{free_port()}"
    with EngineServer(["--model", str(tiny_llama), "--num-kv-blocks", "64", "--gateway", gateway,
                       "--api-key", "sk-both"], tmp_path, api_key="sk-both") as srv:
        srv.gateway = gateway
        msg = generate("k", prompt_token_ids=[5], sampling={"max_tokens": 1})
        assert gateway_error(srv, msg)[0] == 401
        assert gateway_error(srv, msg, api_key="wrong")[0] == 401
        sock = gateway_socket(gateway)
        send(sock, {**msg, "api_key": "sk-both"})
        assert recv(sock)["finish_reason"] == "length"
        sock.close()
        assert "API key required" in srv.log()
