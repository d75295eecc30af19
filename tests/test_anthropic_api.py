"""Anthropic's Messages API through the official ``anthropic`` client against the real server (a tiny
random model with a Hermes-style chat template): each answer equals what /v1/chat/completions gives for
the same request (greedy), whole and streamed; a tool round trip; count_tokens; the same keys, quotas,
metrics and access log as the OpenAI routes, errors in Anthropic's shape."""

from __future__ import annotations

import json

import anthropic
import httpx
import jsonschema
import openai
import pytest

from tests.server_utils import EngineServer
from tests.test_tools import HERMES_TEMPLATE, TOOLS

SERVED = "tiny-anthropic"
MAIN_KEY, TIGHT_KEY = "main-secret-key", "tight-secret-key"
KEYS = [{"key": MAIN_KEY, "name": "main"}, {"key": TIGHT_KEY, "name": "tight", "requests_per_minute": 2}]
GREEDY = {"temperature": 0}  # the anthropic client has no temperature argument: it goes as extra_body
SYSTEM = "You answer briefly."
TURNS = [{"role": "user", "content": "Hello there"}, {"role": "assistant", "content": "Hi."},
         {"role": "user", "content": "What is the capital of France?"}]
CLAUDE_TOOLS = [{"name": t["function"]["name"], "description": t["function"].get("description", ""),
                 "input_schema": t["function"]["parameters"]} for t in TOOLS]
SCHEMAS = {t["name"]: t["input_schema"] for t in CLAUDE_TOOLS}


@pytest.fixture(scope="module")
def server(tiny_llama, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("anthropic")
    (tmp / "hermes.jinja").write_text(HERMES_TEMPLATE)
    srv = EngineServer(["--model", str(tiny_llama), "--num-kv-blocks", "256", "--served-model-name", SERVED,
                        "--chat-template", str(tmp / "hermes.jinja"), "--tool-call-parser", "hermes",
                        "--enable-auto-tool-choice", "--api-keys", json.dumps(KEYS)], tmp, api_key=MAIN_KEY)
    with srv:
        yield srv


@pytest.fixture(scope="module")
def claude(server):
    return anthropic.Anthropic(base_url=server.url, api_key=MAIN_KEY, max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def oai(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key=MAIN_KEY, max_retries=0, timeout=120)


def _chat(oai, messages, **kw):
    return oai.chat.completions.create(model=SERVED, messages=messages, temperature=0, **kw)


def test_messages_create_equals_chat(claude, oai):
    message = claude.messages.create(model=SERVED, system=SYSTEM, messages=TURNS, max_tokens=12, extra_body=GREEDY)
    chat = _chat(oai, [{"role": "system", "content": SYSTEM}, *TURNS], max_tokens=12)
    (block,) = message.content
    assert block.type == "text" and block.text == chat.choices[0].message.content
    assert message.role == "assistant" and message.model == SERVED and message.id.startswith("msg_")
    assert message.usage.input_tokens == chat.usage.prompt_tokens
    assert message.usage.output_tokens == chat.usage.completion_tokens == 12
    assert (message.stop_reason, chat.choices[0].finish_reason) == ("max_tokens", "length")
    assert claude.messages.count_tokens(model=SERVED, system=SYSTEM, messages=TURNS).input_tokens == \
        chat.usage.prompt_tokens


def _first_stop(text: str) -> str | None:
    """Two printable characters that first occur a little way into ``text``."""
    return next((text[i:i + 2] for i in range(2, len(text) - 2)
                 if text[i:i + 2].isprintable() and "\ufffd" not in text[i:i + 2] and text.index(text[i:i + 2]) == i),
                None)


def test_stop_sequences_end_the_message_where_chat_stops(claude, oai):
    # A random model's greedy text may be all partial characters: take the first prompt that gives letters.
    asks = [[{"role": "user", "content": c}] for c in ("Hello", "Numbers, please.", "The quick brown fox")]
    turns, text, stop = next((t, x, _first_stop(x)) for t in asks
                             if _first_stop(x := _chat(oai, t, max_tokens=16).choices[0].message.content))
    message = claude.messages.create(model=SERVED, messages=turns, max_tokens=16, stop_sequences=[stop],
                                     extra_body=GREEDY)
    assert message.stop_reason == "stop_sequence" and message.stop_sequence == stop
    assert message.content[0].text == text[:text.index(stop)]
    chat = _chat(oai, turns, max_tokens=16, stop=[stop])
    assert chat.choices[0].message.content == message.content[0].text


def test_streaming_equals_whole(claude, oai):
    whole = claude.messages.create(model=SERVED, system=SYSTEM, messages=TURNS, max_tokens=10, extra_body=GREEDY)
    with claude.messages.stream(model=SERVED, system=SYSTEM, messages=TURNS, max_tokens=10,
                                extra_body=GREEDY) as stream:
        pieces = list(stream.text_stream)
        final = stream.get_final_message()
    assert "".join(pieces) == final.content[0].text == whole.content[0].text
    assert final.stop_reason == "max_tokens" and final.usage.output_tokens == 10
    assert final.usage.input_tokens == whole.usage.input_tokens
    kinds = [e.type for e in claude.messages.create(model=SERVED, messages=TURNS, max_tokens=6, stream=True,
                                                    extra_body=GREEDY)]
    assert kinds[:2] == ["message_start", "content_block_start"] and "content_block_delta" in kinds
    assert kinds[-3:] == ["content_block_stop", "message_delta", "message_stop"]
    # The raw stream has Anthropic's named events, a ping among them.
    with httpx.stream("POST", claude.base_url.join("/v1/messages").__str__(), timeout=60,
                      headers={"x-api-key": MAIN_KEY}, json={"model": SERVED, "messages": TURNS, "max_tokens": 3,
                                                             "stream": True}) as r:
        names = [line.split(": ", 1)[1] for line in r.iter_lines() if line.startswith("event: ")]
    assert names[:2] == ["message_start", "ping"] and names[-1] == "message_stop"


def test_tool_round_trip_equals_chat(claude, oai, server):
    ask = [{"role": "user", "content": "What is the weather in Paris?"}]
    first = claude.messages.create(model=SERVED, messages=ask, tools=CLAUDE_TOOLS, max_tokens=60,
                                   tool_choice={"type": "tool", "name": "get_weather"}, extra_body=GREEDY)
    (use,) = first.content
    assert use.type == "tool_use" and use.name == "get_weather" and first.stop_reason == "tool_use"
    jsonschema.validate(use.input, SCHEMAS["get_weather"])
    chat_first = _chat(oai, ask, tools=TOOLS, max_tokens=60,
                       tool_choice={"type": "function", "function": {"name": "get_weather"}})
    (call,) = chat_first.choices[0].message.tool_calls
    assert json.loads(call.function.arguments) == use.input
    # The result goes back as a tool_result block; the answer equals chat's with the same history.
    history = ask + [{"role": "assistant", "content": [b.model_dump(exclude_none=True) for b in first.content]},
                     {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use.id,
                                                   "content": "18 degrees, sunny"}]}]
    final = claude.messages.create(model=SERVED, messages=history, tools=CLAUDE_TOOLS, max_tokens=8,
                                   tool_choice={"type": "none"}, extra_body=GREEDY)
    chat_history = ask + [chat_first.choices[0].message.model_dump(exclude_none=True),
                          {"role": "tool", "tool_call_id": call.id, "content": "18 degrees, sunny"}]
    chat_final = _chat(oai, chat_history, tools=TOOLS, tool_choice="none", max_tokens=8)
    assert final.content[0].text == chat_final.choices[0].message.content
    assert final.usage.input_tokens == chat_final.usage.prompt_tokens == claude.messages.count_tokens(
        model=SERVED, messages=history, tools=CLAUDE_TOOLS).input_tokens
    ids = httpx.post(server.url + "/tokenize", headers=server.headers,
                     json={"messages": chat_history, "tools": TOOLS}).json()["tokens"]
    prompt = httpx.post(server.url + "/detokenize", headers=server.headers, json={"tokens": ids}).json()["prompt"]
    assert "<tool_response>18 degrees, sunny</tool_response>" in prompt and len(ids) == final.usage.input_tokens


def test_required_tool_call_streamed(claude):
    with claude.messages.stream(model=SERVED, messages=[{"role": "user", "content": "Time?"}], tools=CLAUDE_TOOLS,
                                tool_choice={"type": "any", "disable_parallel_tool_use": True}, max_tokens=80,
                                extra_body=GREEDY) as stream:
        final = stream.get_final_message()
    (use,) = final.content
    assert use.type == "tool_use" and final.stop_reason == "tool_use" and use.id.startswith("toolu_")
    jsonschema.validate(use.input, SCHEMAS[use.name])


def test_named_tool_use_cut_by_max_tokens_is_text(claude, oai):
    # Chat completions answer it as a call holding the text so far (as vLLM); a tool_use block needs a
    # whole input object, so Messages answers that text as text, with stop_reason max_tokens.
    ask = [{"role": "user", "content": "What is the weather in Paris?"}]
    kw = dict(model=SERVED, messages=ask, tools=CLAUDE_TOOLS, max_tokens=4, extra_body=GREEDY,
              tool_choice={"type": "tool", "name": "get_weather"})
    (call,) = _chat(oai, ask, tools=TOOLS, max_tokens=4,
                    tool_choice={"type": "function", "function": {"name": "get_weather"}}).choices[0].message.tool_calls
    message = claude.messages.create(**kw)
    with claude.messages.stream(**kw) as stream:
        streamed = stream.get_final_message()
    for answer in (message, streamed):
        assert answer.stop_reason == "max_tokens"
        assert [(b.type, b.text) for b in answer.content] == [("text", call.function.arguments)]


def test_output_config_is_chats_json_schema_response_format(claude, oai):
    schema = {"type": "object", "properties": {"city": {"enum": ["Paris", "Rome"]}}, "required": ["city"],
              "additionalProperties": False}
    message = claude.messages.create(model=SERVED, messages=TURNS, max_tokens=12, extra_body=GREEDY,
                                     output_config={"format": {"type": "json_schema", "schema": schema}})
    fmt = {"type": "json_schema", "json_schema": {"name": "output", "schema": schema, "strict": True}}
    chat = _chat(oai, TURNS, max_tokens=12, response_format=fmt)
    # The grammar writes the JSON (a random model's greedy run then idles in whitespace): the same text.
    assert message.content[0].text == chat.choices[0].message.content and message.content[0].text.startswith("{")


def _post(server, body: dict, **headers) -> httpx.Response:
    return httpx.post(server.url + "/v1/messages", json=body, headers=headers, timeout=60)


def test_x_api_key_maps_onto_the_servers_keys(server):
    body = {"model": SERVED, "messages": TURNS, "max_tokens": 2}
    assert _post(server, body, **{"x-api-key": MAIN_KEY}).status_code == 200
    for headers in ({}, {"x-api-key": "wrong"}, {"x-api-key": MAIN_KEY, "authorization": f"Bearer {TIGHT_KEY}"}):
        r = _post(server, body, **headers)
        assert r.status_code == 401, r.text
        assert r.json()["type"] == "error" and r.json()["error"]["type"] == "authentication_error"
    # x-api-key works on the OpenAI routes too: one set of keys for every door
    r = httpx.post(server.url + "/v1/chat/completions", headers={"x-api-key": MAIN_KEY}, timeout=60,
                   json={"model": SERVED, "messages": TURNS, "max_tokens": 2})
    assert r.status_code == 200, r.text


def test_a_keys_quota_counts_requests_of_both_apis(server):
    chat = httpx.post(server.url + "/v1/chat/completions", headers={"authorization": f"Bearer {TIGHT_KEY}"},
                      json={"model": SERVED, "messages": TURNS, "max_tokens": 2}, timeout=60)
    assert chat.status_code == 200, chat.text
    body = {"model": SERVED, "messages": TURNS, "max_tokens": 2}
    assert _post(server, body, **{"x-api-key": TIGHT_KEY}).status_code == 200
    refused = _post(server, body, **{"x-api-key": TIGHT_KEY})  # the key's 2 requests per minute are spent
    assert refused.status_code == 429, refused.text
    assert refused.json()["error"]["type"] == "rate_limit_error" and int(refused.headers["retry-after"]) >= 1
    assert "requests_per_minute=2" in refused.json()["error"]["message"]
    # The main key is not affected, and the refusal is in the metrics and the access log like any other.
    assert _post(server, body, **{"x-api-key": MAIN_KEY}).status_code == 200
    metrics = httpx.get(server.url + "/metrics").text
    assert 'kvloom_http_requests_total{model="%s",path="/v1/messages",status="429"}' % SERVED in metrics
    assert 'kvloom_rejections_total{api_key="tight",model="%s",reason="rate_limited"}' % SERVED in metrics
    assert '"POST /v1/messages" 429' in server.log()


@pytest.mark.parametrize("fields,words", [
    ({"messages": [{"role": "tool", "content": "x"}]}, "messages[0].role='tool'"),
    ({"messages": [{"role": "user", "content": [{"type": "image", "source": {}}]}]}, "'image' is not supported"),
    ({"max_tokens": None}, "max_tokens"),
    ({"temperature": 1.5}, "temperature"),
    ({"bogus": 1}, "unknown field 'bogus'"),
    ({"mcp_servers": [{"url": "x"}]}, "'mcp_servers' is not supported"),
    ({"tools": [{"type": "web_search_20250305", "name": "web_search"}]}, "server tools"),
    ({"thinking": {"type": "enabled", "budget_tokens": 2048}}, "thinking.budget_tokens"),
    ({"tool_choice": {"type": "sometimes"}}, "tool_choice.type"),
    ({"model": "claude-nope"}, "claude-nope"),
])
def test_bad_requests_get_anthropics_error_shape(server, fields, words):
    body = {"model": SERVED, "messages": TURNS, "max_tokens": 4, **fields}
    body = {k: v for k, v in body.items() if v is not None}
    r = _post(server, body, **{"x-api-key": MAIN_KEY})
    assert r.status_code == (404 if "model" in fields else 400), r.text
    error = r.json()
    assert error["type"] == "error" and words in error["error"]["message"], error
    assert error["error"]["type"] == ("not_found_error" if "model" in fields else "invalid_request_error")


def test_the_client_raises_its_typed_errors(claude):
    with pytest.raises(anthropic.BadRequestError, match="budget_tokens"):
        claude.messages.create(model=SERVED, messages=TURNS, max_tokens=4,
                               thinking={"type": "enabled", "budget_tokens": 1024})
    with pytest.raises(anthropic.NotFoundError):
        claude.messages.create(model="claude-nope", messages=TURNS, max_tokens=4)
