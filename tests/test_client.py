"""The gateway's Python clients against a scripted gateway (a ROUTER socket in a thread): the blocking
``Client`` (a wrapper over ``AsyncClient``) and ``AsyncClient`` stream, generate and ping; stopping a stream
early cancels its request; a refusal the gateway cannot tie to a request, and a gateway that never answers,
end a call with an error instead of a hang; closing a client ends its thread."""

from __future__ import annotations

import asyncio
import threading

import pytest
import zmq

from kvloom.client import AsyncClient, Client, Completion, GatewayError
from kvloom.core.messages import (Cancel, Generate, Ping, Pong, RequestFailed, TextChunk, Usage,
                                  decode_gateway_request, encode)


class ScriptedGateway:
    """Answers by prompt: ``count`` three chunks; ``long`` one chunk, then the last (``abort``) once cancelled;
    ``refuse`` a refusal without a request id (as for an oversized message); ``silent`` nothing."""

    def __init__(self) -> None:
        self._ctx = zmq.Context()
        self._sock = self._ctx.socket(zmq.ROUTER)
        self._sock.setsockopt(zmq.LINGER, 0)
        self._sock.bind("tcp://127.0.0.1:*")
        self.address = self._sock.getsockopt_string(zmq.LAST_ENDPOINT)
        self.cancelled: list[str] = []
        self.cancel_seen = threading.Event()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._serve, daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        while not self._stop.is_set():
            if not self._sock.poll(50):
                continue
            ident, data = self._sock.recv_multipart()
            msg = decode_gateway_request(data)
            if isinstance(msg, Ping):
                self._send(ident, Pong(healthy=True, model="scripted", max_model_len=64))
            elif isinstance(msg, Cancel):
                self.cancelled.append(msg.request_id)
                self._send(ident, TextChunk(request_id=msg.request_id, text="", finish_reason="abort"))
                self.cancel_seen.set()
            elif isinstance(msg, Generate):
                self._answer(ident, msg)

    def _answer(self, ident: bytes, msg: Generate) -> None:
        rid = msg.request_id
        if msg.prompt == "count":
            for i, word in enumerate(("one", " two", " three")):
                last = i == 2
                self._send(ident, TextChunk(request_id=rid, text=word, token_ids=[i],
                                            finish_reason="length" if last else None,
                                            usage=Usage(prompt_tokens=1, completion_tokens=3) if last else None))
        elif msg.prompt == "long":
            self._send(ident, TextChunk(request_id=rid, text="start", token_ids=[7]))
        elif msg.prompt == "refuse":
            self._send(ident, RequestFailed(request_id="", status=413, message="the message is too big"))

    def _send(self, ident: bytes, reply) -> None:
        self._sock.send_multipart([ident, encode(reply)])

    def close(self) -> None:
        self._stop.set()
        self._thread.join()
        self._sock.close(linger=0)
        self._ctx.term()


@pytest.fixture
def gateway():
    gw = ScriptedGateway()
    yield gw
    gw.close()


def _client_threads() -> int:
    return sum(t.name == "kvloom-client" for t in threading.enumerate())


def test_blocking_client_streams_generates_and_pings(gateway):
    with Client(gateway.address, timeout=30) as client:
        pong = client.ping()
        assert pong.healthy and pong.model == "scripted" and pong.max_model_len == 64
        chunks = list(client.stream("count", max_tokens=3))
        assert [c.text for c in chunks] == ["one", " two", " three"]
        assert chunks[-1].finish_reason == "length" and chunks[-1].usage.completion_tokens == 3
        done = client.generate("count", max_tokens=3)
        assert isinstance(done, Completion)
        assert (done.text, done.token_ids, done.finish_reason) == ("one two three", [0, 1, 2], "length")
        # two streams open at once, read in turn
        a, b = client.stream("count", request_id="a"), client.stream("count", request_id="b")
        assert (next(a).text, next(b).text, next(a).text) == ("one", "one", " two")
        with pytest.raises(ValueError, match="already in flight"):
            next(client.stream("count", request_id="a"))
        assert [c.text for c in b] == [" two", " three"] and [c.text for c in a] == [" three"]


def test_stopping_a_stream_early_cancels_its_request(gateway):
    with Client(gateway.address, timeout=30) as client:
        stream = client.stream("long", request_id="stop-me", max_tokens=100)
        assert next(stream).text == "start"
        stream.close()
        assert gateway.cancel_seen.wait(10), "no Cancel reached the gateway"
        assert gateway.cancelled == ["stop-me"]
        assert client.generate("count").text == "one two three"  # the connection goes on serving


def test_a_refusal_without_a_request_id_fails_the_waiting_call(gateway):
    # timeout 20: were the refusal dropped, the call would end in TimeoutError instead
    with Client(gateway.address, timeout=20) as client:
        with pytest.raises(GatewayError, match="too big") as err:
            client.generate("refuse")
        assert err.value.status == 413

    async def main():
        async with AsyncClient(gateway.address, timeout=20) as client:
            with pytest.raises(GatewayError, match="too big"):
                await client.generate("refuse")
            return (await client.generate("count")).text

    assert asyncio.run(main()) == "one two three"


def test_a_silent_gateway_ends_the_call_with_a_timeout(gateway):
    with Client(gateway.address, timeout=0.5) as client:
        with pytest.raises(TimeoutError, match="no reply from the kvloom gateway"):
            client.generate("silent")
        client.timeout = 30
        assert client.timeout == 30 and client.ping().healthy


def test_closing_a_client_ends_its_thread(gateway):
    before = _client_threads()
    client = Client(gateway.address, timeout=30)
    assert _client_threads() == before + 1
    assert client.ping().healthy
    client.close()
    client.close()  # twice is fine
    assert _client_threads() == before
    with pytest.raises(RuntimeError, match="closed"):
        client.ping()
