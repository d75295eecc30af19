"""Reasoning output (``--reasoning-parser qwen3|deepseek_r1``): the splitter on its own, streamed at every
cut, and on the real server with a tiny random model whose output a regex forces to
``<think>...</think>answer``: reasoning_content and content in chat (whole and streamed deltas), reasoning
items in /v1/responses, thinking blocks in /v1/messages; ``enable_thinking`` reaching the template."""

from __future__ import annotations

import json
import re

import anthropic
import httpx
import openai
import pytest

from kvloom.frontends.chat_output import ChatReading
from kvloom.frontends.reasoning import ReasoningSplitter, split_reasoning, starts_in_reasoning
from kvloom.frontends.tool_parsers import ToolPlan
from tests.server_utils import EngineServer

SERVED = "tiny-thinker"
THINK_REGEX = r"<think>[a-z]{2,6}( [a-z]{2,6}){0,2}</think>[a-z]{2,8}"
FORCED = {"structured_outputs": {"regex": THINK_REGEX}}
ASK = [{"role": "user", "content": "Think, then answer."}]
# A thinking template: the generation prompt opens a <think> block unless enable_thinking is false.
TEMPLATE = ("{% for m in messages %}<s>{{ m['role'] }}: {{ m['content'] }}</s>{% endfor %}"
            "{% if add_generation_prompt %}<s>assistant:{% if enable_thinking is defined and not enable_thinking %}"
            "<think></think>{% else %}<think>{% endif %}{% endif %}")


# --- the splitter ------------------------------------------------------------------------------------
CASES = [
    ("<think>abc</think>answer", False, ("abc", "answer")),
    ("  <think>\nabc\n</think>\n\nans", False, ("\nabc\n", "\n\nans")),
    ("no block here", False, (None, "no block here")),
    ("a<think>b</think>c", False, (None, "a<think>b</think>c")),  # a block must open the output
    ("<think>cut short", False, ("cut short", "")),
    ("<thin", False, (None, "<thin")),
    ("abc</think>x", True, ("abc", "x")),  # the prompt opened the block
    ("<think>abc</think>x", True, ("abc", "x")),  # a model that writes <think> again
    ("never closed", True, ("never closed", "")),
    ("", True, ("", "")),
]


@pytest.mark.parametrize("text,in_reasoning,expected", CASES)
def test_split_whole_and_streamed_at_every_cut(text, in_reasoning, expected):
    assert split_reasoning(text, in_reasoning) == expected
    for size in (1, 2, 3, 5):
        splitter = ReasoningSplitter(in_reasoning)
        reasoning = content = ""
        for i in range(0, len(text), size):
            r, c = splitter.feed(text[i:i + size])
            reasoning, content = reasoning + r, content + c
        r, c = splitter.finish()
        assert ((reasoning + r) if splitter.reasoned else None, content + c) == expected


def test_where_reasoning_starts():
    assert starts_in_reasoning("deepseek_r1", "<s>assistant:", constrained=False)
    assert not starts_in_reasoning("deepseek_r1", "<s>assistant:", constrained=True)  # the grammar decides
    assert starts_in_reasoning("qwen3", "<|im_start|>assistant\n<think>\n", constrained=False)
    assert not starts_in_reasoning("qwen3", "assistant\n<think>\n\n</think>\n\n", constrained=False)
    assert not starts_in_reasoning("qwen3", "<|im_start|>assistant\n", constrained=False)


def test_tool_calls_are_read_from_the_answer_only():
    tool = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}
    reading = ChatReading(ToolPlan("auto", [tool]), "hermes", reasoning=True)
    text = '<think>maybe <tool_call>{"name": "g"}</tool_call></think>Sure.<tool_call>{"name": "f", "arguments": {}}' \
           '</tool_call>'
    reasoning, content, calls = reading.whole(text)
    assert reasoning == 'maybe <tool_call>{"name": "g"}</tool_call>' and content == "Sure."
    assert [c.name for c in calls] == ["f"]
    stream = reading.stream()
    pieces = [stream.feed(text[i:i + 4]) for i in range(0, len(text), 4)]
    more, rest, streamed_calls = stream.finish()
    assert "".join(r for r, _ in pieces) + more == reasoning and "".join(c for _, c in pieces) + rest == "Sure."
    assert [c.name for c in streamed_calls] == ["f"]


# --- the server ------------------------------------------------------------------------------------
@pytest.fixture(scope="module", params=["qwen3", "deepseek_r1"])
def server(request, tiny_llama, tmp_path_factory):
    tmp = tmp_path_factory.mktemp(f"reasoning-{request.param}")
    (tmp / "think.jinja").write_text(TEMPLATE)
    srv = EngineServer(["--model", str(tiny_llama), "--num-kv-blocks", "256", "--served-model-name", SERVED,
                        "--chat-template", str(tmp / "think.jinja"), "--reasoning-parser", request.param,
                        "--structured-outputs-in-reasoning"], tmp)  # the regex writes the think block too
    srv.parser = request.param
    with srv:
        yield srv


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=120)


def _forced(client):
    out = client.chat.completions.create(model=SERVED, messages=ASK, temperature=0, max_tokens=80, extra_body=FORCED)
    assert out.choices[0].finish_reason == "stop"
    return out.choices[0].message


def test_chat_splits_reasoning_whole_and_streamed(client):
    message = _forced(client)
    reasoning, content = message.reasoning_content, message.content
    assert re.fullmatch(r"[a-z]{2,6}( [a-z]{2,6}){0,2}", reasoning) and re.fullmatch(r"[a-z]{2,8}", content)
    assert re.fullmatch(THINK_REGEX, f"<think>{reasoning}</think>{content}")
    streamed = {"reasoning_content": "", "content": ""}
    for chunk in client.chat.completions.create(model=SERVED, messages=ASK, temperature=0, max_tokens=80,
                                                stream=True, extra_body=FORCED):
        delta = chunk.choices[0].delta
        streamed["reasoning_content"] += getattr(delta, "reasoning_content", None) or ""
        streamed["content"] += delta.content or ""
    assert streamed == {"reasoning_content": reasoning, "content": content}
    hidden = client.chat.completions.create(model=SERVED, messages=ASK, temperature=0, max_tokens=80,
                                            extra_body={**FORCED, "include_reasoning": False}).choices[0].message
    assert hidden.content == content and getattr(hidden, "reasoning_content", None) is None
    # The next turn may carry the reasoning back (templates that show it read reasoning_content).
    again = client.chat.completions.create(model=SERVED, temperature=0, max_tokens=2, messages=ASK + [
        message.model_dump(exclude_none=True), {"role": "user", "content": "And?"}])
    assert again.choices[0].finish_reason == "length"


def _stream(server, body: dict) -> list[dict]:
    with httpx.stream("POST", server.url + "/v1/chat/completions", json=body, timeout=120) as r:
        assert r.status_code == 200, r.read()
        return [json.loads(line[6:]) for line in r.iter_lines()
                if line.startswith("data: ") and line != "data: [DONE]"]


def test_reasoning_split_with_vllms_chat_fields(client, server):
    """One chat path serves the reasoning split and vLLM's other chat fields together: token ids, the
    rendered prompt, usage on every chunk and chunks joined by stream_interval, whole and streamed."""
    body = {"model": SERVED, "messages": ASK, "temperature": 0, "max_tokens": 80, **FORCED,
            "return_token_ids": True, "return_prompt_text": True}
    whole = httpx.post(server.url + "/v1/chat/completions", json=body, timeout=120).json()
    choice = whole["choices"][0]
    reasoning, content = choice["message"]["reasoning_content"], choice["message"]["content"]
    assert re.fullmatch(THINK_REGEX, f"<think>{reasoning}</think>{content}")
    assert len(choice["token_ids"]) == whole["usage"]["completion_tokens"]
    assert whole["prompt_text"].endswith("<think>") and whole["prompt_token_ids"]
    chunks = _stream(server, {**body, "stream": True, "stream_interval": 2,
                              "stream_options": {"include_usage": True, "continuous_usage_stats": True}})
    assert chunks[0]["prompt_text"] == whole["prompt_text"]
    assert chunks[0]["prompt_token_ids"] == whole["prompt_token_ids"]
    deltas = [c["choices"][0] for c in chunks if c["choices"]]
    assert "".join(d["delta"].get("reasoning_content") or "" for d in deltas) == reasoning
    assert "".join(d["delta"].get("content") or "" for d in deltas) == content
    assert [t for d in deltas for t in d.get("token_ids") or ()] == choice["token_ids"]
    done = [c["usage"]["completion_tokens"] for c in chunks]  # every chunk has usage, the last the total
    assert done == sorted(done) and done[-1] == whole["usage"]["completion_tokens"]
    # reasoning_effort "none" turns thinking off in the template: under qwen3 the output is the answer.
    off = client.chat.completions.create(model=SERVED, messages=ASK, temperature=0, max_tokens=6,
                                         reasoning_effort="none").choices[0].message
    if server.parser == "qwen3":
        assert off.content and getattr(off, "reasoning_content", None) is None
    else:
        assert off.content is None and off.reasoning_content


def test_enable_thinking_reaches_the_template(client, server):
    def message(**kw):
        return client.chat.completions.create(model=SERVED, messages=ASK, temperature=0, max_tokens=6,
                                              **kw).choices[0].message

    thinking, plain = message(), message(extra_body={"chat_template_kwargs": {"enable_thinking": False}})
    # An unconstrained random model never closes the block the prompt opened: all of it is reasoning.
    assert thinking.content is None and thinking.reasoning_content
    if server.parser == "qwen3":  # thinking off: the prompt's block is closed, the output is the answer
        assert plain.content and getattr(plain, "reasoning_content", None) is None
    else:  # DeepSeek-R1's output is reasoning until </think> whatever the prompt
        assert plain.content is None and plain.reasoning_content


def test_responses_reasoning_item(client):
    whole = _forced(client)
    r = client.responses.create(model=SERVED, input=ASK, temperature=0, max_output_tokens=80, extra_body=FORCED)
    assert [o.type for o in r.output] == ["reasoning", "message"] and r.status == "completed"
    assert r.output[0].content[0].text == whole.reasoning_content and r.output_text == whole.content
    assert r.usage.output_tokens_details.reasoning_tokens > 0
    with client.responses.stream(model=SERVED, input=ASK, temperature=0, max_output_tokens=80,
                                 extra_body=FORCED) as stream:
        kinds = [e.type for e in stream]
        final = stream.get_final_response()
    assert kinds.index("response.reasoning_text.delta") < kinds.index("response.output_text.delta")
    assert final.output[0].content[0].text == whole.reasoning_content and final.output_text == whole.content


def test_anthropic_thinking_blocks(client, server):
    claude = anthropic.Anthropic(base_url=server.url, api_key="unused", max_retries=0, timeout=120)
    chat = client.chat.completions.create(model=SERVED, messages=ASK, temperature=0, max_tokens=6).choices[0].message
    message = claude.messages.create(model=SERVED, messages=ASK, max_tokens=6, thinking={"type": "adaptive"},
                                     extra_body={"temperature": 0})
    assert [(b.type, b.thinking) for b in message.content] == [("thinking", chat.reasoning_content)]
    with claude.messages.stream(model=SERVED, messages=ASK, max_tokens=6, thinking={"type": "adaptive"},
                                extra_body={"temperature": 0}) as stream:
        deltas = [e.delta.thinking for e in stream if e.type == "content_block_delta"]
        final = stream.get_final_message()
    assert "".join(deltas) == final.content[0].thinking == chat.reasoning_content
    off = claude.messages.create(model=SERVED, messages=ASK, max_tokens=6, thinking={"type": "disabled"},
                                 extra_body={"temperature": 0})
    kinds = [b.type for b in off.content]
    assert kinds == (["text"] if server.parser == "qwen3" else ["thinking"]), json.dumps(off.model_dump())
    hidden = claude.messages.create(model=SERVED, messages=ASK, max_tokens=6, extra_body={"temperature": 0},
                                    thinking={"type": "adaptive", "display": "omitted"})
    assert hidden.content == []
