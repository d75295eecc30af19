"""Prompt logprobs (what lm-eval-harness's loglikelihood tasks read through ``echo`` + ``logprobs``): the
engine scores every prompt token in the prefill, equal to transformers' log_softmax on the same float32
model, whether the prompt is prefilled in one step or in chunks, and also when its prefix is cached."""

from __future__ import annotations

import pytest
import torch

from kvloom.core.config import EngineConfig
from kvloom.core.engine_core import EngineCore
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


def run(engine: EngineCore, requests: list[AddRequest]) -> dict[str, list]:
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
    engine = EngineCore(EngineConfig(model=str(tiny_llama), device="cpu", dtype="float32", num_kv_blocks=64,
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
    engine = EngineCore(EngineConfig(model=str(tiny_llama), device="cpu", dtype="float32", num_kv_blocks=64))
    out = run(engine, [AddRequest(request_id="z", prompt_token_ids=PROMPT[:10],
                                  sampling=SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=0))])
    lps = out["z"][0].prompt_logprobs
    assert len(lps) == 9 and all(lp.top == [] for lp in lps)
    want = expected[:9].gather(1, torch.tensor(PROMPT[1:10])[:, None])[:, 0]
    assert torch.allclose(torch.tensor([lp.logprob for lp in lps]), want, atol=1e-4)


def test_prompt_logprobs_out_of_range_is_refused():
    with pytest.raises(ValueError, match=r"prompt_logprobs=21 must be in \[0, 20\]"):
        SamplingParams(prompt_logprobs=21)
