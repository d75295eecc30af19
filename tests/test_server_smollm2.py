"""The real server on the real model (SmolLM2-135M-Instruct, the default of ``engine``) through the
official ``openai`` client, streaming and not."""

from __future__ import annotations

import openai
import pytest

from kvloom.core.config import DEFAULT_MODEL
from tests.server_utils import EngineServer

pytestmark = pytest.mark.slow

# the bare question's first token is a near tie (0.12-0.25 nats) on 4-bit weights: "L'Étoile, ..." from llama.cpp too
QUESTION = [{"role": "user", "content": "What is the capital of France? Answer in one sentence."}]


@pytest.fixture(scope="module")
def client(smollm2_path, tmp_path_factory):
    # No --model: the default model is served.
    server = EngineServer(["--max-model-len", "1024", "--num-kv-blocks", "256"], tmp_path_factory.mktemp("smol"))
    try:
        server.wait_ready()
        yield openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=120)
    finally:
        server.stop()


def test_default_model_is_served(client):
    assert [m.id for m in client.models.list().data] == [DEFAULT_MODEL]


def test_chat_answers_and_streams_the_same_text(client):
    full = client.chat.completions.create(model=DEFAULT_MODEL, messages=QUESTION, max_tokens=8, temperature=0)
    answer = full.choices[0].message.content
    assert "Paris" in answer
    assert full.usage.completion_tokens <= 8 and full.usage.prompt_tokens > 10

    stream = client.chat.completions.create(model=DEFAULT_MODEL, messages=QUESTION, max_tokens=8, temperature=0,
                                            stream=True, stream_options={"include_usage": True})
    chunks = list(stream)
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == answer
    assert chunks[-1].usage.completion_tokens == full.usage.completion_tokens


def test_completion_logprobs_spell_the_text(client):
    out = client.completions.create(model=DEFAULT_MODEL, prompt="The capital of France is", max_tokens=6,
                                    temperature=0, logprobs=1)
    choice = out.choices[0]
    assert choice.logprobs.tokens and "".join(choice.logprobs.tokens) == choice.text
    assert all(lp <= 0 for lp in choice.logprobs.token_logprobs)
