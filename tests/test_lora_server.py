"""LoRA adapters through the real server (engine process, two HTTP workers, the ZMQ gateway): a request picks
an adapter by ``model`` (openai client and gateway), adapters load and unload at run time through vLLM's
routes behind the API key while another adapter's request streams, an in-use adapter's unload is refused
without harming its stream, ``/v1/models`` lists adapters with their base, metrics and the access log
name the adapter, and the chat-shaped APIs (chat completions, Responses, Anthropic Messages) run an adapter
by name alike."""

from __future__ import annotations

import time

import anthropic
import httpx
import openai
import pytest

from kvloom.client import Client, GatewayError
from tests.conftest import make_tiny_model
from tests.lora_utils import MAX_RANK, make_adapters, peft_greedy, prompts
from tests.server_utils import EngineServer

API_KEY = "lora-test-key"
MAX_NEW = 16


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    folder = tmp_path_factory.mktemp("lora-server")
    base = make_tiny_model(folder / "base", "llama")
    adapters = make_adapters(base, folder)
    ps = prompts((9, 20, 14))
    names = ["a", "b", None]
    expected = dict(zip(names, peft_greedy(base, adapters, ps, names, MAX_NEW)))
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(base))
    # What the logprobs of a completion show for each token: its own text, special tokens included.
    pieces = {name: [tokenizer.decode([t], skip_special_tokens=False) for t in ids] for name, ids in expected.items()}
    gateway = f"ipc://{folder}/gw.sock"
    # A context far longer than the model's own, so the streaming request below is still running,
    # whatever the machine's speed, until the test ends it.
    srv = EngineServer(["--model", f"tiny={base}", "--dtype", "float32", "--enable-lora", "--lora-modules",
                        f"a={adapters['a']}", "--max-loras", "2", "--max-lora-rank", str(MAX_RANK),
                        "--hf-overrides", '{"max_position_embeddings": 100000}', "--kv-cache-memory-gib", "0.05",
                        "--api-workers", "2", "--gateway", gateway, "--api-key", API_KEY], folder, api_key=API_KEY)
    with srv:
        srv.gateway = gateway
        yield srv, base, adapters, ps, expected, pieces


def _client(srv) -> openai.OpenAI:
    return openai.OpenAI(base_url=srv.url + "/v1", api_key=API_KEY, max_retries=0)


def _post(srv, path: str, body: dict, key: str | None = API_KEY) -> httpx.Response:
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    return httpx.post(srv.url + path, json=body, headers=headers, timeout=60)


def _greedy(client, model: str, prompt: list[int]) -> list[str]:
    """Each generated token's text, from the logprobs (one entry per token, special tokens included)."""
    out = client.completions.create(model=model, prompt=prompt, max_tokens=MAX_NEW, temperature=0.0, logprobs=0,
                                    extra_body={"ignore_eos": True})
    return out.choices[0].logprobs.tokens


def test_adapters_load_and_unload_while_another_streams(setup):
    srv, base, adapters, ps, expected, pieces = setup
    client = _client(srv)
    assert _greedy(client, "a", ps[0]) == pieces["a"]
    assert _greedy(client, "tiny", ps[2]) == pieces[None]
    # A long request of adapter a streams while b is loaded, used and refused; a's unload is refused.
    stream = client.completions.create(model="a", prompt=ps[0], max_tokens=90000, temperature=0.0, stream=True,
                                       logprobs=0, extra_body={"ignore_eos": True})
    tokens = []
    chunks = iter(stream)
    while len(tokens) < 4:
        tokens += next(chunks).choices[0].logprobs.tokens
    body = {"lora_name": "b", "lora_path": adapters["b"]}
    assert _post(srv, "/v1/load_lora_adapter", body, key=None).status_code == 401
    loaded = _post(srv, "/v1/load_lora_adapter", {"lora_name": "b", "lora_path": adapters["b"]})
    assert loaded.status_code == 200 and loaded.text == "Success: LoRA adapter 'b' added successfully."
    again = _post(srv, "/v1/load_lora_adapter", {"lora_name": "b", "lora_path": adapters["b"]})
    assert again.status_code == 400 and "already loaded" in again.json()["error"]["message"]
    for _ in range(3):  # either HTTP worker may answer: each finds b
        assert _greedy(client, "b", ps[1]) == pieces["b"]
    refused = _post(srv, "/v1/unload_lora_adapter", {"lora_name": "a"})
    assert refused.status_code == 409, refused.text
    assert "in use by 1 unfinished request" in refused.json()["error"]["message"]
    while len(tokens) < MAX_NEW:
        tokens += next(chunks).choices[0].logprobs.tokens
    assert tokens[:MAX_NEW] == pieces["a"]  # the stream went on, unharmed
    stream.close()  # ends (aborts) the request

    models = client.models.list().data
    cards = {m.id: m for m in models}
    assert set(cards) == {"tiny", "a", "b"}
    assert cards["b"].parent == "tiny" and cards["b"].root == adapters["b"] and cards["tiny"].parent is None
    # Once a's request has ended (the abort reaches the engine in the next step), it unloads.
    deadline = time.monotonic() + 30
    while (done := _post(srv, "/v1/unload_lora_adapter", {"lora_name": "a"})).status_code == 409:
        assert time.monotonic() < deadline, "the aborted request kept its adapter in use"
        time.sleep(0.05)
    assert done.status_code == 200 and done.text == "Success: LoRA adapter 'a' removed successfully."
    for _ in range(3):  # either HTTP worker: the one that unloaded it knows, the other learns it from the engine
        with pytest.raises(openai.NotFoundError, match="`a` does not exist|unknown LoRA adapter 'a'"):
            _greedy(client, "a", ps[0])
    missing = _post(srv, "/v1/unload_lora_adapter", {"lora_name": "a"})
    assert missing.status_code == 404 and "'a' is not loaded" in missing.json()["error"]["message"]
    bad = _post(srv, "/v1/load_lora_adapter", {"lora_name": "x", "lora_path": str(base)})
    assert bad.status_code == 400 and "adapter_config.json" in bad.json()["error"]["message"]
    assert _greedy(client, "tiny", ps[2]) == pieces[None]  # the base model served all along

    # The gateway picks an adapter by model name too.
    with Client(srv.gateway, timeout=60, api_key=API_KEY) as gw:
        out = gw.generate(prompt_token_ids=ps[1], model="b", max_tokens=MAX_NEW, temperature=0, ignore_eos=True)
        assert out.token_ids == expected["b"]
        with pytest.raises(GatewayError, match="`a` does not exist") as err:
            gw.generate(prompt_token_ids=ps[1], model="a", max_tokens=2)
        assert err.value.status == 404

    metrics = httpx.get(srv.url + "/metrics", timeout=30).text
    assert 'kvloom_generation_tokens_total{model="b"}' in metrics
    assert "kvloom_lora_adapters_loaded" in metrics and "kvloom_lora_slot_loads_total" in metrics
    log = srv.log_with('"POST /v1/completions" 200 model=b ')
    assert '"POST /v1/completions" 200 model=b ' in log


def test_chat_responses_and_messages_run_an_adapter_by_name(setup):
    srv, base, adapters, ps, expected, pieces = setup
    name = "chat-a"
    assert _post(srv, "/v1/load_lora_adapter", {"lora_name": name, "lora_path": adapters["a"]}).status_code == 200
    client = _client(srv)
    turns = [{"role": "user", "content": "Name a colour."}]
    ids = _post(srv, "/tokenize", {"model": name, "messages": turns}).json()["tokens"]
    (want,) = peft_greedy(base, {name: adapters["a"]}, [ids], [name], MAX_NEW)
    chat = client.chat.completions.create(model=name, messages=turns, max_tokens=MAX_NEW, temperature=0,
                                          extra_body={"ignore_eos": True, "return_token_ids": True})
    assert chat.model == name and chat.choices[0].token_ids == want  # the adapter's tokens, as PEFT's
    plain = client.chat.completions.create(model=name, messages=turns, max_tokens=MAX_NEW, temperature=0)
    text = plain.choices[0].message.content
    resp = client.responses.create(model=name, input=turns, max_output_tokens=MAX_NEW, temperature=0)
    assert resp.model == name and resp.output_text == text
    claude = anthropic.Anthropic(base_url=srv.url, api_key=API_KEY, max_retries=0, timeout=120)
    message = claude.messages.create(model=name, messages=turns, max_tokens=MAX_NEW, extra_body={"temperature": 0})
    assert message.model == name and "".join(b.text for b in message.content if b.type == "text") == text
    assert message.usage.input_tokens == len(ids)
    lines = (f'"POST /v1/responses" 200 model={name} ', f'"POST /v1/messages" 200 model={name} ')
    log = srv.log_with(*lines)
    assert all(line in log for line in lines)
    assert _post(srv, "/v1/unload_lora_adapter", {"lora_name": name}).status_code == 200
