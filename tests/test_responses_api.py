"""OpenAI's Responses API through the official ``openai`` client against the real server (a tiny random
model with a Hermes-style template, two API workers sharing the response store): each response equals
what /v1/chat/completions gives for the same request (greedy, or one seed), whole and streamed; a
function-tool round trip through previous_response_id; json_schema output validated; GET and DELETE."""

from __future__ import annotations

import json
from typing import Literal

import httpx
import jsonschema
import openai
import pydantic
import pytest

from tests.server_utils import EngineServer
from tests.test_tools import HERMES_TEMPLATE, TOOLS

SERVED = "tiny-responses"
MAIN_KEY, OTHER_KEY = "main-secret-key", "other-secret-key"
KEYS = [{"key": MAIN_KEY, "name": "main"}, {"key": OTHER_KEY, "name": "other"}]
SYSTEM = "You answer briefly."
TURNS = [{"role": "user", "content": "Hello there"}, {"role": "assistant", "content": "Hi."},
         {"role": "user", "content": "What is the capital of France?"}]
FUNCTIONS = [{"type": "function", **t["function"]} for t in TOOLS]  # the Responses API's flat tool shape
CITY = {"type": "object", "properties": {"city": {"enum": ["Paris", "Rome", "Tokyo"]}}, "required": ["city"],
        "additionalProperties": False}


class City(pydantic.BaseModel):
    city: Literal["Paris", "Rome", "Tokyo"]


@pytest.fixture(scope="module")
def server(tiny_llama, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("responses")
    (tmp / "hermes.jinja").write_text(HERMES_TEMPLATE)
    srv = EngineServer(["--model", str(tiny_llama), "--num-kv-blocks", "256", "--served-model-name", SERVED,
                        "--chat-template", str(tmp / "hermes.jinja"), "--tool-call-parser", "hermes",
                        "--enable-auto-tool-choice", "--api-keys", json.dumps(KEYS), "--api-workers", "2"],
                       tmp, api_key=MAIN_KEY)
    with srv:
        yield srv


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key=MAIN_KEY, max_retries=0, timeout=120)


def _chat(client, messages, **kw):
    return client.chat.completions.create(model=SERVED, messages=messages, **kw)


def test_create_equals_chat_for_text_and_chat_input(client):
    r = client.responses.create(model=SERVED, input="What is the capital of France?", instructions=SYSTEM,
                                max_output_tokens=10, temperature=0)
    chat = _chat(client, [{"role": "system", "content": SYSTEM},
                          {"role": "user", "content": "What is the capital of France?"}], max_tokens=10, temperature=0)
    assert r.output_text == chat.choices[0].message.content and r.object == "response"
    assert (r.status, r.incomplete_details.reason) == ("incomplete", "max_output_tokens")
    assert (r.usage.input_tokens, r.usage.output_tokens, r.usage.total_tokens) == \
        (chat.usage.prompt_tokens, chat.usage.completion_tokens, chat.usage.total_tokens)
    (message,) = r.output
    assert message.type == "message" and message.role == "assistant" and message.content[0].type == "output_text"
    items = [TURNS[0], {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "Hi."}]},
             {"role": "user", "content": [{"type": "input_text", "text": TURNS[2]["content"]}]}]
    r = client.responses.create(model=SERVED, input=items, max_output_tokens=10, temperature=0)
    chat = _chat(client, TURNS, max_tokens=10, temperature=0)
    assert r.output_text == chat.choices[0].message.content
    assert r.usage.input_tokens == chat.usage.prompt_tokens


def test_stream_events_add_up_to_the_whole_response(client):
    kw = dict(model=SERVED, input=TURNS, instructions=SYSTEM, max_output_tokens=10, temperature=0)
    whole = client.responses.create(**kw)
    events = list(client.responses.create(**kw, stream=True))
    kinds = [e.type for e in events]
    assert kinds[:4] == ["response.created", "response.in_progress", "response.output_item.added",
                         "response.content_part.added"]
    assert kinds[-4:] == ["response.output_text.done", "response.content_part.done", "response.output_item.done",
                          "response.incomplete"]
    assert [e.sequence_number for e in events] == list(range(len(events)))
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert text == whole.output_text == events[-1].response.output_text
    assert events[-1].response.usage.output_tokens == whole.usage.output_tokens == 10


def test_named_call_cut_by_max_output_tokens_is_text(client):
    # Chat completions answer it as a call holding the text so far (as vLLM); a function_call item here
    # would claim arguments that are not JSON, so the response is that text, incomplete.
    ask = "What is the weather in Paris?"
    (call,) = _chat(client, [{"role": "user", "content": ask}], tools=TOOLS, max_tokens=4, temperature=0,
                    tool_choice={"type": "function", "function": {"name": "get_weather"}}).choices[0].message.tool_calls
    r = client.responses.create(model=SERVED, input=ask, tools=FUNCTIONS, temperature=0, max_output_tokens=4,
                                tool_choice={"type": "function", "name": "get_weather"})
    assert r.status == "incomplete" and [o.type for o in r.output] == ["message"]
    assert r.output_text == call.function.arguments


def test_function_tool_round_trip_through_previous_response_id(client, server):
    ask = "What is the weather in Paris?"
    named = {"type": "function", "name": "get_weather"}
    first = client.responses.create(model=SERVED, input=ask, tools=FUNCTIONS, tool_choice=named, temperature=0,
                                    max_output_tokens=60)
    (call,) = first.output
    assert call.type == "function_call" and call.name == "get_weather" and first.status == "completed"
    jsonschema.validate(json.loads(call.arguments), TOOLS[0]["function"]["parameters"])
    chat_first = _chat(client, [{"role": "user", "content": ask}], tools=TOOLS, max_tokens=60, temperature=0,
                       tool_choice={"type": "function", "function": {"name": "get_weather"}})
    (chat_call,) = chat_first.choices[0].message.tool_calls
    assert json.loads(chat_call.function.arguments) == json.loads(call.arguments)
    # The stream helper (strict about event order and item identity) assembles the same call.
    with client.responses.stream(model=SERVED, input=ask, tools=FUNCTIONS, tool_choice=named, temperature=0,
                                 max_output_tokens=60) as stream:
        streamed = stream.get_final_response()
    assert [(o.type, o.name, o.arguments) for o in streamed.output] == [("function_call", call.name, call.arguments)]
    # The second turn sends only the call's output: the stored conversation supplies the rest.
    output = {"type": "function_call_output", "call_id": call.call_id, "output": "18 degrees, sunny"}
    second = client.responses.create(model=SERVED, previous_response_id=first.id, input=[output], tools=FUNCTIONS,
                                     tool_choice="none", max_output_tokens=8, temperature=0)
    history = [{"role": "user", "content": ask}, chat_first.choices[0].message.model_dump(exclude_none=True),
               {"role": "tool", "tool_call_id": chat_call.id, "content": "18 degrees, sunny"}]
    chat_second = _chat(client, history, tools=TOOLS, tool_choice="none", max_tokens=8, temperature=0)
    assert second.output_text == chat_second.choices[0].message.content
    assert second.usage.input_tokens == chat_second.usage.prompt_tokens
    assert second.previous_response_id == first.id
    # The same with the whole history as input items, no stored state: the same answer.
    items = [{"role": "user", "content": ask}, call.model_dump(exclude_none=True), output]
    again = client.responses.create(model=SERVED, input=items, tools=FUNCTIONS, tool_choice="none",
                                    max_output_tokens=8, temperature=0, store=False)
    assert again.output_text == second.output_text


def _first_completed(create):
    """A random model idles in JSON's whitespace now and then: the first seed whose output ends."""
    for seed in range(12):
        r = create(seed)
        if r.status == "completed":
            return seed, r
    raise AssertionError(f"no seed of 12 ended its output: {r.output_text!r}")


def test_json_schema_output_validates_and_parses(client):
    fmt = {"format": {"type": "json_schema", "name": "city", "schema": CITY, "strict": True}}
    seed, r = _first_completed(lambda seed: client.responses.create(
        model=SERVED, input="Name a city as JSON.", text=fmt, temperature=1.0, max_output_tokens=40,
        extra_body={"seed": seed}))
    jsonschema.validate(json.loads(r.output_text), CITY)
    chat = _chat(client, [{"role": "user", "content": "Name a city as JSON."}], temperature=1.0, max_tokens=40,
                 seed=seed, response_format={"type": "json_schema", "json_schema": {"name": "city", "schema": CITY,
                                                                                    "strict": True}})
    assert chat.choices[0].message.content == r.output_text
    # The client's parse() sends the pydantic model's own schema and reads the answer back into it.
    _, parsed = _first_completed(lambda seed: client.responses.parse(
        model=SERVED, input="Name a city as JSON.", text_format=City, temperature=1.0, max_output_tokens=40,
        extra_body={"seed": seed}))
    assert isinstance(parsed.output_parsed, City)


def test_stored_responses_get_delete_and_belong_to_their_key(client, server):
    # Two API workers: each request on a new connection may reach either; the store is shared.
    made = [client.responses.create(model=SERVED, input=f"Item {i}", max_output_tokens=3, temperature=0)
            for i in range(4)]
    for r in made:
        got = httpx.get(f"{server.url}/v1/responses/{r.id}", headers={"authorization": f"Bearer {MAIN_KEY}"})
        assert got.status_code == 200 and got.json()["output"][0]["content"][0]["text"] == r.output_text
    assert client.responses.retrieve(made[0].id).output_text == made[0].output_text
    other = httpx.get(f"{server.url}/v1/responses/{made[0].id}", headers={"authorization": f"Bearer {OTHER_KEY}"})
    assert other.status_code == 404 and other.json()["error"]["param"] == "response_id"
    client.responses.delete(made[0].id)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(made[0].id)
    with pytest.raises(openai.NotFoundError, match="previous response"):
        client.responses.create(model=SERVED, input="more", previous_response_id=made[0].id, max_output_tokens=2)
    unstored = client.responses.create(model=SERVED, input="x", store=False, max_output_tokens=2, temperature=0)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(unstored.id)
    metrics = httpx.get(server.url + "/metrics").text
    assert 'path="/v1/responses/{response_id}",status="404"' in metrics  # one series, not one per id


@pytest.mark.parametrize("fields,param,words", [
    ({"input": [{"type": "input_image", "image_url": "x"}]}, "input[0].type", "input_image"),
    ({"input": [{"role": "user", "content": [{"type": "input_file", "file_id": "f"}]}]}, "input[0].content[0]",
     "input_file"),
    ({"tools": [{"type": "web_search"}]}, "tools[0].type", "function tools"),
    ({"tools": FUNCTIONS, "tool_choice": {"type": "file_search"}}, "tool_choice.type", "function"),
    ({"text": {"format": {"type": "xml"}}}, "text.format.type", "json_schema"),
    ({"background": True}, "background", "not supported"),
    ({"reasoning": {"effort": "high"}}, "reasoning", "not supported"),
    ({"max_output_tokens": 0}, "max_output_tokens", ">= 1"),
    ({"max_output_tokens": 100000}, "max_output_tokens", "maximum context length"),
    # sampling values: the one validation every door shares (validation.py), its messages
    ({"temperature": 3.0}, "temperature", "[0.0, 2.0]"),
    ({"stop": ["x"] * 17}, "stop", "at most 16"),
    ({"top_k": -5}, "top_k", "2147483647"),
    ({"seed": 2**63}, "seed", "9223372036854775807"),
    ({"bogus": 1}, "bogus", "unknown field"),
])
def test_bad_requests_are_400s_naming_the_field(server, fields, param, words):
    body = {"model": SERVED, "input": "hi", "max_output_tokens": 4, **fields}
    r = httpx.post(server.url + "/v1/responses", json=body, headers={"authorization": f"Bearer {MAIN_KEY}"},
                   timeout=60)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == param and words in error["message"], error
