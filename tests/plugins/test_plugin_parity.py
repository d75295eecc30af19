"""Greedy parity with Hugging Face transformers with prefix caching on: cache hits, preemption and
chunked prefill together, under every scheduler plugin, and hits on each model family."""

from __future__ import annotations

import random

import pytest

from kvloom import LLM, SamplingParams
from tests.conftest import hf_greedy

MAX_NEW = 12
SCHEDULERS = ["fcfs", "priority", "sjf"]


def _shared_prefix_prompts() -> list[list[int]]:
    """Prompts sharing a 37-token prefix (blocks of 8), one that is a whole-block prefix of the others,
    one that ends inside the shared prefix, and two identical ones."""
    rng = random.Random(0)
    prefix = [rng.randrange(3, 384) for _ in range(37)]
    tails = [[rng.randrange(3, 384) for _ in range(k)] for k in (0, 3, 11, 20, 27)]
    return [prefix + t for t in tails] + [prefix[:16], prefix[:24] + [5], prefix + tails[2]]


def _generate_twice(llm: LLM, prompts: list[list[int]], priority: list[int] | int = 0):
    """Two passes over the prompts: the second is served largely from the cache."""
    params = SamplingParams(temperature=0.0, max_tokens=MAX_NEW, ignore_eos=True)
    return [llm.generate(prompts, params, priority=priority, use_tqdm=False) for _ in range(2)]


@pytest.fixture(scope="module")
def llama_reference(tiny_llama):
    prompts = _shared_prefix_prompts()
    return tiny_llama, prompts, hf_greedy(tiny_llama, prompts, MAX_NEW)


@pytest.mark.parametrize("scheduler", SCHEDULERS)
def test_parity_with_prefix_hits_preemption_and_chunked_prefill(llama_reference, scheduler):
    path, prompts, expected = llama_reference
    # 14 blocks of 8 cannot hold every sequence (preemption); 24 tokens a step split prompts (chunks).
    llm = LLM(str(path), plugins=["prefix_cache", scheduler], block_size=8, num_kv_blocks=14,
              max_num_batched_tokens=24)
    passes = _generate_twice(llm, prompts, priority=list(range(len(prompts)))[::-1])
    for outs in passes:
        assert [o.token_ids for o in outs] == expected
    stats = llm.engine.stats()
    assert stats.num_preemptions > 0
    assert all(sum(o.num_cached_tokens for o in outs) > 0 for outs in passes)
    assert stats.prefix_cache_hits == sum(o.num_cached_tokens for outs in passes for o in outs)
    assert llm.engine.kv.num_free_blocks() == 14  # every block came back, shared ones included


def test_parity_with_prefix_hits_on_each_family(tiny_model):
    prompts = _shared_prefix_prompts()
    expected = hf_greedy(tiny_model, prompts, MAX_NEW)
    from kvloom.core.engine.kv_layout import model_kv_layout
    from kvloom.core.model.loader import load_hf_config

    layout = model_kv_layout(load_hf_config(tiny_model))  # 64 blocks of every layer: a hybrid cache's blocks
    blocks = 64 * layout.num_layers // layout.slots  # hold fewer layers each, so as much memory is more of them
    llm = LLM(str(tiny_model), plugins=["prefix_cache"], block_size=8, num_kv_blocks=blocks)
    first, second = _generate_twice(llm, prompts)
    assert [o.token_ids for o in first] == expected
    assert [o.token_ids for o in second] == expected
    # Second pass: each prompt's full blocks, short of the last token, come from the cache.
    assert [o.num_cached_tokens for o in second] == [(len(p) - 1) // 8 * 8 for p in prompts]
