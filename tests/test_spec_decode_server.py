"""``engine --plugins prefix_cache,spec_decode`` serving a tiny model: the openai client's streamed
output at temperature 0 equals the output without speculation, and /metrics shows the acceptance."""

from __future__ import annotations

import json

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from kvloom import LLM, SamplingParams
from tests.server_utils import EngineServer

PROMPTS = [[5, 6, 7, 8] * 6, [200, 201, 202, 9, 10] * 3 + [200, 201]]


@pytest.fixture(scope="module")
def server(tiny_llama, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("spec-server")
    options = json.dumps({"spec_decode": {"num_speculative_tokens": 4, "prompt_lookup_min": 1}})
    srv = EngineServer(["--model", str(tiny_llama), "--num-kv-blocks", "256", "--plugins", "prefix_cache,spec_decode",
                        "--plugin-options", options], tmp)
    with srv:
        yield srv


def test_streamed_greedy_output_equals_no_speculation_and_metrics_show_acceptance(server, tiny_llama):
    plain = LLM(str(tiny_llama)).generate(PROMPTS, SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True),
                                          use_tqdm=False)
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0, timeout=60)
    model = client.models.list().data[0].id
    for prompt, want in zip(PROMPTS, plain):
        stream = client.completions.create(model=model, prompt=prompt, max_tokens=24, temperature=0.0, stream=True,
                                           extra_body={"ignore_eos": True})
        text = "".join(chunk.choices[0].text for chunk in stream if chunk.choices)
        assert text == want.text
    samples = {s.name: s.value for fam in text_string_to_metric_families(httpx.get(server.url + "/metrics").text)
               for s in fam.samples}
    assert samples["kvloom_spec_decode_num_draft_tokens_total"] > 0
    assert samples["kvloom_spec_decode_num_accepted_tokens_total"] > 0
    assert 0.0 < samples["kvloom_spec_decode_acceptance_rate"] <= 1.0
