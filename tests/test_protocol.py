"""The wire protocol: one module of msgspec messages, its checked-in JSON Schema, msgpack round trips."""

from __future__ import annotations

import re
import typing
from pathlib import Path

import msgspec
import pytest

from kvloom.core import messages as m
from kvloom.core.sampling_params import SamplingParams

DOCS = Path(__file__).resolve().parents[1] / "docs"
PACKAGE = Path(__file__).resolve().parents[1] / "kvloom"


def test_checked_in_schema_is_current():
    # Regenerate with: python -m kvloom.core.messages docs/protocol.schema.json
    assert (DOCS / "protocol.schema.json").read_text() == m.protocol_schema_text()


def test_protocol_page_names_every_message():
    page = (DOCS / "protocol.md").read_text()
    for union in m.CHANNELS.values():
        for cls in typing.get_args(union):
            assert f"`{cls.__name__}" in page, cls.__name__


SAMPLES = [
    m.RegisterFrontend(frontend_id="fe1", pid=7),
    m.AddRequest(request_id="fe1:0", prompt_token_ids=[1, 2], sampling=SamplingParams(max_tokens=3, stop=["x"])),
    m.AbortRequest(request_ids=["fe1:0"]),
    m.Utility(call_id=1, method="stats"),
    m.Shutdown(drain=False),
    m.StepOutputs(outputs=[m.TokenDelta(request_id="a", new_token_ids=[5], finish_reason="stop", stop_token_id=5,
                                        logprobs=[m.TokenLogprobs(5, -0.1, [m.TopLogprob(5, -0.1)])])],
                  stats=m.EngineStats(num_free_blocks=3)),
    m.UtilityResult(call_id=1, error="no"),
    m.EngineError(message="gone"),
    m.EngineReady(model_name="x", max_model_len=8, vocab_size=10, num_kv_blocks=4, block_size=16, eos_token_ids=[2]),
    m.Generate(request_id="1", messages=[m.ChatMessage(role="user", content="hi")]),
    m.Cancel(request_id="1"),
    m.Ping(),
    m.TextChunk(request_id="1", text="é", token_ids=[3], finish_reason="length", usage=m.Usage(prompt_tokens=2)),
    m.RequestFailed(request_id="1", message="bad", status=429),
    m.Pong(healthy=False, message="down"),
]
DECODERS = {m.FrontendMessage: m.decode_frontend_message, m.EngineMessage: m.decode_engine_message,
            m.GatewayRequest: m.decode_gateway_request, m.GatewayReply: m.decode_gateway_reply}


@pytest.mark.parametrize("msg", SAMPLES, ids=lambda msg: type(msg).__name__)
def test_round_trip_through_msgpack(msg):
    union = next(u for u in DECODERS if type(msg) in typing.get_args(u))
    data = m.encode(msg)
    assert DECODERS[union](data) == msg
    # Self-describing for other languages: a plain msgpack map whose "type" names the message.
    assert msgspec.msgpack.decode(data)["type"] == type(msg).__name__


def test_gateway_accepts_a_plain_map_from_another_language():
    raw = msgspec.msgpack.encode({"type": "Generate", "request_id": "7", "prompt": "hi",
                                  "sampling": {"max_tokens": 4, "temperature": 0}})
    msg = m.decode_gateway_request(raw)
    assert msg.prompt == "hi" and msg.sampling.max_tokens == 4 and msg.sampling.greedy


def test_nothing_is_pickled():
    pattern = re.compile(r"\bimport pickle\b|\bpickle\.|send_pyobj|recv_pyobj|cloudpickle")
    offenders = [str(p) for p in PACKAGE.rglob("*.py") if pattern.search(p.read_text())]
    assert offenders == []
