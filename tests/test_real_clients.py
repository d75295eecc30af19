"""What clients nobody on the team wrote send and expect, on the real server (tiny random model whose
tokenizer adds a BOS token): guidellm's streams with usage on every chunk, vLLM's request fields that
kvloom honours (and an answer for every one it takes), named tool calls cut short by max_tokens through
the ``openai`` client, and lm-eval's /tokenizer_info."""

from __future__ import annotations

import json
import re
from pathlib import Path

import httpx
import openai
import pytest

from tests.conftest import make_tiny_model
from tests.server_utils import REPO_ROOT, EngineServer

SERVED = "tiny-clients"
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "parameters": {"type": "object", "properties": {"city": {"enum": ["Paris", "Tokyo"]},
                                                                          "unit": {"enum": ["C", "F"]}},
                                          "required": ["city", "unit"], "additionalProperties": False}}}
NAMED = {"type": "function", "function": {"name": "get_weather"}}
ASK = [{"role": "user", "content": "weather in Paris?"}]


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> Path:
    """The tiny Llama, its tokenizer adding ``<s>`` before a prompt (as Llama's do), so that
    add_special_tokens has something to add."""
    from tokenizers import Tokenizer, processors

    path = make_tiny_model(tmp_path_factory.mktemp("tiny-bos"), "llama")
    tok = Tokenizer.from_file(str(path / "tokenizer.json"))
    tok.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 1)])
    tok.save(str(path / "tokenizer.json"))
    return path


@pytest.fixture(scope="module")
def server(model, tmp_path_factory):
    srv = EngineServer(["--model", str(model), "--num-kv-blocks", "256", "--served-model-name", SERVED],
                       tmp_path_factory.mktemp("real-clients"))
    with srv:
        yield srv


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=120)


def post(server, path: str, body: dict) -> httpx.Response:
    return httpx.post(server.url + path, json=body, timeout=120)


def events(server, path: str, body: dict) -> list[dict]:
    """A streamed response's SSE payloads, [DONE] left out."""
    out = []
    with httpx.stream("POST", server.url + path, json=body, timeout=120) as r:
        assert r.status_code == 200, r.read()
        for line in r.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                out.append(json.loads(line[6:]))
    return out


def count_tokens(server, **body) -> int:
    return post(server, "/tokenize", {"model": SERVED, **body}).json()["count"]


# --- guidellm's request shape: usage on every chunk (stream_options.continuous_usage_stats) -----------
GUIDELLM_OPTIONS = {"stream": True, "stream_options": {"include_usage": True, "continuous_usage_stats": True},
                    "max_tokens": 6, "stop": None, "ignore_eos": True}


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_guidellm_streams_get_usage_on_every_chunk(server, path):
    if path == "/v1/completions":
        # greedy: this random model's tokens are often text-less (held back), and this prompt's are not all
        body = {"model": SERVED, "prompt": "The quick brown fox", **GUIDELLM_OPTIONS, "temperature": 0}
        prompt = count_tokens(server, prompt="The quick brown fox")
    else:  # guidellm's chat requests say max_completion_tokens, and send content as text parts
        messages = [{"role": "user", "content": [{"type": "text", "text": "The quick brown fox"}]}]
        options = {k: v for k, v in GUIDELLM_OPTIONS.items() if k != "max_tokens"}
        body = {"model": SERVED, "messages": messages, "max_completion_tokens": 6, **options, "temperature": 0}
        prompt = count_tokens(server, messages=[{"role": "user", "content": "The quick brown fox"}])
    chunks = events(server, path, body)
    with_choices = [c for c in chunks if c["choices"]]
    assert len(with_choices) >= 2 and all(c["usage"] is not None for c in with_choices)
    done = [c["usage"]["completion_tokens"] for c in with_choices]
    assert done == sorted(done) and done[0] < done[-1] == 6  # it counts up, chunk by chunk
    assert all(c["usage"]["prompt_tokens"] == prompt for c in with_choices)
    assert all(c["usage"]["total_tokens"] == prompt + c["usage"]["completion_tokens"] for c in with_choices)
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] == 6  # the final usage chunk
    # Without it, usage comes once, at the end.
    body["stream_options"] = {"include_usage": True}
    plain = events(server, path, body)
    assert all(c["usage"] is None for c in plain if c["choices"]) and plain[-1]["usage"]["completion_tokens"] == 6


# --- vLLM's request fields that kvloom honours ------------------------------------------------------
def test_vllm_nullable_fields_take_null_and_request_id_names_the_response(server):
    nulls = {"top_k": None, "min_p": None, "repetition_penalty": None, "stop_token_ids": None, "n": None,
             "stream": None, "echo": None}
    r = post(server, "/v1/completions", {"prompt": "hi", "max_tokens": 2, "request_id": "mine-42", **nulls})
    assert r.status_code == 200, r.text
    assert r.json()["id"] == "mine-42" and len(r.json()["choices"]) == 1
    r = post(server, "/v1/chat/completions", {"messages": ASK, "max_tokens": 2, "logprobs": None, "n": None,
                                              "include_reasoning": True, "session_id": "s-1"})
    assert r.status_code == 200, r.text


def test_truncate_prompt_tokens_and_add_special_tokens(server):
    text = "Paris is the capital of France. Berlin is the capital of Germany."
    full = count_tokens(server, prompt=text)
    plain = count_tokens(server, prompt=text, add_special_tokens=False)
    assert full == plain + 1  # this tokenizer adds <s>

    def usage(path: str, **body) -> int:
        r = post(server, path, {"max_tokens": 1, **body})
        assert r.status_code == 200, r.text
        return r.json()["usage"]["prompt_tokens"]

    assert usage("/v1/completions", prompt=text) == full
    assert usage("/v1/completions", prompt=text, add_special_tokens=False) == plain
    assert usage("/v1/completions", prompt=text, truncate_prompt_tokens=5) == 5
    assert usage("/v1/completions", prompt=text, truncate_prompt_tokens=-1) == full  # fits max_model_len
    # Which five: the last (left side cut, vLLM's default) or the first, seen through echo.
    ids = post(server, "/tokenize", {"prompt": text}).json()["tokens"]
    for side, kept in (("left", ids[-5:]), ("right", ids[:5])):
        r = post(server, "/v1/completions", {"prompt": text, "max_tokens": 0, "echo": True, "logprobs": 0,
                                             "truncate_prompt_tokens": 5, "truncation_side": side,
                                             "return_tokens_as_token_ids": True})
        assert r.json()["choices"][0]["logprobs"]["tokens"] == [f"token_id:{t}" for t in kept]
    chat = count_tokens(server, messages=ASK)
    assert usage("/v1/chat/completions", messages=ASK) == chat
    assert usage("/v1/chat/completions", messages=ASK, add_special_tokens=True) == chat + 1
    r = post(server, "/v1/completions", {"prompt": text, "max_tokens": 1, "truncate_prompt_tokens": 0})
    assert r.status_code == 400 and r.json()["error"]["param"] == "truncate_prompt_tokens"


def test_return_tokens_as_token_ids_names_logprob_tokens_by_id(server):
    r = post(server, "/v1/completions", {"prompt": "hi", "max_tokens": 3, "logprobs": 2,
                                         "return_tokens_as_token_ids": True})
    lp = r.json()["choices"][0]["logprobs"]
    assert len(lp["tokens"]) == 3 and all(re.fullmatch(r"token_id:\d+", t) for t in lp["tokens"])
    assert all(re.fullmatch(r"token_id:\d+", t) for top in lp["top_logprobs"] for t in top)
    r = post(server, "/v1/chat/completions", {"messages": ASK, "max_tokens": 2, "logprobs": True, "top_logprobs": 1,
                                              "return_tokens_as_token_ids": True})
    content = r.json()["choices"][0]["logprobs"]["content"]
    assert all(re.fullmatch(r"token_id:\d+", e["token"]) for e in content)


def test_chat_echo_documents_reasoning_effort_and_prompt_logprobs(server):
    start = [*ASK, {"role": "assistant", "content": "It is"}]
    for stream in (False, True):
        body = {"messages": start, "max_tokens": 3, "echo": True, "add_generation_prompt": False,
                "continue_final_message": True, "stream": stream}
        if stream:
            text = "".join(c["choices"][0]["delta"].get("content") or "" for c in events(server, "/v1/chat/completions",
                                                                                          body) if c["choices"])
        else:
            text = post(server, "/v1/chat/completions", body).json()["choices"][0]["message"]["content"]
        assert text.startswith("It is") and len(text) > len("It is")
    # documents and reasoning_effort reach the chat template as variables, as in vLLM
    template = "{{ documents[0].text }}|{{ reasoning_effort }}|{{ enable_thinking }}|{{ messages[0].content }}"
    r = post(server, "/v1/chat/completions", {"messages": ASK, "max_tokens": 1, "chat_template": template,
                                              "documents": [{"title": "t", "text": "Paris is sunny"}],
                                              "reasoning_effort": "low"})
    expected = count_tokens(server, prompt="Paris is sunny|low|True|weather in Paris?", add_special_tokens=False)
    assert r.json()["usage"]["prompt_tokens"] == expected
    # prompt_logprobs on chat: vLLM's response field, the same numbers the completions API gives the prompt
    ids = post(server, "/tokenize", {"messages": ASK}).json()["tokens"]
    chat = post(server, "/v1/chat/completions", {"messages": ASK, "max_tokens": 1, "prompt_logprobs": 2}).json()
    completion = post(server, "/v1/completions", {"prompt": ids, "max_tokens": 1, "prompt_logprobs": 2}).json()
    assert chat["prompt_logprobs"][0] is None and len(chat["prompt_logprobs"]) == len(ids)
    assert chat["prompt_logprobs"] == completion["choices"][0]["prompt_logprobs"]
    r = post(server, "/v1/chat/completions", {"messages": ASK, "max_tokens": 1, "prompt_logprobs": 2, "stream": True})
    assert r.status_code == 400 and r.json()["error"]["param"] == "prompt_logprobs"


def test_return_token_ids_stream_interval_and_prompt_text(server):
    prompt_ids = post(server, "/tokenize", {"prompt": "The quick brown fox"}).json()["tokens"]
    base = {"prompt": "The quick brown fox", "max_tokens": 7, "ignore_eos": True, "temperature": 0,
            "return_token_ids": True}
    whole = post(server, "/v1/completions", base).json()["choices"][0]
    assert whole["prompt_token_ids"] == prompt_ids and len(whole["token_ids"]) == 7
    chunks = [c["choices"][0] for c in events(server, "/v1/completions", {**base, "stream": True, "stream_interval": 3})
              if c["choices"]]
    assert chunks[0]["prompt_token_ids"] == prompt_ids and all(c["prompt_token_ids"] is None for c in chunks[1:])
    assert [t for c in chunks for t in c["token_ids"]] == whole["token_ids"]
    assert all(len(c["token_ids"]) >= 3 for c in chunks[1:-1]) and len(chunks) < 7  # joined, 3 tokens at least
    # chat: the prompt's tokens and the rendered chat, whole and streamed
    chat_ids = post(server, "/tokenize", {"messages": ASK}).json()["tokens"]
    rendered = post(server, "/detokenize", {"tokens": chat_ids}).json()["prompt"]
    body = {"messages": ASK, "max_tokens": 5, "ignore_eos": True, "temperature": 0, "return_token_ids": True,
            "return_prompt_text": True}
    reply = post(server, "/v1/chat/completions", body).json()
    assert reply["prompt_token_ids"] == chat_ids and reply["prompt_text"] == rendered
    assert len(reply["choices"][0]["token_ids"]) == reply["usage"]["completion_tokens"] == 5
    streamed = events(server, "/v1/chat/completions", {**body, "stream": True})
    assert streamed[0]["prompt_token_ids"] == chat_ids and streamed[0]["prompt_text"] == rendered
    assert [t for c in streamed if c["choices"] for t in c["choices"][0]["token_ids"] or ()] == \
        reply["choices"][0]["token_ids"]


# --- named tool calls cut short by max_tokens ---------------------------------------------------------
def test_named_tool_call_cut_by_max_tokens_is_still_a_tool_call(client):
    kw = dict(model=SERVED, messages=ASK, tools=[WEATHER], tool_choice=NAMED, max_tokens=4, temperature=0)
    whole = client.chat.completions.create(**kw)
    choice = whole.choices[0]
    assert choice.finish_reason == "length" and choice.message.content is None
    (call,) = choice.message.tool_calls  # client code doing message.tool_calls[0] must not crash
    assert call.type == "function" and call.function.name == "get_weather" and call.id.startswith("call_")
    assert call.function.arguments.startswith("{") and whole.usage.completion_tokens == 4
    with pytest.raises(ValueError):
        json.loads(call.function.arguments)  # the raw text so far: not a whole call
    # Streamed: tool-call deltas as the tokens come (not one content delta at the end), then "length".
    pieces, names, ids, finish = [], [], set(), None
    for chunk in client.chat.completions.create(**kw, stream=True):
        for c in chunk.choices:
            assert not c.delta.content
            for tc in c.delta.tool_calls or ():
                assert tc.index == 0
                ids.add(tc.id) if tc.id else None
                names.append(tc.function.name) if tc.function.name else None
                pieces.append(tc.function.arguments or "")
            finish = c.finish_reason or finish
    assert finish == "length" and names == ["get_weather"] and len(ids) == 1
    assert len([p for p in pieces if p]) >= 2 and "".join(pieces) == call.function.arguments
    # A call that fits still ends with "stop" and parses.
    done = client.chat.completions.create(**{**kw, "max_tokens": 200})
    assert done.choices[0].finish_reason == "stop"
    json.loads(done.choices[0].message.tool_calls[0].function.arguments)


# --- lm-eval's tokenizer_backend=remote ------------------------------------------------------------
def test_tokenizer_info_in_vllms_shape(server, model):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(model))
    info = httpx.get(server.url + "/tokenizer_info", timeout=30).json()
    assert info["tokenizer_class"] and info["chat_template"] == tok.chat_template
    assert (info["eos_token"], info["bos_token"], info["pad_token"]) == ("</s>", "<s>", "<pad>")
    assert not any(k.endswith("_file") or k == "name_or_path" for k in info)  # no server paths
    # What lm-eval's RemoteTokenizer does with it: the special tokens' ids through /tokenize.
    eos = post(server, "/tokenize", {"prompt": info["eos_token"], "add_special_tokens": False}).json()["tokens"]
    assert eos == [tok.eos_token_id]


# --- the audit: every field of vLLM's request models has an answer -----------------------------------
# vLLM's CompletionRequest and ChatCompletionRequest fields (vllm/entrypoints/openai/completion/protocol.py
# and chat_completion/protocol.py, 2026), with those of releases that still had guided_* and best_of.
VLLM_SHARED = """model frequency_penalty logit_bias logprobs max_tokens n presence_penalty seed stop stream
stream_options temperature top_p user use_beam_search top_k min_p repetition_penalty watermarking length_penalty
stop_token_ids include_stop_str_in_output ignore_eos min_tokens skip_special_tokens spaces_between_special_tokens
truncate_prompt_tokens truncation_side allowed_token_ids prompt_logprobs logprob_token_ids bad_words add_special_tokens
response_format structured_outputs priority request_id session_id return_tokens_as_token_ids return_token_ids
routed_experts_prompt_start return_token_offsets return_mm_kwargs cache_salt kv_transfer_params ec_transfer_params
vllm_xargs repetition_detection thinking_token_budget stream_interval echo best_of guided_json guided_regex
guided_choice guided_grammar guided_decoding_backend guided_whitespace_pattern structural_tag logits_processors""".split()
VLLM_COMPLETION = VLLM_SHARED + "prompt suffix prompt_embeds".split()
VLLM_CHAT = VLLM_SHARED + """messages top_logprobs max_completion_tokens tools tool_choice reasoning_effort
include_reasoning parallel_tool_calls continue_final_message add_generation_prompt documents chat_template
chat_template_kwargs media_io_kwargs mm_processor_kwargs return_prompt_text""".split()


def test_every_vllm_request_field_has_an_answer_and_a_line_in_the_docs():
    from kvloom.frontends import openai_protocol as api
    from kvloom.frontends.request_fields import CHAT_RULES, COMPLETION_RULES, answer

    docs = (REPO_ROOT / "docs" / "compat.md").read_text()
    for fields, struct, rules in ((VLLM_COMPLETION, api.CompletionRequest, COMPLETION_RULES),
                                  (VLLM_CHAT, api.ChatCompletionRequest, CHAT_RULES)):
        unanswered = [f for f in fields if answer(f, struct, rules) == "unknown"]
        assert unanswered == [], unanswered  # a field vLLM takes is never "unknown" here
        undocumented = [f for f in fields if f"`{f}`" not in docs]
        assert undocumented == [], undocumented
    for option in ("include_usage", "continuous_usage_stats"):
        assert option in api.StreamOptions.__struct_fields__ and f"`stream_options.{option}`" in docs
