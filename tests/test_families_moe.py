"""Greedy token-for-token parity with transformers (float32) on tiny random models of the MoE families
(conftest's MOE_FAMILIES, saved by transformers' own save_pretrained): mixed batches, chunked prefill, the
prefix cache, preemption with async scheduling, n-gram speculative decoding and tensor parallelism on gloo."""

from __future__ import annotations

import random

import pytest

from kvloom import LLM, SamplingParams
from kvloom.core.config import EngineConfig
from kvloom.core.engine.kv_layout import model_kv_layout
from kvloom.core.model.loader import load_hf_config
from tests.conftest import MOE_FAMILIES, hf_greedy, make_tiny_model
from tests.test_parity import _same_memory

MAX_NEW = 20
GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_NEW, ignore_eos=True)


def _prompts(seed: int = 3) -> list[list[int]]:
    """Six prompts of 1 to 70 tokens: two share a 16-token prefix (prefix-cache hits), two repeat a phrase
    (n-gram drafts), the long ones run past every window."""
    rng = random.Random(seed)
    tok = lambda: rng.randrange(3, 384)  # noqa: E731
    shared = [tok() for _ in range(16)]
    phrase = [tok() for _ in range(7)]
    return [[tok()], shared + [tok() for _ in range(5)], phrase * 4, [tok() for _ in range(33)],
            shared + [tok() for _ in range(27)], phrase * 2 + [tok() for _ in range(50)] + phrase[:6]]


def _generate(llm: LLM, prompts) -> list[list[int]]:
    return [o.token_ids for o in llm.generate(prompts, GREEDY, use_tqdm=False)]


@pytest.fixture(scope="module", params=sorted(MOE_FAMILIES))
def moe_reference(request, tmp_path_factory):
    path = make_tiny_model(tmp_path_factory.mktemp(f"moe-{request.param}"), request.param)
    prompts = _prompts()
    return request.param, path, prompts, hf_greedy(path, prompts, MAX_NEW)


def test_mixed_batch_chunked_prefill_and_prefix_cache(moe_reference):
    """All six in one batch; then 7 tokens a step (prefill chunks beside several decodes, across the windows'
    edges), twice, the second pass from the prefix cache."""
    _, path, prompts, expected = moe_reference
    llm = LLM(str(path))
    assert _generate(llm, prompts) == expected
    assert llm.engine.kv.num_free_blocks() == llm.engine.kv.num_blocks
    llm = LLM(str(path), block_size=8, max_num_batched_tokens=7, num_kv_blocks=_same_memory(path, 96),
              plugins=["prefix_cache"])
    assert _generate(llm, prompts) == expected
    assert _generate(llm, prompts) == expected
    assert llm.engine.scheduler.prefix_cache_hits > 0


def test_preemption_with_async_scheduling(moe_reference):
    """Blocks for the longest sequence and two more: too few for all six, so some are preempted and
    recomputed. Every block is kept (a sliding layer's given-back blocks would leave nothing to preempt)."""
    _, path, prompts, expected = moe_reference
    layout = model_kv_layout(load_hf_config(path), False)
    blocks = layout.sequence_blocks(70 + MAX_NEW, 8, 70) + 2
    llm = LLM(str(path), block_size=8, num_kv_blocks=blocks, async_scheduling="on", hybrid_kv_cache=False)
    assert _generate(llm, prompts) == expected
    assert llm.engine.scheduler.num_preemptions > 0
    assert llm.engine.kv.num_free_blocks() == blocks


def test_ngram_spec_decode(moe_reference):
    _, path, prompts, expected = moe_reference
    llm = LLM(str(path), plugins=["spec_decode"],
              plugin_options={"spec_decode": {"num_speculative_tokens": 3, "prompt_lookup_min": 1}})
    assert _generate(llm, prompts) == expected
    stats = llm.engine.stats()
    assert stats.spec_decode_num_drafts > 0  # drafts were verified in the batch
    assert llm.engine.kv.num_free_blocks() == llm.engine.kv.num_blocks


def test_tp2_on_gloo(moe_reference):
    """Two ranks, each with half of every expert's intermediate dim (and of the shared expert, heads and
    sinks), the router whole: chunked, from the prefix cache, with async scheduling."""
    family, path, prompts, expected = moe_reference
    config = EngineConfig(model=str(path), tensor_parallel_size=2, dtype="float32", block_size=8,
                          num_kv_blocks=_same_memory(path, 96), max_num_batched_tokens=7, plugins=["prefix_cache"],
                          async_scheduling="on")
    llm = LLM(config=config)
    try:
        assert _generate(llm, prompts) == expected
        assert _generate(llm, prompts) == expected
        assert llm.engine.scheduler.prefix_cache_hits > 0
        experts = llm.engine.model.moe_blocks()[0].experts
        assert experts.local_intermediate * 2 == experts.intermediate_size
    finally:
        llm.engine.shutdown()
