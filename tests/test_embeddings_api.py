"""Embeddings, scores and reranking through the real server with the official ``openai`` client, beside a chat
model in one ``engine``: vectors equal transformers' pooled final hidden states (last-token and mean pooling,
normalized or not, as each folder's sentence-transformers files say), batches and token-id inputs, base64,
Matryoshka ``dimensions``, several pooling requests in one engine step, the gateway's Embed, keys and quotas,
and 400s naming the field and the limit on every door."""

from __future__ import annotations

import base64
import json
import shutil

import httpx
import numpy as np
import openai
import pytest
import torch

from kvloom.client import Client, GatewayError
from kvloom.core.messages import AddRequest, PoolingParams
from kvloom.core.sampling_params import SamplingParams
from tests.conftest import make_tiny_model
from tests.server_utils import EngineServer, free_port

TEXTS = ["The quick brown fox jumps over the lazy dog.", "Paris is the capital of France.",
         "kvloom schedules tokens, not phases: prefill and decode share one batch. " * 2, "café"]
MATRYOSHKA = [16, 32]


def st_folder(base, path, pooling: str, normalize: bool, config_extra: dict | None = None):
    """A copy of ``base`` with sentence-transformers' files written by hand (as an embedding model ships them)."""
    shutil.copytree(base, path)
    modules = [{"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
               {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"}]
    if normalize:
        modules.append({"idx": 2, "name": "2", "path": "2_Normalize", "type": "sentence_transformers.models.Normalize"})
    (path / "modules.json").write_text(json.dumps(modules))
    (path / "1_Pooling").mkdir()
    (path / "1_Pooling" / "config.json").write_text(json.dumps({
        "word_embedding_dimension": 64, "pooling_mode_cls_token": False, "pooling_mode_max_tokens": False,
        "pooling_mode_mean_tokens": pooling == "mean", "pooling_mode_lasttoken": pooling == "last"}))
    if config_extra:
        config = json.loads((path / "config.json").read_text())
        (path / "config.json").write_text(json.dumps({**config, **config_extra}))
    return path


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("embed-models")
    base = make_tiny_model(tmp / "base", "qwen3", seed=7)
    reranker = make_tiny_model(tmp / "reranker", "qwen3", seed=8)
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(reranker))
    tok.add_tokens(["yes", "no"])  # Qwen3-Reranker's answer tokens, one id each
    tok.save_pretrained(str(reranker))
    return {"last": st_folder(base, tmp / "last", "last", True),
            "mean": st_folder(base, tmp / "mean", "mean", False, {"matryoshka_dimensions": MATRYOSHKA}),
            "reranker": reranker}


@pytest.fixture(scope="module")
def server(folders, tiny_llama, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("embed-server")
    port = free_port()
    config = tmp / "served.toml"
    gateway = f"ipc://{tmp}/gw.sock"
    config.write_text(
        f'port = {port}\nmax_num_seqs = 8\ngateway = "{gateway}"\n'
        '[[api_keys]]\nname = "open"\nkey = "k-open"\n'
        '[[api_keys]]\nname = "limited"\nkey = "k-limited"\nrequests_per_minute = 2\n'
        f'[[models]]\nname = "chat"\nmodel = "{tiny_llama}"\nnum_kv_blocks = 24\nmax_model_len = 128\n'
        f'[[models]]\nname = "emb-last"\nmodel = "{folders["last"]}"\nnum_kv_blocks = 20\nmax_model_len = 128\n'
        f'[[models]]\nname = "emb-mean"\nmodel = "{folders["mean"]}"\nnum_kv_blocks = 16\nmax_model_len = 128\n'
        'max_num_batched_tokens = 16\n'  # chunked prefills: a mean is summed over several steps
        f'[[models]]\nname = "rerank"\nmodel = "{folders["reranker"]}"\ntask = "score"\nnum_kv_blocks = 40\n'
        'max_model_len = 512\n')
    s = EngineServer(["--config", str(config)], tmp, port=port, api_key="k-open")
    s.gateway = gateway
    try:
        yield s.wait_ready()
    finally:
        s.stop()


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="k-open", max_retries=0)


def hf_pooled(folder, ids: list[int], pooling: str, normalize: bool) -> torch.Tensor:
    from transformers import AutoModel

    model = AutoModel.from_pretrained(str(folder), dtype=torch.float32).eval()
    with torch.no_grad():
        h = model(torch.tensor([ids])).last_hidden_state[0]
    v = h.mean(0) if pooling == "mean" else h[-1]
    return torch.nn.functional.normalize(v, dim=-1) if normalize else v


def tokens(folder, text: str) -> list[int]:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(folder)).encode(text)


def assert_close(got, want: torch.Tensor) -> None:
    got = torch.tensor(got, dtype=torch.float32)
    assert got.shape == want.shape
    assert torch.nn.functional.cosine_similarity(got, want, dim=0).item() > 0.9999
    assert abs(got.norm().item() - want.norm().item()) < 1e-3 * max(1.0, want.norm().item())


@pytest.mark.parametrize("model,pooling,normalize,override", [
    ("emb-last", "last", True, None), ("emb-last", "last", False, False),
    ("emb-mean", "mean", False, None), ("emb-mean", "mean", True, True)])
def test_embeddings_equal_transformers_pooled_states(client, folders, model, pooling, normalize, override):
    folder = folders[pooling]
    extra = {} if override is None else {"extra_body": {"normalize": override}}
    batch = client.embeddings.create(model=model, input=TEXTS, encoding_format="float", **extra)
    assert batch.model == model and [d.index for d in batch.data] == list(range(len(TEXTS)))
    ids = [tokens(folder, t) for t in TEXTS]
    assert batch.usage.prompt_tokens == batch.usage.total_tokens == sum(map(len, ids))
    for d, p in zip(batch.data, ids):
        assert_close(d.embedding, hf_pooled(folder, p, pooling, normalize))
    one = client.embeddings.create(model=model, input=TEXTS[2], encoding_format="float", **extra)
    assert len(one.data) == 1
    assert np.allclose(one.data[0].embedding, batch.data[2].embedding, atol=1e-5)


def test_base64_and_token_id_inputs_give_the_same_vectors(client, server, folders):
    floats = client.embeddings.create(model="emb-last", input=TEXTS, encoding_format="float")
    raw = httpx.post(server.url + "/v1/embeddings", headers={"Authorization": "Bearer k-open"}, timeout=60,
                     json={"model": "emb-last", "input": TEXTS, "encoding_format": "base64"}).json()

    for d, f in zip(raw["data"], floats.data):
        assert np.allclose(np.frombuffer(base64.b64decode(d["embedding"]), dtype="<f4"), f.embedding, atol=1e-6)
    decoded = client.embeddings.create(model="emb-last", input=TEXTS)  # the client asks for base64 and decodes it
    assert all(np.allclose(a.embedding, b.embedding, atol=1e-6) for a, b in zip(decoded.data, floats.data))
    ids = [tokens(folders["last"], t) for t in TEXTS]
    by_ids = client.embeddings.create(model="emb-last", input=ids, encoding_format="float")
    one = client.embeddings.create(model="emb-last", input=ids[1], encoding_format="float")
    assert all(np.allclose(a.embedding, b.embedding, atol=1e-5) for a, b in zip(by_ids.data, floats.data))
    assert np.allclose(one.data[0].embedding, floats.data[1].embedding, atol=1e-5)


def test_matryoshka_dimensions_truncate_then_normalize(client, folders):
    full = hf_pooled(folders["mean"], tokens(folders["mean"], TEXTS[0]), "mean", False)
    for dims in MATRYOSHKA:
        got = client.embeddings.create(model="emb-mean", input=TEXTS[0], dimensions=dims, encoding_format="float",
                                       extra_body={"normalize": True})
        assert len(got.data[0].embedding) == dims
        assert_close(got.data[0].embedding, torch.nn.functional.normalize(full[:dims], dim=-1))


def error_of(excinfo) -> dict:
    return excinfo.value.response.json()["error"]


def test_bad_requests_are_400s_naming_the_field_and_the_limit(client):
    cases = [
        (dict(model="emb-last", input="hi", dimensions=16), "dimensions", "does not support truncated"),
        (dict(model="emb-mean", input="hi", dimensions=20), "dimensions", "[16, 32]"),
        (dict(model="emb-mean", input="hi", encoding_format="hex"), "encoding_format", "['float', 'base64']"),
        (dict(model="emb-last", input=[list(range(3, 140))]), "input", "maximum context length is 128"),
        (dict(model="emb-last", input=[[5, 999999]]), "input", "out of range [0, 384)"),
        (dict(model="emb-last", input=[]), "input", "not empty"),
        (dict(model="emb-last", input=["x"] * 2049), "input", "at most 2048"),
        (dict(model="chat", input="hi"), "model", "task='generate'"),
        (dict(model="emb-last", input="hi", extra_body={"messages": []}), "messages", "not served"),
        (dict(model="emb-last", input="hi", extra_body={"pooling_mode": "max"}), "pooling_mode", "unknown field"),
    ]
    for kwargs, param, text in cases:
        with pytest.raises(openai.BadRequestError) as e:
            client.embeddings.create(**{"encoding_format": "float", **kwargs})
        err = error_of(e)
        assert err["param"] == param and text in err["message"], (kwargs, err)
    with pytest.raises(openai.BadRequestError) as e:  # an embedding model generates no text
        client.chat.completions.create(model="emb-last", messages=[{"role": "user", "content": "hi"}], max_tokens=2)
    assert error_of(e)["param"] == "model" and "task='embed'" in error_of(e)["message"]
    with pytest.raises(openai.NotFoundError):
        client.embeddings.create(model="nope", input="hi")


def test_an_embedding_model_and_a_chat_model_served_together(client, server):
    assert {m.id for m in client.models.list()} == {"chat", "emb-last", "emb-mean", "rerank"}
    chat = client.chat.completions.create(model="chat", messages=[{"role": "user", "content": "hi"}], max_tokens=4,
                                          temperature=0)
    assert chat.usage.completion_tokens == 4
    client.embeddings.create(model="emb-last", input=TEXTS, encoding_format="float")
    metrics = httpx.get(server.url + "/metrics", timeout=30).text

    def value(name: str, model: str) -> float:
        lines = [ln for ln in metrics.splitlines() if ln.startswith(name) and f'model="{model}"' in ln]
        assert lines, (name, model, [ln for ln in metrics.splitlines() if model in ln])
        return float(lines[0].rsplit(" ", 1)[1])

    # each engine within its own share: the KV blocks its table gave it
    assert [value("kvloom_kv_cache_total_blocks", m) for m in ("chat", "emb-last", "emb-mean")] == [24, 20, 16]
    assert value('kvloom_request_success_total{finished_reason="stop"', "emb-last") >= len(TEXTS)
    assert value("kvloom_prompt_tokens_total", "emb-last") > 0
    assert value('kvloom_api_key_requests_total{api_key="open"', "emb-last") >= 1
    # no key: refused on the embeddings route as on chat
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=server.url + "/v1", api_key="wrong", max_retries=0).embeddings.create(
            model="emb-last", input="hi")


def test_a_keys_quota_counts_embeddings(server):
    limited = openai.OpenAI(base_url=server.url + "/v1", api_key="k-limited", max_retries=0)
    for _ in range(2):  # requests_per_minute=2 in the embedding model's engine
        limited.embeddings.create(model="emb-mean", input="one", encoding_format="float")
    with pytest.raises(openai.RateLimitError) as e:
        limited.embeddings.create(model="emb-mean", input="three", encoding_format="float")
    assert "requests_per_minute=2" in error_of(e)["message"]


def test_the_gateway_embeds_and_refuses_alike(server, client):
    want = client.embeddings.create(model="emb-last", input=TEXTS, encoding_format="float")
    with Client(server.gateway, timeout=60, api_key="k-open") as gw:
        got = gw.embed(TEXTS, model="emb-last")
        assert got.usage.prompt_tokens == want.usage.prompt_tokens
        assert all(np.allclose(a, b.embedding, atol=1e-5) for a, b in zip(got.data, want.data))
        with pytest.raises(GatewayError) as e:
            gw.embed(["hi"], model="emb-last", dimensions=8)
        assert e.value.status == 400 and "dimensions=8" in str(e.value)
        with pytest.raises(GatewayError) as e:
            gw.embed([[1, 2, 400]], model="emb-mean")
        assert e.value.status == 400 and "out of range [0, 384)" in str(e.value)
        with pytest.raises(GatewayError) as e:
            gw.embed(["hi"], model="chat")
        assert e.value.status == 400 and "task='generate'" in str(e.value)


def hf_yes_probability(folder, prompt: str) -> float:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(folder))
    model = AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32).eval()
    with torch.no_grad():
        logits = model(torch.tensor([tok.encode(prompt)])).logits[0, -1]
    pair = logits[[tok.convert_tokens_to_ids("no"), tok.convert_tokens_to_ids("yes")]]
    return torch.softmax(pair, -1)[1].item()


def test_rerank_and_score_are_a_yes_no_rerankers_probability(server, folders):
    from kvloom.frontends.pooling_api import rerank_prompt

    docs = ["Paris is the capital of France.", "The quick brown fox.", "Berlin is in Germany."]
    query = "capital of France"
    want = [hf_yes_probability(folders["reranker"], rerank_prompt(query, d, None)) for d in docs]
    headers = {"Authorization": "Bearer k-open"}
    r = httpx.post(server.url + "/v1/rerank", headers=headers, timeout=60,
                   json={"model": "rerank", "query": query, "documents": [docs[0], {"text": docs[1]}, docs[2]],
                         "top_n": 2})
    assert r.status_code == 200, r.text
    results = r.json()["results"]
    order = sorted(range(3), key=lambda i: -want[i])[:2]
    assert [x["index"] for x in results] == order
    assert all(abs(x["relevance_score"] - want[x["index"]]) < 1e-4 for x in results)
    assert results[0]["document"]["text"] == docs[order[0]]
    r = httpx.post(server.url + "/v1/score", headers=headers, timeout=60,
                   json={"model": "rerank", "text_1": query, "text_2": docs})
    assert r.status_code == 200, r.text
    assert [abs(d["score"] - w) < 1e-4 for d, w in zip(r.json()["data"], want)] == [True] * 3
    r = httpx.post(server.url + "/v1/score", headers=headers, timeout=60,
                   json={"model": "emb-last", "text_1": query, "text_2": docs})
    assert r.status_code == 400 and r.json()["error"]["param"] == "model"
    r = httpx.post(server.url + "/v1/score", headers=headers, timeout=60,
                   json={"model": "rerank", "text_1": [query, query], "text_2": docs})
    assert r.status_code == 400 and r.json()["error"]["param"] == "text_1"


# --- in-process: the engine's steps ------------------------------------------------------------------
def test_several_pooling_requests_share_one_engine_step(folders):
    from kvloom import LLM

    llm = LLM(str(folders["mean"]), num_kv_blocks=32, max_num_batched_tokens=256)
    prompts = [tokens(folders["mean"], t) for t in TEXTS]
    for i, ids in enumerate(prompts):
        llm.engine.add_request(AddRequest(request_id=f"r{i}", prompt_token_ids=ids,
                                          sampling=SamplingParams(max_tokens=1), pooling=PoolingParams()))
    deltas = llm.engine.step() + llm.engine.flush()  # one step: every prompt fits its token budget
    assert sorted(d.request_id for d in deltas if d.embedding is not None) == [f"r{i}" for i in range(len(TEXTS))]
    assert all(d.finish_reason == "stop" and d.num_prompt_tokens == len(p) for d, p in
               zip(sorted(deltas, key=lambda d: d.request_id), prompts))
    for d in deltas:
        assert_close(d.embedding, hf_pooled(folders["mean"], prompts[int(d.request_id[1:])], "mean", False))
    assert llm.engine.kv.num_free_blocks() == llm.engine.kv.num_blocks  # nothing left holding blocks
    assert not llm.engine.has_unfinished()


@pytest.mark.parametrize("async_scheduling", ["off", "on"])
def test_llm_embed_over_chunked_prefills_and_its_400s(folders, async_scheduling):
    from kvloom import LLM

    llm = LLM(str(folders["last"]), num_kv_blocks=32, max_num_batched_tokens=8, max_model_len=128,
              async_scheduling=async_scheduling)  # on: each step is applied after the next one is launched
    prompts = [tokens(folders["last"], t) for t in TEXTS]
    outs = llm.embed(TEXTS, use_tqdm=False)
    for o, ids in zip(outs, prompts):
        assert o.prompt_token_ids == ids
        assert_close(o.embedding, hf_pooled(folders["last"], ids, "last", True))
    with pytest.raises(ValueError, match="dimensions=8: this model does not support truncated embeddings"):
        llm.embed("hi", dimensions=8)
    with pytest.raises(ValueError, match="maximum context length is 128"):
        llm.embed([list(range(3, 140))])
    with pytest.raises(ValueError, match="task='embed'"):
        llm.generate("hi", use_tqdm=False)


def test_an_embedding_checkpoint_without_an_output_head_loads(folders, tmp_path):
    """Embedding models ship the bare decoder (sentence-transformers saves ``Qwen3Model``: no ``model.``
    prefix, no ``lm_head``); an embedding engine loads no output projection, so such a folder serves."""
    from safetensors.torch import load_file, save_file

    from kvloom import LLM

    bare = tmp_path / "bare"
    shutil.copytree(folders["last"], bare)
    weights = load_file(str(bare / "model.safetensors"))
    save_file({k.removeprefix("model."): v for k, v in weights.items() if not k.startswith("lm_head")},
              str(bare / "model.safetensors"), metadata={"format": "pt"})
    ids = tokens(folders["last"], TEXTS[1])
    got = LLM(str(bare), num_kv_blocks=16).embed([ids], use_tqdm=False)[0].embedding
    assert_close(got, hf_pooled(folders["last"], ids, "last", True))
