"""Several prompt-scoring requests in one step (what lm-eval-harness sends at ``batch_size`` > 1 and
``num_concurrent`` > 1): each request's prompt logprobs equal transformers' log_softmax and the same
request's scores sent alone, and the tokens each generates equal greedy transformers', with whole and
chunked prompts, plain generation beside them, the prefix cache, async scheduling and two TP ranks."""

from __future__ import annotations

import random

import pytest
import torch

from kvloom import LLM
from kvloom.core.config import EngineConfig
from kvloom.core.sampling_params import SamplingParams
from tests.conftest import hf_greedy
from tests.test_compat_prompt_logprobs import hf_prompt_logprobs

MAX_TOKENS = 3


def _prompts(seed: int, lengths: list[int]) -> list[list[int]]:
    rng = random.Random(seed)
    return [[1] + [rng.randrange(3, 384) for _ in range(n - 1)] for n in lengths]


def _scores(out) -> torch.Tensor:
    return torch.tensor([lp.logprob for lp in out.prompt_logprobs])


def _check(outs, prompts, params, path, alone=None):
    assert [o.token_ids for o in outs] == hf_greedy(path, prompts, MAX_TOKENS)
    for i, (out, prompt, p) in enumerate(zip(outs, prompts, params)):
        if p.prompt_logprobs is None:
            assert out.prompt_logprobs is None
            continue
        assert [lp.token_id for lp in out.prompt_logprobs] == prompt[1:]
        want = hf_prompt_logprobs(path, prompt).gather(1, torch.tensor(prompt[1:])[:, None])[:, 0]
        torch.testing.assert_close(_scores(out), want, atol=1e-4, rtol=0)
        if alone is not None:
            torch.testing.assert_close(_scores(out), _scores(alone[i]), atol=1e-5, rtol=0)


# Budgets: every prompt whole in one step (the rows kept are exactly as many as the step's rows, in
# another order); chunks that split prompts over steps; the async scheduler beside both.
@pytest.mark.parametrize("budget,async_scheduling,plugins", [
    (4096, "off", []), (4096, "on", ["prefix_cache"]), (24, "off", ["prefix_cache"]), (13, "on", []),
], ids=["whole", "whole-async-prefix-cache", "chunks-of-24-prefix-cache", "chunks-of-13-async"])
def test_scoring_requests_sharing_a_step_equal_transformers_and_each_alone(tiny_llama, budget,
                                                                            async_scheduling, plugins):
    prompts = _prompts(7, [11, 17, 6, 23, 9, 14])
    score = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True, prompt_logprobs=1)
    plain = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    params = [score, score, plain, score, score, plain]
    llm = LLM(config=EngineConfig(model=str(tiny_llama), dtype="float32", block_size=8, num_kv_blocks=128,
                                  max_num_batched_tokens=budget, async_scheduling=async_scheduling,
                                  plugins=plugins))
    alone = [llm.generate([p], [sp], use_tqdm=False)[0] for p, sp in zip(prompts, params)]
    together = llm.generate(prompts, params, use_tqdm=False)
    _check(together, prompts, params, tiny_llama, alone)
    if "prefix_cache" in plugins:  # the same batch again, its prefixes cached: the scores do not change
        _check(llm.generate(prompts, params, use_tqdm=False), prompts, params, tiny_llama, alone)


def test_every_request_scoring_its_whole_prompt_in_one_step(tiny_llama):
    """Only scoring requests, each kept row count equal to its prompt length: the step keeps every row,
    scoring rows first, which must not be read as 'keep everything in order'."""
    prompts = _prompts(3, [8, 8, 5])
    params = [SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True, prompt_logprobs=0)] * 3
    llm = LLM(config=EngineConfig(model=str(tiny_llama), dtype="float32", block_size=8, num_kv_blocks=64))
    _check(llm.generate(prompts, params, use_tqdm=False), prompts, params, tiny_llama)


def test_tp2_scoring_requests_sharing_a_step(tiny_llama):
    prompts = _prompts(5, [12, 19, 7, 15])
    score = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True, prompt_logprobs=2)
    plain = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    params = [score, score, plain, score]
    llm = LLM(config=EngineConfig(model=str(tiny_llama), tensor_parallel_size=2, dtype="float32", block_size=8,
                                  num_kv_blocks=96, max_num_batched_tokens=4096))
    try:
        _check(llm.generate(prompts, params, use_tqdm=False), prompts, params, tiny_llama)
    finally:
        llm.engine.shutdown()
