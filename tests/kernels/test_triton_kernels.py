"""Triton kernels against the PyTorch references (computed on the CPU).

The small-shape tests run the kernels through the ``tk`` fixture (see conftest.py): under the Triton
interpreter on a machine without CUDA, compiled on a GPU otherwise. The ``gpu`` tests run the compiled
kernels on realistic shapes (Llama-3-8B heads, bf16) and skip without CUDA.
"""

from __future__ import annotations

import pytest
import torch

from kvloom.kernels import ops
from kvloom.kernels import reference as ref

requires_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


# --------------------------------------------------------------------------------------------------
# helpers
# --------------------------------------------------------------------------------------------------


def make_paged_cache(seq_lens, block_size, num_kv_heads, head_dim, dtype, device="cpu", spare_blocks=3, seed=0):
    """Random K/V caches (unused slots hold noise too) and shuffled, non-contiguous block tables."""
    gen = torch.Generator().manual_seed(seed)
    blocks_per_seq = [-(-s // block_size) for s in seq_lens]
    max_blocks = max(max(blocks_per_seq), 1) + 1  # one spare column: tables are wider than needed
    num_blocks = sum(blocks_per_seq) + spare_blocks
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    k_cache = torch.randn(shape, generator=gen).to(dtype).to(device)
    v_cache = torch.randn(shape, generator=gen).to(dtype).to(device)
    perm = torch.randperm(num_blocks, generator=gen)
    tables = torch.zeros(len(seq_lens), max_blocks, dtype=torch.int32)
    used = 0
    for b, n in enumerate(blocks_per_seq):
        tables[b, :n] = perm[used : used + n]
        used += n
    return k_cache, v_cache, tables.to(device)


def qkv_views(num_tokens, num_q_heads, num_kv_heads, head_dim, dtype, device="cpu", seed=1):
    """q, k, v as strided views of one fused projection output, the way model code produces them."""
    gen = torch.Generator().manual_seed(seed)
    width = (num_q_heads + 2 * num_kv_heads) * head_dim
    qkv = torch.randn(num_tokens, width, generator=gen).to(dtype).to(device)
    q, k, v = qkv.split([num_q_heads * head_dim, num_kv_heads * head_dim, num_kv_heads * head_dim], dim=-1)
    return (
        q.view(num_tokens, num_q_heads, head_dim),
        k.view(num_tokens, num_kv_heads, head_dim),
        v.view(num_tokens, num_kv_heads, head_dim),
    )


def decode_reference(q, k_cache, v_cache, tables, seq_lens, **variant):
    """Reference decode (scale ``D ** -0.5``) on the rows with tokens; padding rows (seq_len 0) give zeros."""
    out = torch.zeros_like(q)
    live = seq_lens > 0
    if live.any():
        out[live] = ref.paged_decode_attention(
            q[live], k_cache, v_cache, tables[live], seq_lens[live], int(seq_lens.max()), q.shape[-1] ** -0.5,
            **variant,
        )
    return out


def to_device(device, *tensors):
    return [t.to(device) for t in tensors]


def start_locs(query_lens):
    """``query_start_loc`` (int32 ``[B+1]``) for the given per-sequence query counts."""
    return torch.tensor([0, *torch.tensor(query_lens).cumsum(0).tolist()], dtype=torch.int32)


def upcast(*tensors):
    return [t.float() for t in tensors]


def cos_sin_cache(max_pos, head_dim, device="cpu"):
    inv_freq = 1.0 / (10000 ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim))
    freqs = torch.arange(max_pos, dtype=torch.float32)[:, None] * inv_freq[None, :]
    return torch.cat([freqs.cos(), freqs.sin()], dim=-1).to(device)


HEADS = [(4, 2), (2, 2)]  # (Hq, Hkv): grouped-query and plain multi-head
# (query_len, seq_len): full prefill, chunk over a cached prefix, one token, longer than a tile, long prefix
PREFILL_SEQS = [(5, 5), (7, 20), (1, 9), (19, 19), (10, 150)]


# --------------------------------------------------------------------------------------------------
# small shapes: interpreted on the CPU, compiled on a GPU (``tk`` fixture, see conftest.py)
# --------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("block_size", [8, 16])
def test_write_kv_cache_skips_padding(tk, block_size):
    num_tokens, hq, hkv, d = 6, 4, 2, 16
    k_cache, v_cache, _ = make_paged_cache([40], block_size, hkv, d, torch.float32)
    _, k, v = qkv_views(num_tokens, hq, hkv, d, torch.float32)
    slots = torch.tensor([3, -1, 17, 0, -1, 2 * block_size + 5], dtype=torch.int32)  # distinct valid slots
    expect_k, expect_v = k_cache.clone(), v_cache.clone()
    valid = slots >= 0
    ref.write_kv_cache(k[valid], v[valid], expect_k, expect_v, slots[valid])

    dk, dv = k_cache.to(tk.device), v_cache.to(tk.device)
    tk.attention.write_kv_cache(k.to(tk.device), v.to(tk.device), dk, dv, slots.to(tk.device))
    assert torch.equal(dk.cpu(), expect_k)
    assert torch.equal(dv.cpu(), expect_v)


@pytest.mark.parametrize("num_splits", [1, 3])
@pytest.mark.parametrize("heads", HEADS)
@pytest.mark.parametrize("block_size", [8, 16])
def test_decode_matches_reference(tk, block_size, heads, num_splits):
    hq, hkv = heads
    d = 16
    # Zeros are padding rows; lengths are not multiples of the block size; 300 and 130 span several
    # 64-key tiles, so num_splits=3 really splits them (300: 2 + 2 + 1 tiles, 130: 1 + 1 + 1).
    seq_lens_list = [13, 0, 1, 300, 0, 130]
    k_cache, v_cache, tables = make_paged_cache(seq_lens_list, block_size, hkv, d, torch.float32)
    seq_lens = torch.tensor(seq_lens_list, dtype=torch.int32)
    q, _, _ = qkv_views(len(seq_lens_list), hq, hkv, d, torch.float32)  # strided view, like model code's

    # max_seq_len is only a hint: pass more than the true maximum, as a CUDA graph would.
    out = tk.attention.paged_decode_attention(
        *to_device(tk.device, q, k_cache, v_cache, tables, seq_lens), 512, d**-0.5, num_splits=num_splits
    ).cpu()
    assert torch.isfinite(out).all()
    torch.testing.assert_close(out, decode_reference(q, k_cache, v_cache, tables, seq_lens), atol=1e-4, rtol=1e-4)


def test_decode_more_splits_than_tiles(tk):
    """Most splits are empty (150 keys = 3 tiles over 8 splits) and must not disturb the reduction."""
    seq_lens_list = [3, 0, 150]
    k_cache, v_cache, tables = make_paged_cache(seq_lens_list, 8, 2, 16, torch.float32)
    seq_lens = torch.tensor(seq_lens_list, dtype=torch.int32)
    q = torch.randn(3, 4, 16)
    out = tk.attention.paged_decode_attention(
        *to_device(tk.device, q, k_cache, v_cache, tables, seq_lens), 150, 0.25, num_splits=8
    ).cpu()
    torch.testing.assert_close(out, decode_reference(q, k_cache, v_cache, tables, seq_lens), atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("heads", HEADS)
@pytest.mark.parametrize("block_size", [8, 16])
def test_prefill_matches_reference(tk, block_size, heads):
    hq, hkv = heads
    d = 16
    query_lens = [q for q, _ in PREFILL_SEQS]
    seq_lens_list = [s for _, s in PREFILL_SEQS]
    k_cache, v_cache, tables = make_paged_cache(seq_lens_list, block_size, hkv, d, torch.float32)
    q, _, _ = qkv_views(sum(query_lens), hq, hkv, d, torch.float32)
    query_start_loc = start_locs(query_lens)
    seq_lens = torch.tensor(seq_lens_list, dtype=torch.int32)

    out = tk.attention.paged_prefill_attention(
        *to_device(tk.device, q, k_cache, v_cache, tables, query_start_loc, seq_lens), max(query_lens), d**-0.5
    ).cpu()
    expect = ref.paged_prefill_attention(q, k_cache, v_cache, tables, query_lens, seq_lens_list, d**-0.5)
    torch.testing.assert_close(out, expect, atol=1e-4, rtol=1e-4)


# window / soft-cap / sinks: windows narrower than a tile and than a query block (rows whose first tiles are all
# outside their window), wider than some sequences, and spanning several 64-key tiles
ATTENTION_VARIANTS = [dict(window=5), dict(window=70), dict(softcap=2.0), dict(sinks=True),
                      dict(window=20, softcap=3.0, sinks=True)]


def _variant(variant, num_q_heads, device="cpu"):
    """The kernel's keyword arguments for a variant (sinks as random per-head logits)."""
    variant = dict(variant)
    if variant.pop("sinks", False):
        variant["sinks"] = torch.randn(num_q_heads, generator=torch.Generator().manual_seed(3)) * 2
    return variant


@pytest.mark.parametrize("num_splits", [1, 3])
@pytest.mark.parametrize("variant", ATTENTION_VARIANTS, ids=str)
def test_decode_variants_match_reference(tk, variant, num_splits):
    seq_lens_list = [13, 0, 1, 300, 130, 70]
    k_cache, v_cache, tables = make_paged_cache(seq_lens_list, 16, 2, 16, torch.float32)
    seq_lens = torch.tensor(seq_lens_list, dtype=torch.int32)
    q, _, _ = qkv_views(len(seq_lens_list), 4, 2, 16, torch.float32)
    kw = _variant(variant, 4)
    dev = {k: v.to(tk.device) if isinstance(v, torch.Tensor) else v for k, v in kw.items()}
    out = tk.attention.paged_decode_attention(
        *to_device(tk.device, q, k_cache, v_cache, tables, seq_lens), 512, 16**-0.5, num_splits=num_splits, **dev
    ).cpu()
    assert torch.isfinite(out).all()
    torch.testing.assert_close(out, decode_reference(q, k_cache, v_cache, tables, seq_lens, **kw), atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("variant", ATTENTION_VARIANTS, ids=str)
@pytest.mark.parametrize("block_size", [8, 16])
def test_prefill_variants_match_reference(tk, block_size, variant):
    """Prompts, chunks over cached prefixes (one crossing its window's edge), single queries and a 70-query
    chunk (64-query blocks) with each variant."""
    query_lens = [q for q, _ in PREFILL_SEQS] + [70]
    seq_lens_list = [s for _, s in PREFILL_SEQS] + [100]
    k_cache, v_cache, tables = make_paged_cache(seq_lens_list, block_size, 2, 16, torch.float32)
    q, _, _ = qkv_views(sum(query_lens), 4, 2, 16, torch.float32)
    seq_lens = torch.tensor(seq_lens_list, dtype=torch.int32)
    kw = _variant(variant, 4)
    dev = {k: v.to(tk.device) if isinstance(v, torch.Tensor) else v for k, v in kw.items()}
    out = tk.attention.paged_prefill_attention(
        *to_device(tk.device, q, k_cache, v_cache, tables, start_locs(query_lens), seq_lens), max(query_lens),
        16**-0.5, **dev,
    ).cpu()
    assert torch.isfinite(out).all()
    expect = ref.paged_prefill_attention(q, k_cache, v_cache, tables, query_lens, seq_lens_list, 16**-0.5, **kw)
    torch.testing.assert_close(out, expect, atol=1e-4, rtol=1e-4)


def test_window_reads_no_tile_before_it(tk):
    """Blocks that lie wholly before the tile holding a query's window start are never read (decode and a
    chunk over a cached prefix): filled with NaN, the outputs stay those of the reference on clean caches.
    A sliding layer can so give those blocks back while its request runs."""
    bs, window = 8, 40
    seq_lens_list = [300, 200]
    k_cache, v_cache, tables = make_paged_cache(seq_lens_list, bs, 2, 16, torch.float32)
    seq_lens = torch.tensor(seq_lens_list, dtype=torch.int32)
    poisoned_k, poisoned_v = k_cache.clone(), v_cache.clone()
    for b, n in enumerate(seq_lens_list):
        lo = (n - window) // 64 * 64  # the decode query's first tile
        for blk in tables[b, : lo // bs].tolist():
            poisoned_k[blk], poisoned_v[blk] = float("nan"), float("nan")
    q = torch.randn(2, 4, 16)
    out = tk.attention.paged_decode_attention(
        *to_device(tk.device, q, poisoned_k, poisoned_v, tables, seq_lens), 300, 0.25, num_splits=2, window=window
    ).cpu()
    expect = ref.paged_decode_attention(q, k_cache, v_cache, tables, seq_lens, 300, 0.25, window=window)
    torch.testing.assert_close(out, expect, atol=1e-4, rtol=1e-4)
    # a 10-query chunk at the end of each sequence: its first query's window starts 49 keys back
    query_lens = [10, 10]
    qp = torch.randn(20, 4, 16)
    poisoned_k, poisoned_v = k_cache.clone(), v_cache.clone()
    for b, n in enumerate(seq_lens_list):
        lo = max(0, n - 10 - window + 1) // 64 * 64
        for blk in tables[b, : lo // bs].tolist():
            poisoned_k[blk], poisoned_v[blk] = float("nan"), float("nan")
    out = tk.attention.paged_prefill_attention(
        *to_device(tk.device, qp, poisoned_k, poisoned_v, tables, start_locs(query_lens), seq_lens), 10, 0.25,
        window=window).cpu()
    expect = ref.paged_prefill_attention(qp, k_cache, v_cache, tables, query_lens, seq_lens_list, 0.25, window=window)
    torch.testing.assert_close(out, expect, atol=1e-4, rtol=1e-4)


def test_prefill_large_query_block(tk):
    """A chunk of >= 64 queries switches to BLOCK_M = 64; a query block then spans several key tiles."""
    query_lens, seq_lens_list = [70, 3], [100, 3]
    k_cache, v_cache, tables = make_paged_cache(seq_lens_list, 16, 2, 32, torch.float32)
    q = torch.randn(sum(query_lens), 4, 32)
    seq_lens = torch.tensor(seq_lens_list, dtype=torch.int32)
    out = tk.attention.paged_prefill_attention(
        *to_device(tk.device, q, k_cache, v_cache, tables, start_locs(query_lens), seq_lens), 70, 0.2
    ).cpu()
    expect = ref.paged_prefill_attention(q, k_cache, v_cache, tables, query_lens, seq_lens_list, 0.2)
    torch.testing.assert_close(out, expect, atol=1e-4, rtol=1e-4)


def test_attention_head_dim_below_dot_minimum(tk):
    """D=8 is padded to the 16 columns tl.dot needs; the padding must not leak into the results."""
    query_lens, seq_lens_list = [3, 1], [11, 6]
    k_cache, v_cache, tables = make_paged_cache(seq_lens_list, 8, 2, 8, torch.float32)
    seq_lens = torch.tensor(seq_lens_list, dtype=torch.int32)
    q = torch.randn(4, 4, 8)
    out = tk.attention.paged_prefill_attention(
        *to_device(tk.device, q, k_cache, v_cache, tables, start_locs(query_lens), seq_lens), 3, 8**-0.5
    ).cpu()
    expect = ref.paged_prefill_attention(q, k_cache, v_cache, tables, query_lens, seq_lens_list, 8**-0.5)
    torch.testing.assert_close(out, expect, atol=1e-4, rtol=1e-4)

    q = torch.randn(2, 4, 8)
    out = tk.attention.paged_decode_attention(
        *to_device(tk.device, q, k_cache, v_cache, tables, seq_lens), 11, 8**-0.5, num_splits=2
    ).cpu()
    torch.testing.assert_close(out, decode_reference(q, k_cache, v_cache, tables, seq_lens), atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("with_residual", [False, True])
def test_rms_norm(tk, dtype, with_residual):
    x = torch.randn(5, 48).to(dtype)  # 48: not a power of two, exercises the column mask
    w = (1 + 0.1 * torch.randn(48)).to(dtype)
    residual = torch.randn(5, 48).to(dtype) if with_residual else None
    expect = ref.rms_norm(x, w, 1e-6, residual)
    got = tk.fused.rms_norm(*to_device(tk.device, x, w), 1e-6, None if residual is None else residual.to(tk.device))
    tol = 1e-5 if dtype == torch.float32 else 1e-3
    if with_residual:
        torch.testing.assert_close(got[1].cpu(), expect[1], atol=0, rtol=0)
        got, expect = got[0], expect[0]
    torch.testing.assert_close(got.cpu(), expect, atol=tol, rtol=tol)


def test_rms_norm_strided_3d(tk):
    x = torch.randn(2, 3, 64)[:, :, :32]  # non-contiguous rows
    w = torch.randn(32)
    got = tk.fused.rms_norm(*to_device(tk.device, x, w), 1e-5).cpu()
    torch.testing.assert_close(got, ref.rms_norm(x, w, 1e-5), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("heads", HEADS)
def test_rotary_embedding_on_qkv_views(tk, dtype, heads):
    hq, hkv = heads
    q, k, _ = qkv_views(6, hq, hkv, 32, dtype)
    positions = torch.tensor([0, 5, 1, 99, 7, 3])
    cache = cos_sin_cache(128, 32)
    expect_q, expect_k = ref.rotary_embedding(positions, q, k, cache)
    got_q, got_k = tk.fused.rotary_embedding(*to_device(tk.device, positions, q, k, cache))
    tol = 1e-5 if dtype == torch.float32 else 1e-3
    torch.testing.assert_close(got_q.cpu(), expect_q, atol=tol, rtol=tol)
    torch.testing.assert_close(got_k.cpu(), expect_k, atol=tol, rtol=tol)


@pytest.mark.parametrize("cache_dtype", [torch.float16, torch.float8_e4m3fn])
@pytest.mark.parametrize("heads", HEADS)
def test_rotary_and_cache_write_in_one_kernel_is_the_two_kernels(tk, cache_dtype, heads):
    """The decode step's fused launch (the Triton backend rotates q and k where it writes the cache): q
    and the cache byte for byte as the rotary kernel followed by the cache write, padding slots skipped,
    with the fp8 cache's scales; k itself is left unrotated."""
    hq, hkv = heads
    d, block_size = 32, 8
    q, k, v = qkv_views(6, hq, hkv, d, torch.float16)
    positions = torch.tensor([0, 5, 1, 99, 7, 3])
    slots = torch.tensor([3, -1, 17, 0, -1, 21], dtype=torch.int32)
    table = cos_sin_cache(128, d)
    k_cache, v_cache, _ = make_paged_cache([40], block_size, hkv, d, torch.float16)
    k_cache, v_cache = k_cache.to(cache_dtype), v_cache.to(cache_dtype)
    scales = (0.5, 0.25) if cache_dtype == torch.float8_e4m3fn else (1.0, 1.0)
    dev = tk.device
    q1, k1, v1, pos, tab, sl = to_device(dev, q.clone(), k.clone(), v, positions, table, slots)
    want_k, want_v = k_cache.clone().to(dev), v_cache.clone().to(dev)
    q1, k1 = tk.fused.rotary_embedding(pos, q1, k1, tab)
    tk.attention.write_kv_cache(k1, v1, want_k, want_v, sl, *scales)
    q2, k2 = q.clone().to(dev), k.clone().to(dev)
    got_k, got_v = k_cache.clone().to(dev), v_cache.clone().to(dev)
    out = tk.attention.rotary_and_write_kv_cache(pos, q2, k2, v1, tab, got_k, got_v, sl, *scales)
    assert out.data_ptr() == q2.data_ptr() and torch.equal(q2.cpu(), q1.cpu())
    assert torch.equal(got_k.cpu().view(torch.uint8), want_k.cpu().view(torch.uint8))
    assert torch.equal(got_v.cpu().view(torch.uint8), want_v.cpu().view(torch.uint8))
    assert torch.equal(k2.cpu(), k.cpu())


def test_greedy_argmax_takes_the_first_maximum(tk):
    """The two-stage argmax equals torch.argmax, ties included: the first column holding the row's maximum,
    across chunks and within one; a padded last chunk, a row of -inf and a NaN (the maximum) too."""
    logits = torch.randn(7, 100)
    logits[1, 40] = logits[1, 70] = 9.0  # tie across chunks: 40
    logits[2, 33] = logits[2, 35] = 9.0  # tie inside one chunk: 33
    logits[3, 99] = 9.0  # in the padded last chunk
    logits[4] = float("-inf")  # every column masked: 0, as torch.argmax
    logits[5, 3] = float("nan")
    logits[6, :] = 2.0  # all equal: 0
    got = tk.fused.greedy_argmax(logits.to(tk.device), chunk=16).cpu()  # many chunks at the interpreter's speed
    assert got.dtype == torch.int64
    assert got.tolist() == logits.argmax(-1).tolist() == [got[0].item(), 40, 33, 99, 0, 3, 0]
    assert tk.fused.greedy_argmax(logits[:0].to(tk.device), chunk=16).shape == (0,)



@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_silu_and_mul(tk, dtype):
    x = torch.randn(2, 3, 2 * 40).to(dtype)
    tol = 1e-5 if dtype == torch.float32 else 1e-3
    got = tk.fused.silu_and_mul(x.to(tk.device)).cpu()
    torch.testing.assert_close(got, ref.silu_and_mul(x), atol=tol, rtol=tol)


# --------------------------------------------------------------------------------------------------
# GPU tests: compiled kernels, Llama-3-8B head shapes, bf16
# --------------------------------------------------------------------------------------------------

GPU_HQ, GPU_HKV, GPU_D = 32, 8, 128


@pytest.mark.gpu
@requires_cuda
def test_gpu_write_kv_cache():
    from kvloom.kernels import triton_attention

    k_cache, v_cache, _ = make_paged_cache([4096], 16, GPU_HKV, GPU_D, torch.bfloat16, "cuda")
    _, k, v = qkv_views(300, GPU_HQ, GPU_HKV, GPU_D, torch.bfloat16, "cuda")
    slots = torch.randperm(4096, device="cuda")[:300].int()
    slots[::7] = -1
    expect_k, expect_v = k_cache.clone(), v_cache.clone()
    valid = slots >= 0
    ref.write_kv_cache(k[valid], v[valid], expect_k, expect_v, slots[valid])
    triton_attention.write_kv_cache(k, v, k_cache, v_cache, slots)
    torch.cuda.synchronize()
    assert torch.equal(k_cache, expect_k) and torch.equal(v_cache, expect_v)


@pytest.mark.gpu
@requires_cuda
@pytest.mark.parametrize("seq_lens_list", [[4096], [1, 17, 0, 513, 2048, 4096, 100, 0], [777] * 64])
def test_gpu_decode(seq_lens_list):
    from kvloom.kernels import triton_attention

    k_cache, v_cache, tables = make_paged_cache(seq_lens_list, 16, GPU_HKV, GPU_D, torch.bfloat16, "cuda")
    seq_lens = torch.tensor(seq_lens_list, dtype=torch.int32, device="cuda")
    q, _, _ = qkv_views(len(seq_lens_list), GPU_HQ, GPU_HKV, GPU_D, torch.bfloat16, "cuda")
    expect = decode_reference(*upcast(q, k_cache, v_cache), tables, seq_lens)
    for num_splits in (None, 1, 7):  # heuristic, forced single pass, forced split-K
        out = triton_attention.paged_decode_attention(
            q, k_cache, v_cache, tables, seq_lens, 4096, GPU_D**-0.5, num_splits=num_splits
        )
        torch.testing.assert_close(out.float(), expect, atol=2e-2, rtol=2e-2)


@pytest.mark.gpu
@requires_cuda
def test_gpu_decode_cuda_graph_replay():
    """Captured once with a fixed max_seq_len, replayed with new lengths (including padding rows)."""
    seq_lens_list = [2000, 3000, 50, 4096]
    k_cache, v_cache, tables = make_paged_cache(seq_lens_list, 16, GPU_HKV, GPU_D, torch.bfloat16, "cuda")
    q, _, _ = qkv_views(4, GPU_HQ, GPU_HKV, GPU_D, torch.bfloat16, "cuda")
    seq_lens = torch.tensor(seq_lens_list, dtype=torch.int32, device="cuda")
    from kvloom.kernels import triton_attention

    decode = triton_attention.paged_decode_attention
    decode(q, k_cache, v_cache, tables, seq_lens, 4096, GPU_D**-0.5)  # compile outside capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = decode(q, k_cache, v_cache, tables, seq_lens, 4096, GPU_D**-0.5)
    for new_lens in ([2000, 3000, 50, 4096], [1, 0, 4000, 17]):
        seq_lens.copy_(torch.tensor(new_lens, dtype=torch.int32))
        graph.replay()
        torch.cuda.synchronize()
        expect = decode_reference(*upcast(q, k_cache, v_cache), tables, seq_lens)
        torch.testing.assert_close(out.float(), expect, atol=2e-2, rtol=2e-2)


@pytest.mark.gpu
@requires_cuda
@pytest.mark.parametrize("block_size", [16, 64])
def test_gpu_prefill(block_size):
    from kvloom.kernels import triton_attention

    seqs = [(512, 512), (100, 3000), (1, 4096), (2048, 4096), (333, 333)]
    query_lens = [q for q, _ in seqs]
    seq_lens_list = [s for _, s in seqs]
    k_cache, v_cache, tables = make_paged_cache(seq_lens_list, block_size, GPU_HKV, GPU_D, torch.bfloat16, "cuda")
    q, _, _ = qkv_views(sum(query_lens), GPU_HQ, GPU_HKV, GPU_D, torch.bfloat16, "cuda")
    query_start_loc = start_locs(query_lens).cuda()
    seq_lens = torch.tensor(seq_lens_list, dtype=torch.int32, device="cuda")
    out = triton_attention.paged_prefill_attention(
        q, k_cache, v_cache, tables, query_start_loc, seq_lens, max(query_lens), GPU_D**-0.5
    )
    qf, kf, vf = upcast(q, k_cache, v_cache)
    expect = ref.paged_prefill_attention(qf, kf, vf, tables, query_lens, seq_lens_list, GPU_D**-0.5)
    torch.testing.assert_close(out.float(), expect, atol=2e-2, rtol=2e-2)


@pytest.mark.gpu
@requires_cuda
def test_gpu_attention_float32_is_exact():
    """float32 inputs use IEEE dots (not tf32), so they match the reference tightly."""
    from kvloom.kernels import triton_attention

    seq_lens_list = [300, 1000]
    k_cache, v_cache, tables = make_paged_cache(seq_lens_list, 16, GPU_HKV, GPU_D, torch.float32, "cuda")
    seq_lens = torch.tensor(seq_lens_list, dtype=torch.int32, device="cuda")
    q = torch.randn(2, GPU_HQ, GPU_D, device="cuda")
    out = triton_attention.paged_decode_attention(q, k_cache, v_cache, tables, seq_lens, 1000, GPU_D**-0.5)
    expect = decode_reference(q, k_cache, v_cache, tables, seq_lens)
    torch.testing.assert_close(out, expect, atol=1e-4, rtol=1e-4)

    query_lens = [300, 600]  # >= 512: the large-tile prefill configuration is for 16-bit inputs only
    q = torch.randn(sum(query_lens), GPU_HQ, GPU_D, device="cuda")
    out = triton_attention.paged_prefill_attention(
        q, k_cache, v_cache, tables, start_locs(query_lens).cuda(), seq_lens, 600, GPU_D**-0.5
    )
    expect = ref.paged_prefill_attention(q, k_cache, v_cache, tables, query_lens, seq_lens_list, GPU_D**-0.5)
    torch.testing.assert_close(out, expect, atol=1e-4, rtol=1e-4)


@pytest.mark.gpu
@requires_cuda
def test_gpu_fused_ops_through_dispatch():
    hidden = 4096
    x = torch.randn(37, hidden, device="cuda", dtype=torch.bfloat16)
    residual = torch.randn_like(x)
    w = (1 + 0.1 * torch.randn(hidden, device="cuda")).to(torch.bfloat16)
    got, got_res = ops.rms_norm(x, w, 1e-5, residual)
    expect, expect_res = ref.rms_norm(x, w, 1e-5, residual)
    torch.testing.assert_close(got_res, expect_res, atol=0, rtol=0)
    torch.testing.assert_close(got, expect, atol=2e-2, rtol=2e-2)

    q, k, _ = qkv_views(37, GPU_HQ, GPU_HKV, GPU_D, torch.bfloat16, "cuda")
    positions = torch.randint(0, 8192, (37,), device="cuda")
    cache = cos_sin_cache(8192, GPU_D, "cuda")
    expect_q, expect_k = ref.rotary_embedding(positions, q.clone(), k.clone(), cache)
    got_q, got_k = ops.rotary_embedding(positions, q, k, cache)
    torch.testing.assert_close(got_q, expect_q, atol=2e-2, rtol=2e-2)
    torch.testing.assert_close(got_k, expect_k, atol=2e-2, rtol=2e-2)

    x = torch.randn(37, 2 * 14336, device="cuda", dtype=torch.bfloat16)
    torch.testing.assert_close(ops.silu_and_mul(x), ref.silu_and_mul(x), atol=2e-2, rtol=2e-2)


_COMPILE_SM90 = """
import importlib, json, sys
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

done = {}
for case in json.loads(sys.argv[1]):
    fn = getattr(importlib.import_module(case["module"]), case["kernel"])
    names = list(fn.arg_names)
    const = case["const"]
    signature = {n: "constexpr" if n in const else case["types"][n] for n in names}
    # pointers 16-byte aligned, as a launch specializes them (without it nothing is vectorized or pipelined)
    attrs = {(i,): [["tt.divisibility", 16]] for i, n in enumerate(names) if signature[n].startswith("*")}
    src = ASTSource(fn, signature, constexprs={(names.index(n),): v for n, v in const.items()}, attrs=attrs)
    k = triton.compile(src, target=GPUTarget("cuda", 90, 32), options=dict(case["options"], launch_pdl=True))
    ptx = k.asm["ptx"]
    done[case["name"]] = ".target sm_90" in ptx and len(k.asm["cubin"]) > 0 and all(p in ptx for p in case["ptx"])
print(json.dumps(done))
"""

_INT4_ROW_TYPES = dict(
    x_ptr="*bf16", qw_ptr="*i32", z_ptr="*i32", s_ptr="*bf16", out_ptr="*bf16", M="i32", N="i32", K="i32",
    stride_xm="i32", stride_qn="i32", stride_om="i32", NIB_MASK="i32", part_ptr="*fp32", arrivals_ptr="*i32")
# The arrival count: an acq_rel atomic behind a CTA barrier (kvloom/kernels/arrivals.py).
_ARRIVAL_PTX = ["bar.sync", "atom.global.gpu.acq_rel.add"]


def test_kernels_that_combine_their_splits_compile_for_sm90():
    """The int4 row GEMV's split-K, with and without combining its splits in the kernel, compiles for an
    H100/H200 (sm90, PDL) on this machine, GPU or not, and the combining one counts arrivals with an acq_rel
    atomic behind a barrier (the ordering that makes the other splits' partials visible to the last). In a
    fresh interpreter: this module's kernels are interpreted."""
    import json
    import os
    import subprocess
    import sys

    pytest.importorskip("triton.backends.nvidia.compiler", reason="triton's CUDA backend is not installed")
    cases = []
    for fused, mma in ((False, False), (True, False), (True, True)):
        cases.append(dict(
            name=f"int4 row combine={fused} mma_layout={mma}", module="kvloom.kernels.quant.int4_row",
            kernel="_int4_row_gemv_kernel", types=_INT4_ROW_TYPES, options=dict(num_warps=8, num_stages=2),
            ptx=_ARRIVAL_PTX if fused else [],
            const=dict(GROUP=128, BLOCK_N=64, BLOCK_K=1024, SPLIT_K=4, PDL=True, SILU_MUL=False, SPLIT_COMBINE=fused,
                       MMA_LAYOUT=mma)))
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    run = subprocess.run([sys.executable, "-c", _COMPILE_SM90, json.dumps(cases)], env=env, capture_output=True,
                         text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-4000:]
    assert json.loads(run.stdout.strip().splitlines()[-1]) == {c["name"]: True for c in cases}


_ATTN_COMMON_TYPES = dict(q_ptr="*bf16", k_cache_ptr="*bf16", v_cache_ptr="*bf16", block_tables_ptr="*i32",
                          seq_lens_ptr="*i32", out_ptr="*bf16", stride_qh="i32", stride_cb="i32", stride_cs="i32",
                          stride_ch="i32", stride_bt="i32", stride_oh="i32", qk_scale="fp32", v_scale="fp32",
                          sinks_ptr="*fp32", softcap="fp32")
_DECODE_TYPES = dict(_ATTN_COMMON_TYPES, part_o_ptr="*fp32", part_lse_ptr="*fp32", stride_qb="i32", stride_ob="i32",
                     num_q_heads="i32")
_REDUCE_TYPES = dict(part_o_ptr="*fp32", part_lse_ptr="*fp32", out_ptr="*bf16", seq_lens_ptr="*i32", stride_ob="i32",
                     stride_oh="i32", num_q_heads="i32", sinks_ptr="*fp32")
_PREFILL_TYPES = dict(_ATTN_COMMON_TYPES, query_start_loc_ptr="*i32", stride_qt="i32", stride_ot="i32")


@pytest.mark.parametrize("head_dim", [64, 256])
def test_attention_variants_compile_for_sm90(head_dim):
    """Decode (split, with its reduce), and prefill at both of its tile configurations, with a window,
    soft-capping and sinks, compile for an H100/H200 (sm90, PDL) on this machine, GPU or not: gpt-oss's
    64-wide heads with a 128-key window and sinks, Gemma's 256-wide heads with a window and soft-cap."""
    import json
    import os
    import subprocess
    import sys

    from kvloom.kernels.triton_attention import _prefill_config

    pytest.importorskip("triton.backends.nvidia.compiler", reason="triton's CUDA backend is not installed")
    module = "kvloom.kernels.triton_attention"
    cases = []
    for window, softcap, sinks in ((128, False, True), (4096, True, False), (1024, True, True)):
        variant = dict(WINDOW=window, SOFTCAP=softcap, SINKS=sinks)
        tag = f"D={head_dim} window={window} softcap={softcap} sinks={sinks}"
        cases.append(dict(name=f"decode {tag}", module=module, kernel="_decode_kernel", types=_DECODE_TYPES,
                          options=dict(num_warps=4, num_stages=3), ptx=[],
                          const=dict(NUM_SPLITS=4, GROUP=8, BLOCK_G=16, BLOCK_SIZE=16, HEAD_DIM=head_dim,
                                     BLOCK_D=head_dim, BLOCK_N=64, DOT_PRECISION="tf32", PDL=True, **variant)))
        cases.append(dict(name=f"reduce {tag}", module=module, kernel="_decode_reduce_kernel", types=_REDUCE_TYPES,
                          options=dict(num_warps=4), ptx=[],
                          const=dict(NUM_SPLITS=4, BLOCK_S=4, HEAD_DIM=head_dim, BLOCK_D=head_dim, BLOCK_N=64,
                                     PDL=True, WINDOW=window, SINKS=sinks)))
        for max_query_len in (32, 4096):
            block_m, block_n, warps, stages = _prefill_config(max_query_len, head_dim, 2)
            cases.append(dict(name=f"prefill {tag} block_m={block_m}", module=module, kernel="_prefill_kernel",
                              types=_PREFILL_TYPES, options=dict(num_warps=warps, num_stages=stages), ptx=[],
                              const=dict(GROUP=8, BLOCK_SIZE=16, HEAD_DIM=head_dim, BLOCK_D=head_dim, BLOCK_M=block_m,
                                         BLOCK_N=block_n, DOT_PRECISION="tf32", **variant)))
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    run = subprocess.run([sys.executable, "-c", _COMPILE_SM90, json.dumps(cases)], env=env, capture_output=True,
                         text=True, timeout=900)
    assert run.returncode == 0, run.stderr[-4000:]
    assert json.loads(run.stdout.strip().splitlines()[-1]) == {c["name"]: True for c in cases}
