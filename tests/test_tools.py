"""Tool calling through the official ``openai`` client against the real server: a tiny random model
with a Hermes-style chat template (``--tool-call-parser hermes --enable-auto-tool-choice``) and SmolLM2.
Required and named calls are forced by the grammar, so even a random model's calls are well formed;
auto calls go through the Hermes parser (the model is steered into a ``<tool_call>`` block by a grammar)."""

from __future__ import annotations

import json

import httpx
import jsonschema
import openai
import pytest

from kvloom.core.config import DEFAULT_MODEL
from kvloom.frontends.tool_parsers import make_parser
from tests.server_utils import EngineServer

SERVED = "tiny-tools"
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city.",
    "parameters": {"type": "object", "properties": {"city": {"enum": ["Paris", "Tokyo"]},
                                                    "unit": {"enum": ["C", "F"]}},
               "required": ["city", "unit"], "additionalProperties": False}}}
TIME = {"type": "function", "function": {
    "name": "get_time", "parameters": {"type": "object", "properties": {"zone": {"enum": ["UTC", "CET"]}},
                                       "required": ["zone"], "additionalProperties": False}}}
TOOLS = [WEATHER, TIME]
SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]

HERMES_TEMPLATE = (
    # The tiny tokenizer spends a token per character: the tools are listed by name to fit 512 tokens.
    "{%- if tools %}<s>system: tools: {% for tool in tools %}{{ tool.function.name }} {% endfor %}</s>{%- endif %}"
    "{%- for m in messages %}"
    "{%- if m.role == 'assistant' and m.tool_calls %}<s>assistant:{{ m.content }}"
    "{%- for tc in m.tool_calls %}<tool_call>{\"name\": \"{{ tc.function.name }}\", \"arguments\": "
    "{{ tc.function.arguments | tojson }}}</tool_call>{%- endfor %}</s>"
    "{%- elif m.role == 'tool' %}<s>user: <tool_response>{{ m.content }}</tool_response></s>"
    "{%- else %}<s>{{ m.role }}: {{ m.content }}</s>{%- endif %}"
    "{%- endfor %}{%- if add_generation_prompt %}<s>assistant:{% endif %}"
)


@pytest.fixture(scope="module")
def tiny(tiny_llama, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("tools")
    (tmp / "hermes.jinja").write_text(HERMES_TEMPLATE)
    srv = EngineServer(["--model", str(tiny_llama), "--num-kv-blocks", "256", "--served-model-name", SERVED,
                        "--chat-template", str(tmp / "hermes.jinja"), "--tool-call-parser", "hermes",
                        "--enable-auto-tool-choice"], tmp)
    with srv:
        yield srv


@pytest.fixture(scope="module")
def client(tiny):
    return openai.OpenAI(base_url=tiny.url + "/v1", api_key="unused", max_retries=0, timeout=120)


def _valid(call) -> None:
    assert call.type == "function" and call.id.startswith("call_")
    jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])


def _streamed_calls(stream) -> tuple[str, dict[int, dict], str | None]:
    """Content, tool calls (by index, assembled from their deltas as the client libraries do) and the
    finish reason of a streamed reply."""
    content, calls, finish = "", {}, None
    for chunk in stream:
        for choice in chunk.choices:
            content += choice.delta.content or ""
            for tc in choice.delta.tool_calls or ():
                entry = calls.setdefault(tc.index, {"id": None, "name": "", "arguments": ""})
                entry["id"] = tc.id or entry["id"]
                entry["name"] += (tc.function.name or "") if tc.function else ""
                entry["arguments"] += (tc.function.arguments or "") if tc.function else ""
            finish = choice.finish_reason or finish
    return content, calls, finish


def test_named_tool_round_trip_with_a_hermes_template(client, tiny):
    named = {"type": "function", "function": {"name": "get_weather"}}
    first = client.chat.completions.create(model=SERVED, messages=ASK, tools=TOOLS, tool_choice=named,
                                           temperature=1.0, seed=4, max_tokens=60)
    (call,) = first.choices[0].message.tool_calls
    assert call.function.name == "get_weather" and first.choices[0].finish_reason == "stop"
    _valid(call)
    messages = ASK + [first.choices[0].message.model_dump(exclude_none=True),
                      {"role": "tool", "tool_call_id": call.id, "content": "18 degrees, sunny"}]
    final = client.chat.completions.create(model=SERVED, messages=messages, tools=TOOLS, tool_choice="none",
                                           max_tokens=8, temperature=0)
    assert final.choices[0].message.tool_calls is None and isinstance(final.choices[0].message.content, str)
    # The template rendered the tools, the call and its result into the prompt the model read.
    ids = httpx.post(tiny.url + "/tokenize", json={"messages": messages, "tools": TOOLS}).json()["tokens"]
    prompt = httpx.post(tiny.url + "/detokenize", json={"tokens": ids}).json()["prompt"]
    assert "tools: get_weather get_time" in prompt and "<tool_response>18 degrees, sunny</tool_response>" in prompt
    assert f'<tool_call>{{"name": "get_weather", "arguments": {call.function.arguments}' in prompt
    assert final.usage.prompt_tokens == len(ids)


def test_required_tool_call_streamed(client):
    stream = client.chat.completions.create(model=SERVED, messages=ASK, tools=TOOLS, tool_choice="required",
                                            parallel_tool_calls=False, temperature=1.0, seed=1, max_tokens=80,
                                            stream=True)
    content, calls, finish = _streamed_calls(stream)
    assert content == "" and finish == "tool_calls" and list(calls) == [0]
    assert calls[0]["id"].startswith("call_") and calls[0]["name"] in SCHEMAS
    jsonschema.validate(json.loads(calls[0]["arguments"]), SCHEMAS[calls[0]["name"]])


def test_auto_tool_calls_are_parsed_from_hermes_blocks(client):
    # A grammar stands in for a model trained to call tools: it writes content, then a <tool_call> block.
    grammar = ('root ::= "Let me check." "<tool_call>" "{\\"name\\": \\"get_time\\", \\"arguments\\": '
               '{\\"zone\\": \\"" ("UTC" | "CET") "\\"}}" "</tool_call>"')
    whole = client.chat.completions.create(model=SERVED, messages=ASK, tools=TOOLS, max_tokens=150,
                                           extra_body={"guided_grammar": grammar})
    message = whole.choices[0].message
    assert message.content == "Let me check." and whole.choices[0].finish_reason == "tool_calls"
    (call,) = message.tool_calls
    assert call.function.name == "get_time"
    _valid(call)
    content, calls, finish = _streamed_calls(client.chat.completions.create(
        model=SERVED, messages=ASK, tools=TOOLS, max_tokens=150, stream=True, extra_body={"guided_grammar": grammar}))
    assert content == "Let me check." and finish == "tool_calls"
    assert calls[0]["name"] == "get_time" and json.loads(calls[0]["arguments"])["zone"] in ("UTC", "CET")


def test_auto_without_a_call_is_plain_content(client):
    out = client.chat.completions.create(model=SERVED, messages=ASK, tools=TOOLS, max_tokens=30, temperature=0,
                                         extra_body={"guided_choice": ["It is sunny."]})
    assert out.choices[0].message.content == "It is sunny." and out.choices[0].message.tool_calls is None
    assert out.choices[0].finish_reason == "stop"


@pytest.mark.parametrize("fields,param,words", [
    ({"tool_choice": "required"}, "tool_choice", "needs tools"),
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice", "nope"),
    ({"tools": [{"type": "function", "function": {"name": "bad name!"}}]}, "tools[0].function.name", "letters"),
    ({"tools": TOOLS, "tool_choice": "sometimes"}, "tool_choice", "'required'"),
    ({"tools": TOOLS, "tool_choice": "required", "guided_regex": "a"}, "tool_choice", "cannot be combined"),
    ({"functions": [{"name": "f"}]}, "functions", "tools and tool_choice"),
])
def test_bad_tool_requests_are_400s(tiny, fields, param, words):
    body = {"model": SERVED, "messages": ASK, "max_tokens": 4, **fields}
    r = httpx.post(tiny.url + "/v1/chat/completions", json=body, timeout=60)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == param and words in error["message"], error


def test_parsers_read_hermes_and_llama3_calls_whole_and_streamed():
    text = 'Sure.\n<tool_call>\n{"name": "f", "arguments": {"a": 1}}\n</tool_call><tool_call>{"name": "g", ' \
           '"arguments": {}}</tool_call>'
    content, calls = make_parser("hermes").parse(text)
    assert content == "Sure." and [(c.name, json.loads(c.arguments)) for c in calls] == [("f", {"a": 1}), ("g", {})]
    parser = make_parser("hermes")
    streamed = "".join(parser.feed(text[i: i + 3]) for i in range(0, len(text), 3))
    assert streamed == "Sure.\n" and [c.name for c in parser.finish()[1]] == ["f", "g"]
    parser = make_parser("hermes")  # text that only looks like the start of a call is content after all
    assert "".join(parser.feed(c) for c in "a <tool b") + parser.finish()[0] == "a <tool b"
    llama = '<|python_tag|>{"name": "f", "parameters": {"a": 1}}; {"name": "g", "parameters": {}}'
    content, calls = make_parser("llama3_json").parse(llama)
    assert content is None and [(c.name, json.loads(c.arguments)) for c in calls] == [("f", {"a": 1}), ("g", {})]
    assert make_parser("llama3_json").parse("Hello {there")[1] == []


# --- SmolLM2 ----------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def smol(smollm2_path, tmp_path_factory):
    srv = EngineServer(["--max-model-len", "1024", "--num-kv-blocks", "256"], tmp_path_factory.mktemp("tools-smol"))
    with srv:
        yield srv


@pytest.mark.slow
def test_smollm2_named_tool_round_trip(smol):
    client = openai.OpenAI(base_url=smol.url + "/v1", api_key="unused", max_retries=0, timeout=120)
    ask = [{"role": "user", "content": "What is the weather in Tokyo, in Celsius?"}]
    first = client.chat.completions.create(model=DEFAULT_MODEL, messages=ask, tools=TOOLS, temperature=0,
                                           tool_choice={"type": "function", "function": {"name": "get_weather"}})
    (call,) = first.choices[0].message.tool_calls
    _valid(call)
    messages = ask + [first.choices[0].message.model_dump(exclude_none=True),
                      {"role": "tool", "tool_call_id": call.id, "content": "It is 21 degrees Celsius in Tokyo."}]
    final = client.chat.completions.create(model=DEFAULT_MODEL, messages=messages, max_tokens=24, temperature=0)
    answer = final.choices[0].message.content
    assert answer and "21" in answer, answer
    # Without the server's --enable-auto-tool-choice, 'auto' is refused rather than ignored.
    with pytest.raises(openai.BadRequestError, match="enable-auto-tool-choice"):
        client.chat.completions.create(model=DEFAULT_MODEL, messages=ask, tools=TOOLS, max_tokens=4)
