"""Switching from vLLM by changing a base_url: a vLLM launch line starts the server, and vLLM's extra
endpoints and parameters behave as vLLM's do (/tokenize, /detokenize, 20 logprobs, chat templates,
batched prompts). Refused fields are in test_compat_server.py."""

from __future__ import annotations

import json

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from kvloom.cli.main import build_parser, config_from_args, server_config_from_args
from kvloom.cli.vllm_flags import apply_vllm_flags
from tests.server_utils import EngineServer, free_port

SERVED = "my-vllm-model"
API_KEY = "k-123"
TEMPLATE = ("{% for m in messages %}[{{ m['role'] }}] {{ m['content'] }}\n{% endfor %}"
            "{% if add_generation_prompt %}[assistant] {% endif %}")


def vllm_line(model: str, port: int, template_file: str) -> list[str]:
    return ["--model", model, "--served-model-name", SERVED, "--enable-prefix-caching", "--max-num-seqs", "64",
            "--max-model-len", "384", "--max-num-batched-tokens", "512", "--gpu-memory-utilization", "0.5",
            "--dtype", "float32", "--seed", "7", "--host", "127.0.0.1", "--port", str(port), "--api-key", API_KEY,
            "--chat-template", template_file, "--disable-log-requests", "--disable-log-stats", "--num-kv-blocks", "128"]


def test_a_vllm_launch_line_parses_to_kvloom_options(tmp_path):
    args = build_parser().parse_args(vllm_line("m", 8123, "t.jinja"))
    engine, server = apply_vllm_flags(args, config_from_args(args)), server_config_from_args(args)
    assert engine.plugins == ["prefix_cache"]
    assert (engine.max_num_seqs, engine.max_model_len, engine.max_num_batched_tokens) == (64, 384, 512)
    assert (engine.gpu_memory_utilization, engine.dtype, engine.seed) == (0.5, "float32", 7)
    assert (server.served_model_name, server.port, server.api_key, server.chat_template) == (SERVED, 8123, API_KEY,
                                                                                             "t.jinja")
    assert server.log_requests is False and engine.stats_log_interval == 0
    assert server_config_from_args(build_parser().parse_args(["--api-server-count", "3"])).api_workers == 3
    # --enable-prefix-caching next to --plugins prefix_cache does not load it twice; --no- removes it.
    args = build_parser().parse_args(["--plugins", "prefix_cache", "--enable-prefix-caching"])
    assert apply_vllm_flags(args, config_from_args(args)).plugins == ["prefix_cache"]
    args = build_parser().parse_args(["--plugins", "prefix_cache", "--no-enable-prefix-caching"])
    assert apply_vllm_flags(args, config_from_args(args)).plugins == []


def test_a_chat_template_that_is_neither_file_nor_template_fails_at_once(tiny_llama, capsys):
    from kvloom.cli.main import main

    assert main(["--model", str(tiny_llama), "--chat-template", "no-such.jinja"]) == 2
    assert "chat_template='no-such.jinja' is neither a file nor a Jinja template" in capsys.readouterr().err


@pytest.fixture(scope="module")
def server(tiny_llama, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("vllm-line")
    template = tmp / "template.jinja"
    template.write_text(TEMPLATE)
    port = free_port()
    srv = EngineServer(vllm_line(str(tiny_llama), port, str(template)), tmp, port=port, api_key=API_KEY)
    with srv:
        yield srv


@pytest.fixture(scope="module")
def tokenizer(tiny_llama):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(tiny_llama))


@pytest.fixture
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key=API_KEY, max_retries=0, timeout=60)


def post(server, path: str, body: dict) -> httpx.Response:
    return httpx.post(server.url + path, headers=server.headers, content=json.dumps(body).encode(), timeout=60)


CHAT = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}


def render(messages, add_generation_prompt=True) -> str:
    import jinja2

    return jinja2.Template(TEMPLATE).render(messages=messages, add_generation_prompt=add_generation_prompt)


def test_the_vllm_launch_line_serves(server, client):
    assert [m.id for m in client.models.list().data] == [SERVED]
    assert httpx.get(server.url + "/v1/models", headers=server.headers).json()["data"][0]["max_model_len"] == 384
    prompt = "The quick brown fox jumps over the lazy dog. " * 6
    for _ in range(2):
        client.completions.create(model=SERVED, prompt=prompt, max_tokens=2)
    text = httpx.get(server.url + "/metrics").text
    samples = {s.name: s.value for fam in text_string_to_metric_families(text) for s in fam.samples}
    assert samples["kvloom_prefix_cache_hits_total"] > 0  # --enable-prefix-caching loaded the plugin
    log = server.log()
    assert "kvloom.access" not in log and "Engine stats:" not in log  # --disable-log-requests/-stats


# --- /tokenize and /detokenize ---------------------------------------------------------------------
def test_tokenize_round_trips(server, tokenizer):
    text = "Paris is the capital of France. café 東京"
    r = post(server, "/tokenize", {"model": SERVED, "prompt": text, "add_special_tokens": False,
                                   "return_token_strs": True})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["tokens"] == tokenizer.encode(text, add_special_tokens=False)
    assert body["count"] == len(body["tokens"]) and body["max_model_len"] == 384
    assert body["token_strs"] == tokenizer.convert_ids_to_tokens(body["tokens"])
    back = post(server, "/detokenize", {"model": SERVED, "tokens": body["tokens"]})
    assert back.status_code == 200 and back.json() == {"prompt": text}
    default = post(server, "/tokenize", {"prompt": text}).json()
    assert default["tokens"] == tokenizer.encode(text)  # add_special_tokens defaults to true, as in vLLM


def test_tokenize_errors(server):
    assert post(server, "/detokenize", {"tokens": [1, 99999]}).json()["error"]["param"] == "tokens"
    assert post(server, "/tokenize", {"prompt": "a", "messages": CHAT["messages"]}).status_code == 400
    assert post(server, "/tokenize", {"prompt": "a", "model": "other"}).status_code == 404
    assert httpx.post(server.url + "/tokenize", json={"prompt": "a"}).status_code == 401  # the key guards it


# --- chat templates --------------------------------------------------------------------------------
def test_the_servers_chat_template_file_renders_chats(server, client, tokenizer):
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hi"}]
    expected = tokenizer.encode(render(messages), add_special_tokens=False)
    assert post(server, "/tokenize", {"messages": messages}).json()["tokens"] == expected
    out = client.chat.completions.create(model=SERVED, messages=messages, max_tokens=2)
    assert out.usage.prompt_tokens == len(expected)


def test_a_requests_chat_template_wins(server, client, tokenizer):
    own = "{% for m in messages %}<<{{ m['content'] }}>>{% endfor %}"
    messages = [{"role": "user", "content": "hello"}]
    expected = tokenizer.encode("<<hello>>", add_special_tokens=False)
    assert post(server, "/tokenize", {"messages": messages, "chat_template": own}).json()["tokens"] == expected
    out = client.chat.completions.create(model=SERVED, messages=messages, max_tokens=2,
                                         extra_body={"chat_template": own})
    assert out.usage.prompt_tokens == len(expected)
    r = post(server, "/v1/chat/completions", {**CHAT, "chat_template": "{% for %}"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "chat_template"


def test_add_generation_prompt_and_continue_final_message(server, client, tokenizer):
    messages = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "The answer is"}]
    plain = post(server, "/tokenize", {"messages": messages, "add_generation_prompt": False}).json()["tokens"]
    assert plain == tokenizer.encode(render(messages, add_generation_prompt=False), add_special_tokens=False)
    cont = post(server, "/tokenize", {"messages": messages, "add_generation_prompt": False,
                                      "continue_final_message": True}).json()["tokens"]
    # The last message stays open: the rendering stops right after its content.
    assert cont == tokenizer.encode("[user] hi\n[assistant] The answer is", add_special_tokens=False)
    out = client.chat.completions.create(model=SERVED, messages=messages, max_tokens=2,
                                         extra_body={"add_generation_prompt": False, "continue_final_message": True})
    assert out.usage.prompt_tokens == len(cont)
    both = post(server, "/v1/chat/completions", {**CHAT, "messages": messages, "continue_final_message": True})
    assert both.status_code == 400 and both.json()["error"]["param"] == "continue_final_message"


# --- logprobs and batched prompts ------------------------------------------------------------------
def test_twenty_logprobs(client):
    out = client.completions.create(model=SERVED, prompt="Hello", max_tokens=3, logprobs=20, temperature=1.0,
                                    seed=3, extra_body={"ignore_eos": True})
    tops = out.choices[0].logprobs.top_logprobs
    # Keys are token texts: distinct tokens that decode alike (partial characters) share one key.
    assert len(tops) == 3 and all(5 < len(t) <= 20 for t in tops)
    chat = client.chat.completions.create(model=SERVED, messages=CHAT["messages"], max_tokens=3, logprobs=True,
                                          top_logprobs=20, extra_body={"ignore_eos": True})
    assert all(len(t.top_logprobs) == 20 for t in chat.choices[0].logprobs.content)
    with pytest.raises(openai.BadRequestError, match="20"):
        client.completions.create(model=SERVED, prompt="Hello", max_tokens=1, logprobs=21)


def test_completions_take_lists_of_prompts_and_of_token_ids(client, tokenizer):
    texts = client.completions.create(model=SERVED, prompt=["Hello", "Paris is"], max_tokens=2,
                                      extra_body={"ignore_eos": True})
    assert sorted(c.index for c in texts.choices) == [0, 1]
    assert texts.usage.prompt_tokens == len(tokenizer.encode("Hello")) + len(tokenizer.encode("Paris is"))
    ids = client.completions.create(model=SERVED, prompt=[[5, 6, 7], [8, 9]], max_tokens=2,
                                    extra_body={"ignore_eos": True})
    assert len(ids.choices) == 2 and ids.usage.prompt_tokens == 5 and ids.usage.completion_tokens == 4
    one = client.completions.create(model=SERVED, prompt=[5, 6, 7], max_tokens=2, extra_body={"ignore_eos": True})
    assert len(one.choices) == 1 and one.usage.prompt_tokens == 3
