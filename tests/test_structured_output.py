"""Structured outputs on the real server (SmolLM2-135M-Instruct) through the official ``openai`` client:
json_schema output that parses and validates against its schema (temperature 0 and 1, streaming and
not), json_object, vLLM's guided_choice / guided_regex / guided_grammar / structured_outputs, logit_bias,
and 400s that name a bad schema, regex or grammar."""

from __future__ import annotations

import json
import re

import httpx
import jsonschema
import openai
import pytest

from kvloom.core.config import DEFAULT_MODEL
from tests.server_utils import EngineServer

pytestmark = pytest.mark.slow

SCHEMAS = {
    "person": {"type": "object", "properties": {"name": {"type": "string", "maxLength": 20},
                                                "age": {"type": "integer", "minimum": 0, "maximum": 150}},
               "required": ["name", "age"], "additionalProperties": False},
    "colors": {"type": "object", "properties": {"colors": {"type": "array", "minItems": 1, "maxItems": 3,
                                                           "items": {"enum": ["red", "green", "blue"]}}},
               "required": ["colors"], "additionalProperties": False},
    "city": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 24},
                                              "capital": {"type": "boolean"},
                                              "population": {"type": "number"}},
             "required": ["city", "capital", "population"], "additionalProperties": False},
}
PROMPTS = {"person": "Describe a person as JSON.", "colors": "List some colors as JSON.",
           "city": "Give me a city as JSON."}


@pytest.fixture(scope="module")
def server(smollm2_path, tmp_path_factory):
    # The grammar's cases follow the 135M model's own trajectories, which ask it to close what it opened: with the
    # 4-bit layers' inputs at 8 bits (the dot-product CPUs' default) its greedy '{"ok": true, "message": ...' runs
    # on past 40 tokens and "colors" at temperature 1 into whitespace. The grammar work is the same either way, so
    # these run on bf16 inputs, the numerics they were written against.
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("KVLOOM_CPU_INT8_INPUTS", "0")
        srv = EngineServer(["--max-model-len", "1024", "--num-kv-blocks", "256"], tmp_path_factory.mktemp("so"))
    with srv:
        yield srv


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=120)


def _chat(client, content: str, stream: bool = False, **kwargs) -> tuple[str, str]:
    """The reply's text and finish reason, streamed or not."""
    messages = [{"role": "user", "content": content}]
    if not stream:
        out = client.chat.completions.create(model=DEFAULT_MODEL, messages=messages, **kwargs)
        return out.choices[0].message.content, out.choices[0].finish_reason
    text, finish = "", None
    for chunk in client.chat.completions.create(model=DEFAULT_MODEL, messages=messages, stream=True, **kwargs):
        for choice in chunk.choices:
            text += choice.delta.content or ""
            finish = choice.finish_reason or finish
    return text, finish


# Each schema at both temperatures, and each temperature both streamed and not (the CPU is slow: six runs).
CASES = [("person", 0.0, False), ("person", 1.0, True), ("colors", 0.0, True), ("colors", 1.0, False),
         ("city", 0.0, False), ("city", 1.0, True)]


@pytest.mark.parametrize("name,temperature,stream", CASES)
def test_json_schema_strict_output_validates(client, name, temperature, stream):
    fmt = {"type": "json_schema", "json_schema": {"name": name, "schema": SCHEMAS[name], "strict": True}}
    text, finish = _chat(client, PROMPTS[name], stream, response_format=fmt, temperature=temperature, seed=11,
                         max_tokens=200)
    assert finish == "stop", text  # the grammar ended the output, not the token budget
    jsonschema.validate(json.loads(text), SCHEMAS[name])


def test_json_object_output_is_a_json_object(client):
    text, finish = _chat(client, 'Reply with the JSON object {"ok": true} and nothing else.',
                         response_format={"type": "json_object"}, temperature=0, max_tokens=40)
    assert finish == "stop" and isinstance(json.loads(text), dict), text


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_guided_choice_returns_one_of_the_choices(client, temperature):
    choices = ["positive", "negative", "neutral"]
    for seed in range(3):
        text, finish = _chat(client, "Is 'I love this film' positive or negative?", temperature=temperature,
                             seed=seed, extra_body={"guided_choice": choices})
        assert text in choices and finish == "stop"


def test_guided_regex_output_matches(client):
    pattern = r"\d{3}-\d{4}"
    for stream in (False, True):
        text, finish = _chat(client, "Give me a phone number.", stream, temperature=1.0, seed=5,
                             extra_body={"guided_regex": pattern})
        assert re.fullmatch(pattern, text) and finish == "stop", text


def test_guided_grammar_and_structured_outputs_field(client):
    text, _ = _chat(client, "Say yes or no.", temperature=1.0, extra_body={"guided_grammar": 'root ::= "yes" | "no"'})
    assert text in ("yes", "no")
    text, _ = _chat(client, "Pick a size.", temperature=1.0,
                    extra_body={"structured_outputs": {"choice": ["small", "large"]}})
    assert text in ("small", "large")
    text, _ = _chat(client, "A number:", temperature=1.0, extra_body={"structured_outputs": {"regex": "[1-9][0-9]?"}})
    assert re.fullmatch("[1-9][0-9]?", text)


def test_completions_take_guided_json_too(client):
    schema = SCHEMAS["person"]
    out = client.completions.create(model=DEFAULT_MODEL, prompt="A person in JSON:", max_tokens=120, temperature=0,
                                    extra_body={"guided_json": schema})
    jsonschema.validate(json.loads(out.choices[0].text), schema)


def test_n_choices_each_follow_the_grammar(client):
    out = client.chat.completions.create(model=DEFAULT_MODEL, messages=[{"role": "user", "content": "Pick."}],
                                         n=3, temperature=1.0, seed=2,
                                         extra_body={"guided_choice": ["alpha", "beta", "gamma"]})
    assert [c.message.content in ("alpha", "beta", "gamma") for c in out.choices] == [True] * 3


def test_logit_bias_forces_and_bans_tokens(client, server):
    ids = httpx.post(server.url + "/tokenize", json={"prompt": " banana", "add_special_tokens": False}).json()["tokens"]
    forced = _chat(client, "Hello", temperature=1.0, max_tokens=3, logit_bias={str(ids[0]): 100})[0]
    assert forced == " banana" * 3 or forced.startswith(" banana banana")
    plain = _chat(client, "What is the capital of France?", temperature=0, max_tokens=8)[0]
    paris = httpx.post(server.url + "/tokenize", json={"prompt": plain, "add_special_tokens": False}).json()["tokens"]
    banned = _chat(client, "What is the capital of France?", temperature=0, max_tokens=8,
                   logit_bias={str(paris[0]): -100})[0]
    assert banned != plain


@pytest.mark.parametrize("fields,param,words", [
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": 5}}}}, None,
     "invalid json"),
    ({"guided_regex": "(("}, None, "parenthesis"),
    ({"guided_grammar": "root ::= "}, None, "invalid grammar"),
    ({"guided_choice": []}, "guided_choice", "non-empty list"),
    ({"guided_json": "{not json"}, "guided_json", "not valid JSON"),
    ({"response_format": {"type": "xml"}}, "response_format.type", "json_schema"),
    ({"guided_regex": "a", "guided_choice": ["a"]}, "guided_choice", "only one output constraint"),
    ({"structured_outputs": {"choice": ["a"], "regex": "a"}}, "structured_outputs", "one constraint"),
    ({"guided_decoding_backend": "outlines"}, "guided_decoding_backend", "xgrammar"),
    ({"logit_bias": {"5": 101}}, "logit_bias", "[-100, 100]"),
    ({"logit_bias": {"99999999": 1}}, None, "out of range"),
    ({"logit_bias": {"x": 1}}, "logit_bias", "token id"),
    ({"guided_choice": ["a"], "min_tokens": 2}, "min_tokens", "structured outputs"),
])
def test_bad_constraints_are_400s_naming_the_problem(server, fields, param, words):
    body = {"model": DEFAULT_MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, **fields}
    r = httpx.post(server.url + "/v1/chat/completions", json=body, timeout=60)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert words in error["message"], error
    if param is not None:
        assert error["param"] == param


def test_a_bad_schema_streamed_is_a_400_before_any_event(client):
    with pytest.raises(openai.BadRequestError, match="invalid regex"):
        list(client.chat.completions.create(model=DEFAULT_MODEL, messages=[{"role": "user", "content": "hi"}],
                                            stream=True, extra_body={"guided_regex": "[z-a]"}))
