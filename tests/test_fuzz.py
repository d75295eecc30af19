"""A seeded fuzz of one real server (HTTP and gateway) on the tiny random model: 2,000 messages in all,
1,600 HTTP bodies and 400 gateway messages, mostly malformed, then gateway clients that disconnect
mid-stream or stop reading. Every answer is 2xx/4xx in time, no gateway stream is lost or truncated, no
process exits, and the server is as good as new afterwards (same greedy output, every KV block free).
benchmarks/fuzz_server.py runs the same generator with 20,000 bodies by hand."""

from __future__ import annotations

import asyncio

import pytest

from benchmarks.fuzz_server import (
    GATEWAY_MAX_UNREAD,
    FuzzResult,
    abusive_gateway_clients,
    fuzz_gateway,
    fuzz_http,
    greedy_probe,
    wait_all_blocks_free,
)
from tests.server_utils import EngineServer

HTTP_BODIES = 1600
GATEWAY_MESSAGES = 400


@pytest.fixture(scope="module")
def server(tiny_llama, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("fuzz")
    gateway = f"ipc://{tmp}/gw.sock"
    srv = EngineServer(["--model", str(tiny_llama), "--num-kv-blocks", "512", "--gateway", gateway,
                        "--gateway-max-unread", str(GATEWAY_MAX_UNREAD)], tmp)
    srv.gateway = gateway
    srv.model = str(tiny_llama)
    with srv:
        yield srv


def test_fuzzed_bodies_and_messages_never_get_a_5xx_or_hang(server):
    before = greedy_probe(server.url, server.model)
    pids = sorted(server.descendants())
    result = FuzzResult()
    asyncio.run(fuzz_http(server.url, server.model, HTTP_BODIES, seed=13, result=result, concurrency=16,
                          timeout=60))
    fuzz_gateway(server.gateway, GATEWAY_MESSAGES, seed=13, result=result)
    abusive_gateway_clients(server.gateway, rounds=3, seed=13, result=result)

    assert not result.failures, "\n".join(result.failures[:10])
    assert sum(result.statuses.values()) == HTTP_BODIES
    assert all(200 <= s < 300 or 400 <= s < 500 for s in result.statuses)
    # The generator is not vacuous: both valid and invalid requests, on both frontends.
    assert result.statuses[200] > HTTP_BODIES // 10 and result.statuses[400] > HTTP_BODIES // 3
    assert result.gateway["TextChunk length"] > 50 and result.gateway["RequestFailed 400"] > 50
    assert result.gateway["client disconnected mid-stream"] == 3
    assert sum(n for k, n in result.gateway.items() if k.startswith("client that stopped reading")) == 3 * 8
    assert server.proc.poll() is None and sorted(server.descendants()) == pids
    assert greedy_probe(server.url, server.model) == before
    assert wait_all_blocks_free(server.url)
    assert "Unhandled error" not in server.log() and "Traceback" not in server.log()
