"""The engine process's loop and protocol, run in a thread over a real ipc:// socket: routing per
frontend, batching per step, allow-listed utility calls, aborts, and draining on Shutdown."""

from __future__ import annotations

import asyncio
import os
import threading

import pytest

from kvloom.builder import build_engine
from kvloom.core import messages as m
from kvloom.core.config import EngineConfig
from kvloom.core.engine.process import EngineServer
from kvloom.core.sampling_params import SamplingParams
from kvloom.frontends.engine_client import AsyncEngineClient
from tests.server_utils import raw_socket

BLOCKS = 64
GREEDY = SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True)


@pytest.fixture
def engine(tiny_llama, tmp_path):
    server = EngineServer(EngineConfig(model=str(tiny_llama), num_kv_blocks=BLOCKS), f"ipc://{tmp_path}/e.sock",
                          model_name="tiny", build=build_engine)
    server.load()
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    server.thread = thread
    server.address = f"ipc://{tmp_path}/e.sock"
    yield server
    server.request_shutdown(drain=False)
    server.request_shutdown(drain=False)
    thread.join(10)
    if not server.socket.closed:
        server.close("test over")


async def connect(engine) -> AsyncEngineClient:
    client = AsyncEngineClient(engine.address)
    await client.start(timeout=10)
    return client


async def run(client, rid, prompt, sampling=GREEDY) -> list[m.TokenDelta]:
    return [d async for d in client.generate(rid, prompt, sampling)]


def test_each_frontend_gets_only_its_own_outputs(engine):
    async def main():
        a, b = await connect(engine), await connect(engine)
        assert (a.ready.model_name, a.ready.max_model_len, a.ready.vocab_size) == ("tiny", 512, 384)
        assert a.ready.eos_token_ids == [2] and a.ready.pid == os.getpid()
        solo_a, solo_b = await run(a, "a0", [5, 6, 7]), await run(b, "b0", [9, 10])
        # Same raw id from two frontends at once: the engine never lets the second take over the first.
        same = await asyncio.gather(run(a, "x", [5, 6, 7]), run(b, "x", [9, 10]))
        both = await asyncio.gather(run(a, "a1", [5, 6, 7]), run(b, "b1", [9, 10]))
        await a.close()
        await b.close()
        return solo_a, solo_b, same, both

    solo_a, solo_b, same, both = asyncio.run(main())
    tokens = lambda deltas: [t for d in deltas for t in d.new_token_ids]  # noqa: E731
    assert [tokens(d) for d in both] == [tokens(solo_a), tokens(solo_b)]
    assert len(tokens(solo_a)) == 5 and solo_a[-1].finish_reason == "length"
    finished = sorted(d[-1].finish_reason for d in same)
    assert finished == ["error", "length"]
    rejected = next(d[-1] for d in same if d[-1].finish_reason == "error")
    assert "already in use" in rejected.error and rejected.error_kind == "rejected"


def test_one_message_per_frontend_per_step(engine):
    sock = raw_socket(engine)
    for i in range(3):
        sock.send(m.encode(m.AddRequest(request_id=f"r{i}", prompt_token_ids=[4, 5, 6 + i], sampling=GREEDY)))
    messages, finished = [], set()
    while len(finished) < 3:
        msg = m.decode_engine_message(sock.recv())
        messages.append(msg)
        finished |= {d.request_id for d in msg.outputs if d.finish_reason}
    deltas = [d for msg in messages for d in msg.outputs]
    assert sum(len(d.new_token_ids) for d in deltas) == 15
    assert len(messages) < len(deltas)  # batched: the three requests share messages
    assert all(len({d.request_id for d in msg.outputs}) == len(msg.outputs) for msg in messages)
    assert messages[-1].stats.num_free_blocks == BLOCKS


def test_utility_calls_are_allow_listed(engine):
    async def main():
        client = await connect(engine)
        stats = await client.utility("stats")
        with pytest.raises(RuntimeError, match="unknown utility method 'step'"):
            await client.utility("step")
        try:
            await client.utility("reset_prefix_cache")
            reset = "ok"
        except RuntimeError as e:
            reset = str(e)
        await client.close()
        return stats, reset

    stats, reset = asyncio.run(main())
    assert stats["num_total_blocks"] == BLOCKS and stats["num_free_blocks"] == BLOCKS
    has_reset = hasattr(engine.core, "reset_prefix_cache")
    assert reset == "ok" if has_reset else "has no 'reset_prefix_cache'" in reset


def test_malformed_messages_are_dropped_and_aborts_free_blocks(engine):
    sock = raw_socket(engine)
    sock.send(b"\x93not a message")
    sock.send(m.encode(m.AddRequest(request_id="bad", prompt_token_ids=[999], sampling=GREEDY)))
    rejected = m.decode_engine_message(sock.recv()).outputs[0]
    assert (rejected.finish_reason, rejected.error_kind) == ("error", "rejected")
    assert "999" in rejected.error and "384" in rejected.error
    sock.send(m.encode(m.AddRequest(request_id="long", prompt_token_ids=[7] * 40,
                                    sampling=SamplingParams(max_tokens=300, ignore_eos=True))))
    first = m.decode_engine_message(sock.recv())
    assert first.outputs[0].request_id == "long" and first.stats.num_free_blocks < BLOCKS
    sock.send(m.encode(m.AbortRequest(request_ids=["long"])))
    last = first
    while not any(d.finish_reason for d in last.outputs):
        last = m.decode_engine_message(sock.recv())
    assert last.outputs[-1].finish_reason == "abort"
    assert last.stats.num_free_blocks == BLOCKS


def test_shutdown_drains_then_refuses_and_stops(engine):
    sock = raw_socket(engine)
    sock.send(m.encode(m.AddRequest(request_id="in-flight", prompt_token_ids=[3, 4],
                                    sampling=SamplingParams(max_tokens=20, ignore_eos=True))))
    sock.send(m.encode(m.Shutdown(drain=True)))
    sock.send(m.encode(m.AddRequest(request_id="late", prompt_token_ids=[3], sampling=GREEDY)))
    deltas, finished = [], set()
    while finished != {"in-flight", "late"}:
        msg = m.decode_engine_message(sock.recv())
        deltas.extend(msg.outputs)
        finished |= {d.request_id for d in msg.outputs if d.finish_reason}
    late = [d for d in deltas if d.request_id == "late"]
    assert late[0].finish_reason == "error" and late[0].error_kind == "unavailable"
    assert "shutting down" in late[0].error
    assert sum(len(d.new_token_ids) for d in deltas if d.request_id == "in-flight") == 20
    engine.thread.join(10)
    assert not engine.thread.is_alive()
    engine.close("bye")  # what the process does on exit: every frontend hears the engine is gone
    goodbye = m.decode_engine_message(sock.recv())
    assert isinstance(goodbye, m.EngineError) and goodbye.message == "bye"
