"""The attention variants of the newer families in the PyTorch reference (the CPU path's oracle and the
Triton kernels'): sliding windows, soft-capped scores and attention sinks, against attention written out
one query and one head at a time the way transformers' eager code for Gemma 2 and gpt-oss computes it."""

from __future__ import annotations

import math

import pytest
import torch

from kvloom.kernels import reference as ref

BS, HKV, GROUP, D = 4, 2, 2, 8


def naive(q, keys, values, q_pos, scale, window=None, softcap=None, sinks=None):
    """``q`` ``[Q, Hq, D]`` at positions ``q_pos`` over one sequence's ``keys``/``values`` ``[S, Hkv, D]``."""
    out = torch.zeros(q.shape, dtype=torch.float64)
    group = q.shape[1] // keys.shape[1]
    for i, pos in enumerate(q_pos):
        seen = [j for j in range(pos + 1) if window is None or j > pos - window]
        for h in range(q.shape[1]):
            kv = h // group
            logits = [float(q[i, h].double() @ keys[j, kv].double()) * scale for j in seen]
            if softcap is not None:
                logits = [math.tanh(x / softcap) * softcap for x in logits]
            extra = [float(sinks[h])] if sinks is not None else []
            top = max(logits + extra)  # gpt-oss subtracts the max over the scores and the sink
            weights = [math.exp(x - top) for x in logits]
            denom = sum(weights) + sum(math.exp(x - top) for x in extra)
            for w, j in zip(weights, seen):
                out[i, h] += (w / denom) * values[j, kv].double()
    return out.float()


def paged(seqs, num_blocks=24, seed=0):
    """Dense K/V per sequence and the same K/V in a shuffled paged cache."""
    gen = torch.Generator().manual_seed(seed)
    perm = torch.randperm(num_blocks, generator=gen).tolist()
    k_cache = torch.randn(num_blocks, BS, HKV, D, generator=gen)  # unused slots hold noise
    v_cache = torch.randn(num_blocks, BS, HKV, D, generator=gen)
    dense, tables, used = [], [], 0
    for s_len in seqs:
        n = -(-s_len // BS)
        blocks, used = perm[used: used + n], used + n
        k = torch.randn(s_len, HKV, D, generator=gen)
        v = torch.randn(s_len, HKV, D, generator=gen)
        for p in range(s_len):
            k_cache[blocks[p // BS], p % BS], v_cache[blocks[p // BS], p % BS] = k[p], v[p]
        dense.append((k, v))
        tables.append(blocks + [0] * (max(-(-s // BS) for s in seqs) - n))
    return k_cache, v_cache, torch.tensor(tables, dtype=torch.int32), dense


VARIANTS = [dict(window=3), dict(window=7), dict(softcap=1.5), dict(sinks=True),
            dict(window=5, softcap=2.0, sinks=True)]


@pytest.mark.parametrize("variant", VARIANTS, ids=str)
def test_prefill_variants_match_attention_written_out(variant):
    variant = dict(variant)
    sinks = torch.randn(HKV * GROUP) * 2 if variant.pop("sinks", False) else None
    query_lens, seq_lens = [6, 13, 1, 4], [6, 17, 9, 4]  # a prompt, a chunk past a window, one query, a short one
    k_cache, v_cache, tables, dense = paged(seq_lens)
    q = torch.randn(sum(query_lens), HKV * GROUP, D)
    got = ref.paged_prefill_attention(q, k_cache, v_cache, tables, query_lens, seq_lens, D**-0.5, sinks=sinks,
                                      **variant)
    start = 0
    for b, (q_len, s_len) in enumerate(zip(query_lens, seq_lens)):
        want = naive(q[start: start + q_len], *dense[b], range(s_len - q_len, s_len), D**-0.5, sinks=sinks, **variant)
        torch.testing.assert_close(got[start: start + q_len], want, atol=1e-5, rtol=1e-5)
        start += q_len


@pytest.mark.parametrize("variant", VARIANTS, ids=str)
def test_decode_variants_match_attention_written_out(variant):
    variant = dict(variant)
    sinks = torch.randn(HKV * GROUP) * 2 if variant.pop("sinks", False) else None
    seq_lens = [1, 5, 18, 11]
    k_cache, v_cache, tables, dense = paged(seq_lens)
    q = torch.randn(len(seq_lens), HKV * GROUP, D)
    got = ref.paged_decode_attention(q, k_cache, v_cache, tables, torch.tensor(seq_lens, dtype=torch.int32),
                                     max(seq_lens), D**-0.5, sinks=sinks, **variant)
    for b, s_len in enumerate(seq_lens):
        want = naive(q[b: b + 1], *dense[b], [s_len - 1], D**-0.5, sinks=sinks, **variant)
        torch.testing.assert_close(got[b: b + 1], want, atol=1e-5, rtol=1e-5)


def test_a_window_wider_than_the_sequence_is_full_attention():
    seq_lens = [9]
    k_cache, v_cache, tables, dense = paged(seq_lens)
    q = torch.randn(9, HKV * GROUP, D)
    full = ref.paged_prefill_attention(q, k_cache, v_cache, tables, [9], seq_lens, 0.3)
    assert torch.equal(ref.paged_prefill_attention(q, k_cache, v_cache, tables, [9], seq_lens, 0.3, window=9), full)
    assert not torch.allclose(ref.paged_prefill_attention(q, k_cache, v_cache, tables, [9], seq_lens, 0.3, window=8),
                              full)
