"""Prompt logprobs (what lm-eval-harness's loglikelihood tasks read through ``echo`` + ``logprobs``): the
engine scores every prompt token in the prefill, equal to transformers' log_softmax on the same float32
model, whether the prompt is prefilled in one step or in chunks, and also when its prefix is cached;
served by ``/v1/completions``, ``kvloom.LLM`` and the ZMQ gateway (``kvloom.client`` and a raw socket)."""

from __future__ import annotations

import pytest
import torch

from kvloom.builder import build_engine
from kvloom.core.config import EngineConfig
from kvloom.core.messages import AddRequest
from kvloom.core.sampling_params import SamplingParams

PROMPT = [1] + [(7 * i + 3) % 380 + 3 for i in range(45)]  # 46 tokens: three blocks of 16 and a tail
TOP = 5


def hf_prompt_logprobs(path, prompt: list[int]) -> torch.Tensor:
    """[len(prompt) - 1, vocab]: row j is the log-distribution over prompt token j + 1."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()
    with torch.no_grad():
        logits = model(torch.tensor([prompt])).logits[0, :-1].float()
    return torch.log_softmax(logits, dim=-1)


def run(engine, requests: list[AddRequest]) -> dict[str, list]:
    for r in requests:
        engine.add_request(r)
    deltas: dict[str, list] = {r.request_id: [] for r in requests}
    while engine.has_unfinished():
        for d in engine.step():
            deltas[d.request_id].append(d)
    return deltas


@pytest.fixture(scope="module")
def expected(tiny_llama):
    return hf_prompt_logprobs(tiny_llama, PROMPT)


@pytest.mark.parametrize("budget,async_scheduling", [(2048, "off"), (16, "off"), (7, "on")],
                         ids=["whole-prefill", "chunks-of-16", "chunks-of-7-async"])
def test_prompt_logprobs_equal_transformers(tiny_llama, expected, budget, async_scheduling):
    engine = build_engine(EngineConfig(model=str(tiny_llama), device="cpu", dtype="float32", num_kv_blocks=64,
                                     max_num_batched_tokens=budget, plugins=["prefix_cache"], block_size=16,
                                     async_scheduling=async_scheduling))
    wants = SamplingParams(temperature=0.0, max_tokens=2, prompt_logprobs=TOP)
    plain = SamplingParams(temperature=0.0, max_tokens=2)
    # The first run fills the prefix cache; the second must still score every position (no cache hit),
    # and a request beside it that did not ask gets no prompt logprobs.
    for rnd in range(2):
        out = run(engine, [AddRequest(request_id=f"a{rnd}", prompt_token_ids=PROMPT, sampling=wants),
                           AddRequest(request_id=f"b{rnd}", prompt_token_ids=PROMPT[:30], sampling=plain)])
        first = out[f"a{rnd}"][0]
        lps = first.prompt_logprobs
        assert first.num_cached_tokens == 0
        assert [lp.token_id for lp in lps] == PROMPT[1:]
        got = torch.tensor([lp.logprob for lp in lps])
        want = expected.gather(1, torch.tensor(PROMPT[1:])[:, None])[:, 0]
        assert torch.allclose(got, want, atol=1e-4), (got - want).abs().max()
        top_vals, top_ids = expected.topk(TOP, dim=-1)
        assert [[t.token_id for t in lp.top] for lp in lps] == top_ids.tolist()
        assert torch.allclose(torch.tensor([[t.logprob for t in lp.top] for lp in lps]), top_vals, atol=1e-4)
        ranks = (expected > want[:, None]).sum(-1) + 1
        assert [lp.rank for lp in lps] == ranks.tolist()
        assert all(d.prompt_logprobs is None for d in out[f"a{rnd}"][1:])
        assert all(d.prompt_logprobs is None for d in out[f"b{rnd}"])
    # The plain request of the second round did hit the cache: skipping it is only for those that ask.
    assert engine.scheduler.prefix_cache_hits > 0


def test_prompt_logprobs_zero_gives_the_prompt_tokens_own_only(tiny_llama, expected):
    engine = build_engine(EngineConfig(model=str(tiny_llama), device="cpu", dtype="float32", num_kv_blocks=64))
    out = run(engine, [AddRequest(request_id="z", prompt_token_ids=PROMPT[:10],
                                  sampling=SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=0))])
    lps = out["z"][0].prompt_logprobs
    assert len(lps) == 9 and all(lp.top == [] for lp in lps)
    want = expected[:9].gather(1, torch.tensor(PROMPT[1:10])[:, None])[:, 0]
    assert torch.allclose(torch.tensor([lp.logprob for lp in lps]), want, atol=1e-4)


def test_prompt_logprobs_out_of_range_is_refused():
    with pytest.raises(ValueError, match=r"prompt_logprobs=21 must be in \[0, 20\]"):
        SamplingParams(prompt_logprobs=21)


# --- over HTTP, as lm-eval-harness and the openai client send it --------------------------------------
@pytest.fixture(scope="module")
def server(tiny_llama, tmp_path_factory):
    from tests.server_utils import EngineServer

    # Chunks of 16 tokens: the prompt logprobs cross chunk boundaries; a prefix cache that must not skip them.
    tmp = tmp_path_factory.mktemp("echo")
    srv = EngineServer(["--model", str(tiny_llama), "--dtype", "float32", "--max-num-batched-tokens", "16",
                        "--block-size", "16", "--num-kv-blocks", "64", "--plugins", "prefix_cache",
                        "--max-model-len", "256", "--served-model-name", "m", "--gateway", f"ipc://{tmp}/gw.sock"],
                       tmp)
    srv.gateway = f"ipc://{tmp}/gw.sock"
    with srv:
        yield srv


@pytest.fixture
def client(server):
    import openai

    return openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0, timeout=60)


def _token_text(tiny_llama):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(tiny_llama))
    return lambda t: tok.decode([t], skip_special_tokens=False)


@pytest.mark.parametrize("max_tokens", [0, 1])
def test_echo_logprobs_score_the_prompt_as_transformers_does(client, tiny_llama, expected, max_tokens):
    """lm-eval-harness's loglikelihood request: token ids, echo, logprobs, max_tokens 0 or 1."""
    text = _token_text(tiny_llama)
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(tiny_llama))

    def decode(ids):
        return tok.decode(ids, skip_special_tokens=False)

    for _ in range(2):  # the second time its blocks are cached: the positions are scored anyway
        out = client.completions.create(model="m", prompt=PROMPT, echo=True, logprobs=TOP, max_tokens=max_tokens,
                                        temperature=0.0)
        lp = out.choices[0].logprobs
        n = len(PROMPT) + max_tokens
        assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset) == n
        assert lp.tokens[: len(PROMPT)] == [text(t) for t in PROMPT]
        assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
        want = expected.gather(1, torch.tensor(PROMPT[1:])[:, None])[:, 0]
        assert torch.allclose(torch.tensor(lp.token_logprobs[1: len(PROMPT)]), want, atol=1e-4)
        # Each prompt position: its top 5 alternatives, and the prompt token itself among them.
        top_ids = expected.topk(TOP, dim=-1).indices
        for j, top in enumerate(lp.top_logprobs[1: len(PROMPT)]):
            assert {text(t) for t in top_ids[j].tolist()} | {text(PROMPT[j + 1])} == set(top)
        offsets = [sum(len(t) for t in lp.tokens[:i]) for i in range(n)]
        assert lp.text_offset == offsets
        assert out.usage.prompt_tokens == len(PROMPT) and out.usage.completion_tokens == max_tokens
        generated = "".join(lp.tokens[len(PROMPT):])
        assert out.choices[0].text == decode(PROMPT) + generated  # the decoded prompt, then the output
        assert out.choices[0].finish_reason == "length"


def test_echo_with_text_prompt_and_stream(client):
    prompt = "The quick brown fox"
    whole = client.completions.create(model="m", prompt=prompt, echo=True, logprobs=2, max_tokens=3, temperature=0.0)
    assert whole.choices[0].text.startswith(prompt) and len(whole.choices[0].text) > len(prompt)
    chunks = list(client.completions.create(model="m", prompt=prompt, echo=True, logprobs=2, max_tokens=3,
                                            temperature=0.0, stream=True))
    assert "".join(c.choices[0].text for c in chunks) == whole.choices[0].text
    streamed = [x for c in chunks if c.choices[0].logprobs for x in c.choices[0].logprobs.token_logprobs]
    assert streamed == whole.choices[0].logprobs.token_logprobs
    offsets = [x for c in chunks if c.choices[0].logprobs for x in c.choices[0].logprobs.text_offset]
    assert offsets == whole.choices[0].logprobs.text_offset
    # echo without logprobs: the text only
    plain = client.completions.create(model="m", prompt=prompt, echo=True, max_tokens=2, temperature=0.0)
    assert plain.choices[0].text.startswith(prompt) and plain.choices[0].logprobs is None


def test_vllm_prompt_logprobs_field(server, tiny_llama, expected):
    import httpx

    body = {"prompt": PROMPT[:12], "max_tokens": 1, "temperature": 0.0, "prompt_logprobs": 2}
    r = httpx.post(server.url + "/v1/completions", json=body, timeout=60)
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    plp = choice["prompt_logprobs"]
    assert len(plp) == 12 and plp[0] is None
    assert choice["logprobs"] is None  # no echo: the prompt's logprobs come in this field only
    ranks = (expected[:11] > expected[:11].gather(1, torch.tensor(PROMPT[1:12])[:, None])).sum(-1) + 1
    for j, entry in enumerate(plp[1:]):
        own = entry[str(PROMPT[j + 1])]
        assert abs(own["logprob"] - expected[j, PROMPT[j + 1]].item()) < 1e-4 and own["rank"] == ranks[j].item()
        best = expected[j].topk(2).indices.tolist()
        assert {str(t) for t in best} <= set(entry) and entry[str(best[0])]["rank"] == 1


@pytest.mark.parametrize("body,param", [
    ({"prompt": "hi", "max_tokens": 0}, "max_tokens"),  # nothing to return without echo
    ({"prompt": "hi", "echo": True, "logprobs": 21}, "logprobs"),  # over the server's 20
    ({"prompt": "hi", "prompt_logprobs": 21}, "prompt_logprobs"),
])
def test_bad_echo_combinations_are_400s_naming_the_field(server, body, param):
    import httpx

    r = httpx.post(server.url + "/v1/completions", json=body, timeout=30)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param and param in r.json()["error"]["message"]


def test_offline_llm_returns_prompt_logprobs(tiny_llama, expected):
    from kvloom import LLM

    llm = LLM(str(tiny_llama), dtype="float32", num_kv_blocks=32)
    out = llm.generate([PROMPT], SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=1), use_tqdm=False)[0]
    want = expected.gather(1, torch.tensor(PROMPT[1:])[:, None])[:, 0]
    assert torch.allclose(torch.tensor([lp.logprob for lp in out.prompt_logprobs]), want, atol=1e-4)


# --- through the ZMQ gateway: kvloom.client and a client in any language (a raw DEALER socket) ---------
def _check_against_transformers(lps, prompt, expected, top):
    assert [lp.token_id for lp in lps] == prompt[1:]
    want = expected[: len(prompt) - 1].gather(1, torch.tensor(prompt[1:])[:, None])[:, 0]
    torch.testing.assert_close(torch.tensor([lp.logprob for lp in lps]), want, atol=1e-4, rtol=0)
    best = expected[: len(prompt) - 1].topk(top, dim=-1)
    assert [[t.token_id for t in lp.top] for lp in lps] == best.indices.tolist()
    torch.testing.assert_close(torch.tensor([[t.logprob for t in lp.top] for lp in lps]), best.values,
                               atol=1e-4, rtol=0)
    assert [lp.rank for lp in lps] == ((expected[: len(prompt) - 1] > want[:, None]).sum(-1) + 1).tolist()


@pytest.fixture(scope="module")
def offline(tiny_llama):
    """kvloom.LLM's prompt logprobs of PROMPT, top TOP: what the gateway must return too."""
    from kvloom import LLM

    llm = LLM(str(tiny_llama), dtype="float32", num_kv_blocks=32)
    return llm.generate([PROMPT], SamplingParams(temperature=0.0, max_tokens=3, prompt_logprobs=TOP),
                        use_tqdm=False)[0]


def test_gateway_client_gets_the_prompt_logprobs_of_the_offline_llm(server, expected, offline):
    import asyncio

    from kvloom.client import AsyncClient, Client

    with Client(server.gateway, timeout=60) as gw:
        chunks = list(gw.stream(prompt_token_ids=PROMPT, max_tokens=3, temperature=0.0, prompt_logprobs=TOP))
        whole = gw.generate(prompt_token_ids=PROMPT, max_tokens=3, temperature=0.0, prompt_logprobs=TOP)
        plain = gw.generate(prompt_token_ids=PROMPT, max_tokens=1, temperature=0.0)
        one_token = gw.generate(prompt_token_ids=PROMPT[:1], max_tokens=1, temperature=0.0, prompt_logprobs=1)

    async def from_async_client():
        async with AsyncClient(server.gateway, timeout=60) as gw:
            return await gw.generate(prompt_token_ids=PROMPT, max_tokens=1, temperature=0.0, prompt_logprobs=TOP)

    # Sent once, on the first chunk; the same prompt a second time (its blocks now cached) is scored again.
    assert chunks[0].prompt_logprobs is not None and all(c.prompt_logprobs is None for c in chunks[1:])
    for got in (chunks[0].prompt_logprobs, whole.prompt_logprobs, asyncio.run(from_async_client()).prompt_logprobs):
        assert len(got) == len(offline.prompt_logprobs) == len(PROMPT) - 1
        for a, b in zip(got, offline.prompt_logprobs):
            assert (a.token_id, a.rank, [t.token_id for t in a.top]) == (b.token_id, b.rank, [t.token_id for t in b.top])
            assert abs(a.logprob - b.logprob) < 1e-4
            assert all(abs(x.logprob - y.logprob) < 1e-4 for x, y in zip(a.top, b.top))
        _check_against_transformers(got, PROMPT, expected, TOP)
    assert whole.token_ids == offline.token_ids and whole.usage.prompt_tokens == len(PROMPT)
    assert plain.prompt_logprobs is None  # not asked: not sent
    assert one_token.prompt_logprobs == []  # asked, but a one-token prompt has nothing to score


def test_gateway_prompt_logprobs_on_a_raw_socket(server, expected):
    import msgspec
    import zmq

    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.RCVTIMEO, 60_000)
    sock.connect(server.gateway)
    try:
        def ask(sampling):
            sock.send(msgspec.msgpack.encode({"type": "Generate", "request_id": "r", "prompt_token_ids": PROMPT[:20],
                                              "sampling": {"max_tokens": 1, "temperature": 0, **sampling}}))
            return msgspec.msgpack.decode(sock.recv())

        reply = ask({"prompt_logprobs": 2})
        assert reply["type"] == "TextChunk" and reply["finish_reason"] == "length", reply
        # TokenLogprobs travel as arrays: [token_id, logprob, [[token_id, logprob], ...top], rank].
        rows = reply["prompt_logprobs"]
        assert [r[0] for r in rows] == PROMPT[1:20] and all(len(r[2]) == 2 for r in rows)
        want = expected[:19].gather(1, torch.tensor(PROMPT[1:20])[:, None])[:, 0]
        torch.testing.assert_close(torch.tensor([r[1] for r in rows]), want, atol=1e-4, rtol=0)
        assert [r[3] for r in rows] == ((expected[:19] > want[:, None]).sum(-1) + 1).tolist()
        assert [[t[0] for t in r[2]] for r in rows] == expected[:19].topk(2, dim=-1).indices.tolist()
        # Validated as strictly as over HTTP: out of range or of the wrong type is a 400 naming the field.
        for bad, needle in [(21, "prompt_logprobs=21 must be in [0, 20]"), (-1, "prompt_logprobs=-1"),
                            ("5", "prompt_logprobs")]:
            refused = ask({"prompt_logprobs": bad})
            assert refused["type"] == "RequestFailed" and refused["status"] == 400, refused
            assert needle in refused["message"]
    finally:
        sock.close()


def test_offline_llm_takes_vllm_prompt_dicts(tiny_llama):
    """vLLM's ``TokensPrompt``/``TextPrompt`` dicts give what the bare ids and text give; other keys are refused
    by name."""
    from kvloom import LLM

    llm = LLM(str(tiny_llama), dtype="float32", num_kv_blocks=32)
    sp = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    ids = [5, 17, 33, 8]
    bare = [o.outputs[0].token_ids for o in llm.generate([ids, "hello"], sp, use_tqdm=False)]
    dicts = [o.outputs[0].token_ids for o in llm.generate([{"prompt_token_ids": ids}, {"prompt": "hello"}], sp,
                                                         use_tqdm=False)]
    assert dicts == bare
    assert llm.generate({"prompt_token_ids": ids}, sp, use_tqdm=False)[0].outputs[0].token_ids == bare[0]
    with pytest.raises(ValueError, match="multi_modal_data"):
        llm.generate([{"prompt": "hi", "multi_modal_data": {}}], sp, use_tqdm=False)
