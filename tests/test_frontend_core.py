"""Frontend text handling and validation without a server: incremental detokenization across
multi-byte characters, stop strings across tokens, context and admission limits."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import pytest

from kvloom.core.messages import EngineReady
from kvloom.core.sampling_params import SamplingParams
from kvloom.frontends.frontend_core import FrontendCore, RequestError
from kvloom.frontends.text import IncrementalText, load_tokenizer


@pytest.fixture(scope="module")
def tokenizer(smollm2_path):
    return load_tokenizer(str(smollm2_path))


def stream_pieces(tokenizer, text, **kw):
    ids = tokenizer.encode(text, add_special_tokens=False)
    inc = IncrementalText(tokenizer, **kw)
    pieces = [inc.add_tokens([t], final=i == len(ids) - 1) for i, t in enumerate(ids)]
    return ids, pieces, inc


def test_multibyte_characters_are_never_split(tokenizer):
    text = "café 東京 🚀 naïve — ok"
    ids, pieces, _ = stream_pieces(tokenizer, text)
    assert "".join(pieces) == text
    assert not any("\ufffd" in p for p in pieces)
    assert "" in pieces  # some tokens are partial characters: their text waits for the next token
    assert len(ids) > len(text.split())


def test_stop_string_across_tokens_is_cut_and_never_shown(tokenizer):
    text = "Hello world, this is a test of stopping."
    _, pieces, inc = stream_pieces(tokenizer, text, stop=["is a te"])
    assert "".join(pieces) == "Hello world, this "
    assert inc.stopped_by == "is a te"
    _, pieces, _ = stream_pieces(tokenizer, text, stop=["is a te"], include_stop_str_in_output=True)
    assert "".join(pieces) == "Hello world, this is a te"


class FakeClient:
    frontend_id = "fe-test"

    def __init__(self, in_flight=0, healthy=True):
        self.num_in_flight = in_flight
        self.healthy = healthy
        self.dead_reason = None if healthy else "the engine process went away"
        self.unavailable_reason = self.dead_reason


    async def generate(self, request_id, prompt_token_ids, sampling, priority=0, arrival_time=0.0, **deadlines):
        try:
            await asyncio.sleep(3600)  # an engine that never answers
            yield None
        finally:
            self.aborted = request_id


def core(in_flight=0, healthy=True, limit=4, timeout=None, tokenizer=None):
    ready = EngineReady(model_name="m", max_model_len=100, vocab_size=50, num_kv_blocks=10, block_size=16,
                        eos_token_ids=[2])
    return FrontendCore(FakeClient(in_flight, healthy), tokenizer or SimpleNamespace(), ready,
                        max_pending_requests=limit, request_timeout=timeout)


def test_prepare_checks_the_context_with_numbers():
    with pytest.raises(RequestError) as e:
        core().prepare([1] * 30, SamplingParams(max_tokens=80))
    assert e.value.status == 400 and e.value.param == "max_tokens"
    assert all(s in e.value.message for s in ("100 tokens", "110 tokens", "30 in the prompt", "80 for the"))
    # No max_tokens: whatever the context leaves.
    assert core().prepare([1] * 30, SamplingParams(max_tokens=None)).sampling.max_tokens == 70
    with pytest.raises(RequestError, match="leaves no room"):
        core().prepare([1] * 100, SamplingParams(max_tokens=None))
    with pytest.raises(RequestError, match="token id 50 is out of range"):
        core().check_token_ids([1, 50])


def test_admission_limit_and_dead_engine():
    full = core()
    slots = full.admit(4)
    with pytest.raises(RequestError) as e:
        full.prepare([1], SamplingParams())
    assert e.value.status == 429 and "at most max_pending_requests=4" in e.value.message
    with pytest.raises(RequestError):
        full.admit(1)
    slots.release()
    slots.release()  # idempotent: slots come back once
    assert full.num_admitted == 0
    full.admit(4).release()
    with pytest.raises(RequestError) as e:
        core(healthy=False).prepare([1], SamplingParams())
    assert e.value.status == 503 and "went away" in e.value.message
    c = core()
    assert c.next_request_id().startswith("fe-test:") and c.next_request_id() != c.next_request_id()


def test_request_timeout_stops_the_request(tokenizer):
    c = core(timeout=0.2, tokenizer=tokenizer)

    async def main():
        with pytest.raises(RequestError) as e:
            async for _ in c.generate(c.prepare([1, 2], SamplingParams(max_tokens=5))):
                pass
        return e.value

    error = asyncio.run(main())
    assert error.status == 408 and "request_timeout=0.2s" in error.message
    assert c.client.aborted.startswith("fe-test:")
