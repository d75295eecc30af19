"""The runner's host inputs: the block tables kept between steps, the numpy-built inputs against a plain
per-token construction, and the one-copy staging of a step's arrays (the CUDA path's) on the CPU."""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch

from kvloom import LLM, SamplingParams
from kvloom.core.engine.step import ScheduledSeq
from kvloom.core.worker.model_runner import BlockTables, ModelRunner
from tests.conftest import hf_greedy

SP = SamplingParams(temperature=0.0, max_tokens=4)


def _seq(rid, blocks, tokens=(7,), start=0, rows=1, drafts=(), targets=None):
    return ScheduledSeq(rid, list(tokens), start, list(blocks), rows, SP, draft_token_ids=list(drafts),
                        prompt_targets=targets)


def _table(tables: BlockTables, seqs) -> list[list[int]]:
    rows = tables.rows(seqs)
    return [tables.array[r, : len(s.block_ids)].tolist() for r, s in zip(rows, seqs)]


def test_block_tables_follow_appends_rewrites_trims_and_releases():
    t = BlockTables()
    assert _table(t, [_seq("a", [3, 4]), _seq("b", [9])]) == [[3, 4], [9]]
    row_a = t.rows([_seq("a", [3, 4])])[0]
    assert _table(t, [_seq("a", [3, 4, 5])]) == [[3, 4, 5]]  # a new block at the end
    assert _table(t, [_seq("a", [8, 2])]) == [[8, 2]]  # preempted and re-admitted: other blocks
    assert t.array[row_a, 2] == 0  # the rest of the row is padding again
    assert _table(t, [_seq("a", [8])]) == [[8]]  # rejected drafts gave a block back
    assert t.array[row_a, 1] == 0
    t.release(["a", "unknown"])
    assert not t.array[row_a].any()
    assert _table(t, [_seq("c", [1, 1, 1])]) == [[1, 1, 1]]  # a released row is reused, clean
    assert _table(t, [_seq("b", [9])]) == [[9]]


def test_block_tables_grow_and_drop_requests_gone_without_release():
    t = BlockTables()
    wide = list(range(1, 200))  # wider than the first array
    seqs = [_seq(f"r{i}", wide[: 1 + i % 199]) for i in range(300)]  # more rows than the first array
    assert _table(t, seqs) == [s.block_ids for s in seqs]
    for _ in range(3):  # a draft runner is never told what finished: old rows are dropped once they pile up
        seqs = [_seq(f"n{random.random()}", [5, 6]) for _ in range(300)]
        assert _table(t, seqs) == [[5, 6]] * 300
    assert len(t._row) <= 2 * 300 + 512 + 300


def _reference_inputs(order, bs):
    """The plain construction, one token at a time (what the runner built before numpy)."""
    ids, pos, slots, qsl, seq_lens, qlens, keep, prompt_rows = [], [], [], [0], [], [], [], []
    for s in order:
        n = len(s.token_ids)
        if s.prompt_targets:
            prompt_rows.extend(range(qsl[-1], qsl[-1] + len(s.prompt_targets)))
        ids.extend(s.token_ids)
        for p in range(s.start_pos, s.start_pos + n):
            pos.append(p)
            slots.append(s.block_ids[p // bs] * bs + p % bs)
        qsl.append(qsl[-1] + n)
        seq_lens.append(s.start_pos + n)
        qlens.append(n)
        keep.extend(range(qsl[-1] - s.num_sample_rows, qsl[-1]))
    width = max(len(s.block_ids) for s in order)
    table = [s.block_ids + [0] * (width - len(s.block_ids)) for s in order]
    return ids, pos, slots, qsl, seq_lens, qlens, prompt_rows + keep, table


def _random_step(rng, bs, step):
    seqs = []
    for i in range(rng.randrange(1, 12)):
        kind = rng.choice(["decode", "chunk", "last_chunk", "verify", "scored"])
        start = rng.randrange(0, 60)
        n = 1 if kind == "decode" else rng.randrange(1, 9)
        blocks = rng.sample(range(500), -(-(start + n) // bs) + rng.randrange(0, 2))
        tokens = [rng.randrange(0, 300) for _ in range(n)]
        drafts = tokens[1:] if kind == "verify" else []
        rows = 0 if kind == "chunk" else (1 + len(drafts))
        targets = tokens[: rng.randrange(1, n + 1)] if kind == "scored" else None
        seqs.append(_seq(f"s{step % 3}-{i}", blocks, tokens, start, rows, drafts, targets))
    return seqs


def test_flat_inputs_equal_the_per_token_construction():
    runner = ModelRunner(None, [], 4, torch.device("cpu"))
    rng = random.Random(0)
    for step in range(200):  # request ids recur across steps with other blocks: rows are rewritten
        order = _random_step(rng, 4, step)
        got = runner._host_inputs(order)
        want = _reference_inputs(order, 4)
        for g, w in zip(got, want):
            assert np.asarray(g).tolist() == w


def test_decode_rows_equal_the_per_token_construction():
    runner = ModelRunner(None, [], 4, torch.device("cpu"))
    rng = random.Random(1)
    for step in range(200):
        seqs = [s for s in _random_step(rng, 4, step) if s.num_sample_rows == len(s.token_ids) or len(s.token_ids) == 1]
        if not seqs:
            continue
        ids, pos, slots, seq_lens, table, rows, groups, lora_slots = runner._decode_rows(seqs)
        assert groups == []  # one layer group
        assert lora_slots is None  # a runner without adapters
        want_ids, want_pos, want_slots, want_table, want_rows = [], [], [], [], []
        for s in seqs:
            if s.samples:
                want_rows.extend(range(len(want_ids), len(want_ids) + len(s.token_ids)))
            for i, t in enumerate(s.token_ids):
                p = s.start_pos + i
                want_ids.append(max(t, 0))
                want_pos.append(p)
                want_slots.append(s.block_ids[p // 4] * 4 + p % 4)
                want_table.append(s.block_ids)
        width = max(len(b) for b in want_table)
        assert ids.tolist() == want_ids and pos.tolist() == want_pos and slots.tolist() == want_slots
        assert seq_lens.tolist() == [p + 1 for p in want_pos] and rows.tolist() == want_rows
        assert table.tolist() == [b + [0] * (width - len(b)) for b in want_table]


def test_each_layer_group_of_a_hybrid_cache_gets_its_own_slots_and_tables():
    """A hybrid KV cache: the second group's tables (other blocks, the same positions) become its own slots and
    table, in both layouts, and rows of the two groups' tables never mix; with adapters served, each token
    also carries its request's adapter slot."""
    # Building host inputs reads only whether adapters are served, not the pool itself.
    runner = ModelRunner(None, [], 4, torch.device("cpu"), num_kv_groups=2, lora=object())
    rng = random.Random(2)
    for step in range(100):
        seqs = _random_step(rng, 4, step)
        for s in seqs:
            s.extra_block_ids = [[b + 1000 for b in s.block_ids]]
            s.lora_slot = rng.randrange(-1, 3)
        want_lora = [s.lora_slot for s in seqs for _ in s.token_ids]
        got = runner._host_inputs(seqs)
        (g_slots, _), (g_table, _) = got[-2]
        assert got[-1].tolist() == want_lora
        want_slots = [s.extra_block_ids[0][p // 4] * 4 + p % 4 for s in seqs
                      for p in range(s.start_pos, s.start_pos + len(s.token_ids))]
        width = max(len(s.block_ids) for s in seqs)
        assert np.asarray(g_slots).tolist() == want_slots
        assert np.asarray(g_table).tolist() == [s.extra_block_ids[0] + [0] * (width - len(s.block_ids)) for s in seqs]
        assert np.asarray(got[7]).tolist() == [s.block_ids + [0] * (width - len(s.block_ids)) for s in seqs]
        decodes = [s for s in seqs if s.num_sample_rows == len(s.token_ids) or len(s.token_ids) == 1]
        if decodes:
            *_, groups, lora_slots = runner._decode_rows(decodes)
            (g_slots, _), (g_table, _) = groups
            assert lora_slots.tolist() == [s.lora_slot for s in decodes for _ in s.token_ids]
            per_token = [s.extra_block_ids[0] + [0] * (width - len(s.block_ids)) for s in decodes for _ in s.token_ids]
            assert np.asarray(g_table).tolist() == [row[: np.asarray(g_table).shape[1]] for row in per_token]


def test_a_plan_whose_blocks_do_not_hold_its_positions_is_refused():
    runner = ModelRunner(None, [], 4, torch.device("cpu"))
    short = [_seq("ok", [1, 2], tokens=[5] * 8), _seq("short", [3], tokens=[5, 6], start=3)]
    for build in (runner._host_inputs, runner._decode_rows):
        with pytest.raises(ValueError, match="request 'short' feeds positions up to 4 with 1 blocks of 4 tokens"):
            build(short)


def test_staged_arrays_keep_their_values_dtypes_and_alignment():
    runner = ModelRunner(None, [], 4, torch.device("cpu"))
    runner.stage_in_one_copy = True
    a, b, c, d = runner._stage(([1, -2, 3], np.int64), ([[1, 2], [3, 4]], np.int32), ([], np.int64),
                               (range(5), np.int32))
    assert a.dtype == torch.int64 and a.tolist() == [1, -2, 3]
    assert b.dtype == torch.int32 and b.tolist() == [[1, 2], [3, 4]] and b.is_contiguous()
    assert c.dtype == torch.int64 and c.shape == (0,)
    assert d.tolist() == list(range(5))
    assert a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr()  # one buffer, one copy
    base = a.untyped_storage().data_ptr()  # the caching allocators align a whole buffer (CUDA: 512 bytes)
    assert all((t.data_ptr() - base) % 256 == 0 for t in (a, b, d))


@pytest.mark.parametrize("options", [dict(async_scheduling="on", max_num_batched_tokens=7, block_size=8,
                                          num_kv_blocks=14, plugins=["prefix_cache"]),
                                     dict(plugins=["spec_decode"],
                                          plugin_options={"spec_decode": {"num_speculative_tokens": 3,
                                                                          "prompt_lookup_min": 1}})])
def test_greedy_outputs_with_inputs_staged_in_one_copy(tiny_llama, options):
    """The CUDA path's staging (one buffer, views of it) on the CPU, with placeholders filled from the
    previous step (async scheduling), chunked prefill, preemption and verify steps: transformers' tokens."""
    rng = random.Random(0)
    prompts = [[rng.randrange(3, 384) for _ in range(k)] for k in (1, 5, 16, 17, 33, 70)]
    expected = hf_greedy(tiny_llama, prompts, 20)
    llm = LLM(str(tiny_llama), **options)
    llm.engine.runner.stage_in_one_copy = True
    llm.engine.runner.verify_as_decodes = "spec_decode" in options["plugins"]
    staged = []
    stage = llm.engine.runner._stage
    llm.engine.runner._stage = lambda *arrays: staged.append(len(arrays)) or stage(*arrays)
    outs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True), use_tqdm=False)
    assert [o.token_ids for o in outs] == expected
    assert staged
    if options.get("async_scheduling") == "on":
        assert llm.engine.scheduler.num_preemptions > 0 and llm.engine.num_overlapped_steps > 0
    else:
        assert llm.engine.stats().spec_decode_num_accepted > 0
