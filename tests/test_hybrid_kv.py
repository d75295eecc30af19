"""The hybrid KV cache: layers grouped by attention window, each group with its own block tables over one
pool; a sliding layer keeps only the blocks its window can still read and gives the rest back while its
request runs (same tokens as keeping them); capacity, the start-up ``KV cache:`` line and ``engine plan``
count blocks per group."""

from __future__ import annotations

import json
import logging
import random

import pytest

from kvloom import LLM, SamplingParams
from kvloom.core.engine.kv_cache import KVCacheManager
from kvloom.core.engine.kv_layout import kv_layout
from kvloom.core.engine.request import Request
from kvloom.core.sampling_params import SamplingParams as Params
from kvloom.plugins.builtin.free_list import FreeListAllocator
from kvloom.plugins.builtin.prefix_cache import HashPrefixCache
from tests.conftest import hf_greedy, make_tiny_model


def test_layers_group_by_window_in_groups_of_the_smallest_count():
    # Gemma 3 12B: 48 layers, five local (1024) to one global: 5 sliding groups and 1 full one of 8 layers
    windows = [None if (i + 1) % 6 == 0 else 1024 for i in range(48)]
    layout = kv_layout(windows)
    assert [g.window for g in layout.groups] == [None] + [1024] * 5 and layout.slots == 8
    assert layout.groups[0].layers == (5, 11, 17, 23, 29, 35, 41, 47)
    assert sorted(i for g in layout.groups for i in g.layers) == list(range(48))
    slots, groups = layout.slot_of_layer(), layout.group_of_layer()
    assert len({(groups[i], slots[i]) for i in range(48)}) == 48  # each layer its own (group, tensor) place
    # every layer sliding (Mistral v0.1): one group that gives blocks back; no window: one plain group
    assert kv_layout([4096] * 32).hybrid and kv_layout([4096] * 32).slots == 32
    assert not kv_layout([None] * 32).hybrid and not kv_layout(windows, hybrid=False).hybrid
    # a sequence holds its full group's blocks and each sliding group's window (1024 / 16 + 1 blocks)
    assert layout.sequence_blocks(16 * 1000, 16) == 1000 + 5 * 65


def _manager(windows, num_blocks=64, bs=4, prefix=False):
    cache = HashPrefixCache(bs, "builtin") if prefix else None
    return KVCacheManager(FreeListAllocator(num_blocks), bs, cache, kv_layout(windows))


def _run(kv, req, tokens_per_step):
    """Schedule ``req`` step by step as the scheduler does: allocate, compute, cache the full blocks."""
    while req.num_computed_tokens < req.num_tokens:
        n = min(tokens_per_step, req.num_tokens - req.num_computed_tokens)
        assert kv.allocate_slots(req, n)
        req.num_computed_tokens += n
        kv.cache_blocks(req, n)


def test_sliding_groups_give_back_blocks_outside_the_window_as_the_request_runs():
    kv = _manager([None, None, 6, 6])  # a full group and a sliding one, of two layers each
    req = Request("a", list(range(40)), Params(max_tokens=4), max_tokens=4)
    _run(kv, req, 8)
    full, sliding = kv.tables(req)
    assert len(full) == len(sliding) == 10
    assert req.num_skipped_blocks == [0, 6]  # given back on the way: the step at 32 read from 27 (block 6)
    # the next token (position 40) reads positions 35..: blocks 8 and 9 (and its own, 10); 0-7 went back
    assert kv.allocate_slots(req, 1)
    assert req.num_skipped_blocks == [0, 8] and kv.num_window_freed == 8
    assert kv.num_free_blocks() == 64 - 11 - 3
    kv.trim(req, 40)  # a rejected draft's block goes back in both groups
    assert kv.num_free_blocks() == 64 - 10 - 2
    kv.free(req)
    assert kv.num_free_blocks() == 64


def test_a_prefix_hit_needs_only_the_windows_blocks_of_a_sliding_group():
    kv = _manager([None, 6], prefix=True)
    first = Request("a", list(range(40)), Params(max_tokens=1), max_tokens=1)
    _run(kv, first, 8)
    assert kv.allocate_slots(first, 1)  # gives blocks 0-7 of the sliding group back (cached, kept)
    window = kv.tables(first)[1][8:10]
    kv.free(first)
    second = Request("b", list(range(40)) + [7, 7], Params(max_tokens=1), max_tokens=1)
    hit = kv.get_computed_blocks(second)
    assert len(hit) == 10  # every full block: the next token (40) reads 35..39 of the sliding group
    assert hit.skipped == [0, 8]
    assert kv.allocate_slots(second, 2, hit)
    assert kv.tables(second)[1][8:10] == window  # the cached window blocks, revived
    assert second.num_skipped_blocks == [0, 8]
    # a sliding block inside the window evicted: the hit stops where the window's blocks are all there
    kv.free(second)
    evicted = HashPrefixCache.cached_block(kv.prefix_cache, second, 1, 9)
    kv.prefix_cache.evict(evicted)
    third = Request("c", list(range(40)) + [5], Params(max_tokens=1), max_tokens=1)
    hit = kv.get_computed_blocks(third)
    assert len(hit) == 9 and hit.skipped == [0, (36 - 6 + 1) // 4]


@pytest.fixture(scope="module")
def gemma3(tmp_path_factory):
    return make_tiny_model(tmp_path_factory.mktemp("gemma3"), "gemma3_text")


def test_sliding_layer_blocks_return_to_the_pool_while_the_request_runs(gemma3):
    """Three of the tiny Gemma 3's four layers slide (window 7): while a 120-token prompt and its 30 new
    tokens run in 16-token steps, their blocks before the window go back to the pool and the request
    holds only the window's; the tokens equal transformers' and those of the run that keeps every block."""
    rng = random.Random(3)
    prompts = [[rng.randrange(3, 384) for _ in range(120)], [rng.randrange(3, 384) for _ in range(45)]]
    params = SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True)
    expected = hf_greedy(gemma3, prompts, 30)
    llm = LLM(str(gemma3), block_size=8, max_num_batched_tokens=16, num_kv_blocks=200)
    kv, scheduler = llm.engine.kv, llm.engine.scheduler
    seen = []  # per step: the blocks held by the running requests, against the blocks a full cache holds
    execute = llm.engine.runner.execute

    def observe(plan):
        held = sum(len(t) - k for r in scheduler.running for t, k in zip(kv.tables(r), r.num_skipped_blocks))
        assert kv.num_free_blocks() == kv.num_blocks - held  # every block not held is back in the pool
        full = sum(len(kv.tables(r)) * len(r.block_ids) for r in scheduler.running)
        seen.append((held, full, [list(r.num_skipped_blocks) for r in scheduler.running]))
        return execute(plan)

    llm.engine.runner.execute = observe
    got = [o.token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    assert got == expected
    assert kv.num_window_freed > 0 and kv.num_free_blocks() == kv.num_blocks
    held, full, skipped = seen[-1]
    assert held < full / 2  # near the end the sliding groups hold their windows only
    assert max(max(s[1:]) for _, _, step in seen for s in step if step) >= 15  # 150 tokens: blocks 0..15+ gone
    keep = LLM(str(gemma3), block_size=8, max_num_batched_tokens=16, num_kv_blocks=200, hybrid_kv_cache=False)
    assert [o.token_ids for o in keep.generate(prompts, params, use_tqdm=False)] == expected
    assert keep.engine.kv.num_window_freed == 0


# gemma-3-12b-it's config.json (google/gemma-3-12b-it), its vision tower's settings included
GEMMA3_12B = {
    "architectures": ["Gemma3ForConditionalGeneration"], "model_type": "gemma3", "boi_token_index": 255999,
    "eoi_token_index": 256000, "eos_token_id": [1, 106], "image_token_index": 262144, "initializer_range": 0.02,
    "mm_tokens_per_image": 256, "torch_dtype": "bfloat16",
    "text_config": {
        "model_type": "gemma3_text", "hidden_size": 3840, "intermediate_size": 15360, "num_hidden_layers": 48,
        "num_attention_heads": 16, "num_key_value_heads": 8, "head_dim": 256, "query_pre_attn_scalar": 256,
        "rope_scaling": {"factor": 8.0, "rope_type": "linear"}, "rope_theta": 1000000.0,
        "rope_local_base_freq": 10000.0, "sliding_window": 1024, "sliding_window_pattern": 6,
        "max_position_embeddings": 131072, "vocab_size": 262208, "rms_norm_eps": 1e-06,
        "final_logit_softcapping": None, "attn_logit_softcapping": None},
    "vision_config": {"model_type": "siglip_vision_model", "hidden_size": 1152, "image_size": 896,
                      "intermediate_size": 4304, "num_attention_heads": 16, "num_hidden_layers": 27,
                      "patch_size": 14, "vision_use_head": False},
}


def test_engine_plan_and_the_engines_kv_cache_line_agree_on_gemma3_12b(tmp_path, capsys, caplog):
    """``engine plan`` on gemma-3-12b's config.json prints the KV cache line the engine logs at start-up (the
    engine runs the same KV arithmetic on that config, its hidden and MLP sizes shrunk to fit this machine:
    they are no part of it), and the hybrid cache holds about six times the tokens of keeping every layer's."""
    from kvloom.cli.main import main
    from kvloom.core.model.loader import load_hf_config

    folder = tmp_path / "gemma-3-12b-it"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(GEMMA3_12B))
    flags = ["--device", "cpu", "--dtype", "bfloat16", "--kv-cache-memory-gib", "0.25", "--max-model-len", "32768"]
    assert main(["plan", "--config-json", str(folder / "config.json"), *flags, "--json"]) == 0
    plan = json.loads(capsys.readouterr().out)
    line = plan["rows"][0]["kv_cache_line"]
    assert "6 layer groups (1 full attention, 5 sliding window 1024)" in line, line
    assert main(["plan", "--config-json", str(folder / "config.json"), *flags]) == 0
    assert line in capsys.readouterr().out
    assert main(["plan", "--config-json", str(folder / "config.json"), *flags, "--no-hybrid-kv-cache", "--json"]) == 0
    kept = json.loads(capsys.readouterr().out)["rows"][0]
    # blocks of 8 layers instead of 48: six times as many in the same memory (whole blocks of 16 tokens)
    assert 6 * kept["kv_tokens"] <= plan["rows"][0]["kv_tokens"] < 6 * (kept["kv_tokens"] + 16)
    assert plan["rows"][0]["max_concurrency"] > 5 * kept["max_concurrency"]

    config = load_hf_config(folder)
    assert config.num_hidden_layers == 48 and config.sliding_window == 1024
    shrink = {"hidden_size": 32, "intermediate_size": 32, "vocab_size": 512}
    with caplog.at_level(logging.INFO, logger="kvloom"):
        LLM(str(folder), load_format="dummy", device="cpu", dtype="bfloat16", kv_cache_memory_gib=0.25,
            max_model_len=32768, hf_overrides=shrink)
    logged = next(r.getMessage() for r in caplog.records if r.getMessage().startswith("KV cache:"))
    assert logged == line
