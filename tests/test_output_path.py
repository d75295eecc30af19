"""One output path (kvloom.frontends.output) for the server and ``kvloom.LLM``: the same prompts give the
same text through both, with ``n`` > 1 and a seed, with stop strings, greedy and sampled, streamed or not."""

from __future__ import annotations

import json

import httpx
import pytest

from kvloom import LLM, SamplingParams
from kvloom.frontends.output import fan_out
from tests.server_utils import EngineServer

PROMPTS = ["The quick brown fox", "Numbers: 0 1 2"]
NEAR_INT64_MAX = 2**63 - 2  # n=3 from here crosses the int64 limit: both paths must wrap alike


@pytest.fixture(scope="module")
def server(tiny_llama, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("output_path")
    srv = EngineServer(["--model", str(tiny_llama), "--num-kv-blocks", "256", "--api-workers", "1"], tmp)
    with srv:
        yield srv


@pytest.fixture(scope="module")
def llm(tiny_llama):
    return LLM(str(tiny_llama), num_kv_blocks=256)


def completions(server, body: dict) -> list[dict]:
    r = httpx.post(server.url + "/v1/completions", json=body, timeout=120)
    assert r.status_code == 200, r.text
    return sorted(r.json()["choices"], key=lambda c: c["index"])


def streamed_texts(server, body: dict) -> tuple[dict[int, str], dict[int, tuple]]:
    texts: dict[int, str] = {}
    ends: dict[int, tuple] = {}
    with httpx.stream("POST", server.url + "/v1/completions", json={**body, "stream": True}, timeout=120) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if not line.startswith("data:") or line.endswith("[DONE]"):
                continue
            for c in json.loads(line[5:])["choices"]:
                texts[c["index"]] = texts.get(c["index"], "") + c["text"]
                if c["finish_reason"] is not None:
                    ends[c["index"]] = (c["finish_reason"], c["stop_reason"])
    return texts, ends


def offline(llm, sp: SamplingParams) -> list[list]:
    return [[(c.text, c.finish_reason, c.stop_reason) for c in out.outputs]
            for out in llm.generate(PROMPTS, sp, use_tqdm=False)]


def served(server, body: dict) -> list[list]:
    # Choices of a batch of prompts come prompt by prompt, n each (OpenAI's order).
    choices = completions(server, {**body, "prompt": PROMPTS})
    n = body.get("n", 1)
    rows = [(c["text"], c["finish_reason"], c["stop_reason"]) for c in choices]
    return [rows[i * n:(i + 1) * n] for i in range(len(PROMPTS))]


@pytest.mark.parametrize("seed", [1234, NEAR_INT64_MAX], ids=["seed", "seed-near-int64-max"])
def test_sampled_n_choices_with_a_seed_are_the_same_offline_and_served(server, llm, seed):
    sp = SamplingParams(n=3, temperature=1.0, seed=seed, max_tokens=12, ignore_eos=True)
    body = {"n": 3, "temperature": 1.0, "seed": seed, "max_tokens": 12, "ignore_eos": True}
    offline_rows, served_rows = offline(llm, sp), served(server, body)
    assert offline_rows == served_rows
    for row in offline_rows:  # the seed rule gives each choice its own seed: they differ
        assert len({text for text, _, _ in row}) == 3 and all(reason == "length" for _, reason, _ in row)


def test_greedy_choices_are_the_same_offline_and_served(server, llm):
    sp = SamplingParams(n=2, temperature=0.0, max_tokens=10, ignore_eos=True)
    offline_rows = offline(llm, sp)
    assert offline_rows == served(server, {"n": 2, "temperature": 0, "max_tokens": 10, "ignore_eos": True})
    assert all(row[0] == row[1] for row in offline_rows)  # greedy: every choice alike


@pytest.mark.parametrize("include", [False, True], ids=["cut", "included"])
def test_stop_strings_end_the_same_text_offline_served_and_streamed(server, llm, include):
    base = SamplingParams(n=2, temperature=1.0, seed=77, max_tokens=24, ignore_eos=True)
    free = llm.generate(PROMPTS[0], base, use_tqdm=False)[0].outputs[0].text
    assert len(free) > 8, free
    stop = free[5:7]  # two characters from the middle: the text must end there, not before
    first = free.find(stop)
    sp = SamplingParams(n=2, temperature=1.0, seed=77, max_tokens=24, ignore_eos=True, stop=[stop],
                        include_stop_str_in_output=include)
    body = {"n": 2, "temperature": 1.0, "seed": 77, "max_tokens": 24, "ignore_eos": True, "stop": [stop],
            "include_stop_str_in_output": include}
    offline_rows = offline(llm, sp)
    assert offline_rows == served(server, body)
    text, reason, stop_reason = offline_rows[0][0]
    assert text == (free[:first + len(stop)] if include else free[:first])
    assert (reason, stop_reason) == ("stop", stop)
    # Streamed, the held-back text never shows the stop string and adds up to the same text.
    texts, ends = streamed_texts(server, {**body, "prompt": PROMPTS[0]})
    assert [texts[i] for i in range(2)] == [t for t, _, _ in offline_rows[0]]
    assert [ends[i] for i in range(2)] == [(r, s) for _, r, s in offline_rows[0]]


def test_chat_choices_are_the_same_offline_and_served(server, llm):
    messages = [{"role": "user", "content": "Tell me about lighthouses."}]
    sp = SamplingParams(n=2, temperature=1.0, seed=5, max_tokens=10, ignore_eos=True)
    offline_texts = [c.text for c in llm.chat(messages, sp, use_tqdm=False)[0].outputs]
    r = httpx.post(server.url + "/v1/chat/completions", timeout=120, json={
        "messages": messages, "n": 2, "temperature": 1.0, "seed": 5, "max_tokens": 10, "ignore_eos": True})
    assert r.status_code == 200, r.text
    served_texts = [c["message"]["content"] for c in sorted(r.json()["choices"], key=lambda c: c["index"])]
    assert offline_texts == served_texts and offline_texts[0] != offline_texts[1]


def test_fan_out_gives_each_choice_its_own_seed_within_int64():
    seeds = [sp.seed for sp in fan_out(SamplingParams(n=3, seed=NEAR_INT64_MAX), 3)]
    assert seeds == [2**63 - 2, 2**63 - 1, -(2**63)]
    assert all(sp.n == 1 for sp in fan_out(SamplingParams(n=3, seed=1), 3))
    assert [sp.seed for sp in fan_out(SamplingParams(n=2), 2)] == [None, None]  # unseeded stays unseeded
