"""The prefix cache: chained hashes verified against stored tokens, LRU reuse of freed cached blocks,
reference counts under sharing, reset, random traffic with preemption and aborts, and hit rates on a
shared-prefix workload."""

from __future__ import annotations

import random
from collections import Counter

import pytest

from kvloom import LLM, SamplingParams
from kvloom.core.engine.kv_cache import KVCacheManager
from kvloom.core.engine.request import Request
from kvloom.core.engine.scheduler import Scheduler
from kvloom.plugins.builtin.fcfs import FCFSPolicy
from kvloom.plugins.builtin.free_list import FreeListAllocator
from kvloom.plugins.builtin.prefix_cache import HashPrefixCache
from kvloom.plugins.builtin.priority import PriorityPolicy
from kvloom.plugins.builtin.sjf import ShortestPromptFirstPolicy
from tests.plugins.scheduler_sim import FakeClock, sampled

BS = 4


def make_kv(num_blocks: int = 8, hash_algorithm: str = "sha256") -> KVCacheManager:
    return KVCacheManager(FreeListAllocator(num_blocks), BS, HashPrefixCache(BS, hash_algorithm))


def request(tokens: list[int], rid: str = "r") -> Request:
    return Request(rid, tokens, SamplingParams(max_tokens=4), max_tokens=4)


def compute(kv: KVCacheManager, req: Request) -> list[int]:
    """Admit ``req`` (with whatever the cache has) and compute its whole prompt, as the scheduler would."""
    hit = kv.get_computed_blocks(req)
    req.num_computed_tokens = len(hit) * BS
    new = req.num_tokens - req.num_computed_tokens
    assert kv.allocate_slots(req, new, hit)
    req.num_computed_tokens += new
    kv.cache_blocks(req, new)
    return hit


@pytest.mark.parametrize("hash_algorithm", ["sha256", "builtin"])
def test_hits_follow_the_chain_and_never_cover_the_last_token(hash_algorithm):
    kv = make_kv(hash_algorithm=hash_algorithm)
    a = request(list(range(10, 22)), "a")  # three full blocks
    assert compute(kv, a) == []
    # The same prompt: two blocks come from the cache, the last block is recomputed for its logits.
    assert kv.get_computed_blocks(request(list(range(10, 22)))) == a.block_ids[:2]
    # A longer prompt with the same start gets all three blocks.
    assert kv.get_computed_blocks(request(list(range(10, 22)) + [1, 2])) == a.block_ids[:3]
    # Same second block after a different first block: no hit, the hash chains the whole prefix.
    assert kv.get_computed_blocks(request([99, 11, 12, 13] + list(range(14, 22)) + [1])) == []


def test_a_hash_collision_is_caught_by_the_stored_tokens():
    kv = make_kv()
    kv.prefix_cache._hash = lambda parent, tokens, extra: 42  # every block collides
    compute(kv, request(list(range(10, 22)), "a"))
    assert kv.get_computed_blocks(request(list(range(50, 62)))) == []


def test_freed_cached_blocks_are_reused_last_and_forgotten_when_reused():
    kv = make_kv(num_blocks=6)
    a = request(list(range(10, 24)), "a")  # 14 tokens: 3 full blocks + 1 partial
    compute(kv, a)
    prefix = a.block_ids[:3]
    kv.free(a)
    again = list(range(10, 24)) + [1]
    other = request([1] * 12, "b")
    assert compute(kv, other) == []  # takes the 2 never-used blocks and a's partial block first
    assert not set(other.block_ids) & set(prefix)
    assert kv.get_computed_blocks(request(again)) == prefix
    third = request([2] * 8, "c")
    compute(kv, third)  # now the free queue is down to a's cached blocks: the last two are evicted
    assert set(third.block_ids) == set(prefix[1:])
    assert kv.get_computed_blocks(request(again)) == prefix[:1]


def test_shared_blocks_stay_allocated_until_every_holder_frees_them():
    kv = make_kv(num_blocks=8)
    a = request(list(range(10, 23)), "a")
    compute(kv, a)
    b = request(list(range(10, 23)) + [7, 7], "b")
    assert compute(kv, b) == a.block_ids[:3]
    shared = a.block_ids[:3]
    assert all(kv.allocator.ref_count(blk) == 2 for blk in shared)
    kv.free(a)
    assert kv.num_free_blocks() == 8 - len(b.block_ids)  # a's shared blocks are still b's
    assert kv.reset_prefix_cache() is False  # blocks in use: nothing is reset
    kv.free(b)
    assert kv.num_free_blocks() == 8
    assert kv.get_computed_blocks(request(list(range(10, 23)))) == shared
    assert kv.reset_prefix_cache() is True
    assert kv.get_computed_blocks(request(list(range(10, 23)))) == []


def test_hit_rate_on_a_shared_prefix_workload(tiny_llama):
    rng = random.Random(1)
    system = [rng.randrange(3, 384) for _ in range(40)]  # five full blocks of 8
    prompts = [system + [rng.randrange(3, 384) for _ in range(5 + i)] for i in range(6)]
    params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    llm = LLM(str(tiny_llama), plugins=["prefix_cache"], block_size=8, num_kv_blocks=64)
    first = llm.generate(prompts[:1], params, use_tqdm=False)
    rest = llm.generate(prompts[1:], params, use_tqdm=False)
    assert first[0].num_cached_tokens == 0
    assert [o.num_cached_tokens for o in rest] == [40] * 5
    stats = llm.engine.stats()
    assert stats.prefix_cache_queries == sum(map(len, prompts))
    assert stats.prefix_cache_hits == 200
    assert stats.prefix_cache_hit_rate == pytest.approx(200 / sum(map(len, prompts)))

    plain = LLM(str(tiny_llama), block_size=8, num_kv_blocks=64)
    assert [o.token_ids for o in plain.generate(prompts[1:], params, use_tqdm=False)] == [o.token_ids for o in rest]
    assert plain.engine.stats().prefix_cache_queries == 0 and plain.engine.reset_prefix_cache() is False

    assert llm.engine.reset_prefix_cache() is True
    assert llm.generate(prompts[1:2], params, use_tqdm=False)[0].num_cached_tokens == 0


@pytest.mark.parametrize("policy", [FCFSPolicy(), PriorityPolicy(), ShortestPromptFirstPolicy(aging_tokens_per_s=50)],
                         ids=["fcfs", "priority", "sjf"])
def test_random_workloads_never_read_foreign_kv_or_leak_blocks(policy):
    """Random shared-prefix traffic with aborts through the scheduler, over a small pool (so requests
    are preempted and chunked), with a fake KV store: every position a request treats as computed must
    hold that request's own token, and each block's reference count must equal its holders."""
    hits = preemptions = 0
    for seed in range(30):
        rng = random.Random(seed)
        num_blocks = rng.randrange(12, 30)
        kv = KVCacheManager(FreeListAllocator(num_blocks), BS, HashPrefixCache(BS, rng.choice(["sha256", "builtin"])))
        clock = FakeClock()
        sched = Scheduler(kv, policy, max_num_seqs=rng.randrange(1, 6), max_num_batched_tokens=rng.randrange(4, 40),
                          max_model_len=10_000, clock=clock)
        prefixes = [[rng.randrange(3, 9) for _ in range(rng.randrange(0, 20))] for _ in range(3)]
        kv_store: dict[int, int] = {}  # slot -> the token whose KV it holds
        for i in range(200):
            if rng.random() < 0.3:
                prompt = rng.choice(prefixes) + [rng.randrange(3, 9) for _ in range(rng.randrange(1, 10))]
                max_tokens = rng.randrange(1, 10)
                if kv.blocks_for(len(prompt) + max_tokens) <= num_blocks:  # what EngineCore admits
                    sched.add_request(Request(f"r{i}", prompt, SamplingParams(max_tokens=max_tokens, ignore_eos=True),
                                              priority=rng.randrange(3), arrival_time=clock(), max_tokens=max_tokens))
            if rng.random() < 0.05 and sched.requests:
                sched.abort([rng.choice(list(sched.requests))])
            plan = sched.schedule()
            for s in plan.seqs:
                req = sched.requests[s.request_id]
                slots = [s.block_ids[p // BS] * BS + p % BS for p in range(s.start_pos + s.num_new_tokens)]
                assert s.start_pos == req.num_computed_tokens
                assert [kv_store.get(slot) for slot in slots[: s.start_pos]] == req.all_token_ids[: s.start_pos]
                for p in range(s.start_pos, len(slots)):
                    kv_store[slots[p]] = req.all_token_ids[p]
            sched.update(plan, sampled(plan, lambda: rng.randrange(3, 9)))
            clock.now += 0.01
            holders = Counter(b for req in sched.running for b in req.block_ids)
            assert all(not req.block_ids for req in sched.waiting)
            assert [kv.allocator.ref_count(b) for b in range(num_blocks)] == [holders[b] for b in range(num_blocks)]
        hits += sched.prefix_cache_hits
        preemptions += sched.num_preemptions
    assert hits > 0 and preemptions > 0  # the workload did exercise both
