"""Greedy token-for-token parity with Hugging Face transformers on tiny random models of each family."""

from __future__ import annotations

import random

import pytest

from kvloom import LLM, SamplingParams
from tests.conftest import hf_greedy

MAX_NEW = 20


def _prompts(n: int = 6, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    lengths = [1, 5, 16, 17, 33, 70][:n]
    return [[rng.randrange(3, 384) for _ in range(k)] for k in lengths]


@pytest.fixture(scope="module")
def reference(tiny_model):
    prompts = _prompts()
    return tiny_model, prompts, hf_greedy(tiny_model, prompts, MAX_NEW)


def _tight(path) -> tuple[int, dict]:
    """Blocks of 8 tokens for the longest sequence (70 + 20 tokens, its prompt in one step) and 2 more: too
    few for all six at once, so some are preempted and recomputed. A hybrid cache's sliding groups hold
    only their windows' blocks; where every layer slides a running sequence never outgrows them (nothing to
    preempt), so those families run preemption with every block kept (their hybrid runs are the others)."""
    from kvloom.core.engine.kv_layout import model_kv_layout
    from kvloom.core.model.loader import load_hf_config

    layout = model_kv_layout(load_hf_config(path))
    options = {} if layout.groups[0].window is None else {"hybrid_kv_cache": False}
    layout = model_kv_layout(load_hf_config(path), not options)
    return layout.sequence_blocks(70 + MAX_NEW, 8, 70) + 2, options


def _same_memory(path, blocks: int) -> int:
    """``blocks`` blocks of every layer, as blocks of a hybrid cache (each of one layer group)."""
    from kvloom.core.engine.kv_layout import model_kv_layout
    from kvloom.core.model.loader import load_hf_config

    layout = model_kv_layout(load_hf_config(path))
    return blocks * layout.num_layers // layout.slots


def _kvloom(path, prompts, **options):
    llm = LLM(str(path), **options)
    params = SamplingParams(temperature=0.0, max_tokens=MAX_NEW, ignore_eos=True)
    outs = llm.generate(prompts, params, use_tqdm=False)
    return llm, [o.token_ids for o in outs]


def test_greedy_parity_one_batch(reference):
    path, prompts, expected = reference
    llm, got = _kvloom(path, prompts)
    assert got == expected
    assert llm.engine.kv.num_free_blocks() == llm.engine.kv.num_blocks  # every block came back


def test_greedy_parity_chunked_prefill(reference):
    path, prompts, expected = reference
    # A budget of 7 tokens a step forces every long prompt through many chunks, mixed with decodes.
    llm, got = _kvloom(path, prompts, max_num_batched_tokens=7, block_size=8)
    assert got == expected


def test_greedy_parity_under_preemption(reference):
    path, prompts, expected = reference
    # 14 blocks of 8 tokens (for full attention) cannot hold all six sequences at once, so some are
    # preempted and recomputed.
    blocks, options = _tight(path)
    llm, got = _kvloom(path, prompts, num_kv_blocks=blocks, block_size=8, **options)
    assert llm.engine.scheduler.num_preemptions > 0
    assert got == expected
    assert llm.engine.kv.num_free_blocks() == blocks


def test_greedy_parity_with_async_scheduling(reference):
    path, prompts, expected = reference
    # The next step is scheduled before the previous one's tokens reach the host: with chunked
    # prefill and preemption the tokens must not change, and every block must come back.
    blocks, options = _tight(path)
    llm, got = _kvloom(path, prompts, async_scheduling="on", max_num_batched_tokens=7, block_size=8,
                       num_kv_blocks=blocks, plugins=["prefix_cache"], **options)
    assert got == expected
    assert llm.engine.scheduler.num_preemptions > 0
    assert llm.engine.kv.num_free_blocks() == blocks
    # With room to keep them, the second pass is served from the prefix cache, still token for token.
    llm, got = _kvloom(path, prompts, async_scheduling="on", max_num_batched_tokens=7, block_size=8,
                       num_kv_blocks=_same_memory(path, 64), plugins=["prefix_cache"])
    again = [o.token_ids for o in llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=MAX_NEW,
                                                                        ignore_eos=True), use_tqdm=False)]
    assert got == expected and again == expected
    assert llm.engine.scheduler.prefix_cache_hits > 0
