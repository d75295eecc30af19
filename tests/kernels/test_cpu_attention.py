"""The CPU decode attention that reads the paged cache in place (``kvloom.kernels.cpu_attention``) against the
reference formula, and the CPU backend's two decode paths (in place, gathered) against each other."""

import os
import subprocess
import sys

import pytest
import torch

from kvloom.kernels import cpu_attention, reference

pytestmark = pytest.mark.skipif(not cpu_attention.available(), reason="no C++ compiler builds the kernel here")


@pytest.fixture(params=["vectorized", "portable"])
def path(request, monkeypatch):
    """Both of the kernel's paths for a bfloat16 cache: AVX512-BF16 where the CPU has it, and the portable loops."""
    monkeypatch.setattr(cpu_attention, "VECTORIZED", request.param == "vectorized")
    return request.param


def _case(batch, heads, kv_heads, head_dim, bs, lens, dtype, seed=0, num_blocks=200):
    g = torch.Generator().manual_seed(seed)
    k_cache = torch.randn(num_blocks, kv_heads, bs, head_dim, generator=g).to(dtype)
    v_cache = torch.randn(num_blocks, kv_heads, bs, head_dim, generator=g).to(dtype)
    q = torch.randn(batch, heads, head_dim, generator=g).to(dtype)
    width = max(-(-n // bs) for n in lens) + 1  # a spare column, as real tables have
    tables = torch.randperm(num_blocks, generator=g)[: batch * width].view(batch, width).int()
    return q, k_cache, v_cache, tables, torch.tensor(lens, dtype=torch.long)


def _expected(q, k_cache, v_cache, tables, lens, scale, window=None, softcap=None, sinks=None):
    """The reference decode attention in float32 on the reference layout ``[blocks, bs, Hkv, D]``."""
    bs = k_cache.shape[2]
    longest = -(-int(lens.max()) // bs) * bs
    return reference.paged_decode_attention(
        q.float(), k_cache.float().transpose(1, 2).contiguous(), v_cache.float().transpose(1, 2).contiguous(),
        tables.long(), lens, longest, scale, window=window, softcap=softcap, sinks=sinks)


@pytest.mark.parametrize("dtype,atol", [(torch.float32, 2e-5), (torch.bfloat16, 2e-2)])
@pytest.mark.parametrize("heads,kv_heads,head_dim,bs", [(9, 3, 64, 32), (8, 8, 128, 16), (4, 1, 64, 32),
                                                        (6, 2, 80, 16), (4, 2, 32, 16), (2, 1, 256, 16)])
def test_matches_reference(dtype, atol, heads, kv_heads, head_dim, bs, path):
    # lengths of one position, a block's edge, and more than one span of SPAN_BLOCKS blocks (merged spans)
    lens = [1, bs, bs + 1, 5, cpu_attention.SPAN_BLOCKS * bs * 2 + 7]
    q, k_cache, v_cache, tables, ends = _case(len(lens), heads, kv_heads, head_dim, bs, lens, dtype)
    out = cpu_attention.paged_decode(q, k_cache, v_cache, tables, torch.zeros_like(ends), ends, 0.125, 0.0, None)
    assert out.dtype == dtype and out.shape == q.shape
    torch.testing.assert_close(out.float(), _expected(q, k_cache, v_cache, tables, ends, 0.125), atol=atol, rtol=0)


@pytest.mark.parametrize("threads", [1, 2, 3])
def test_many_rows_each_item_once(threads, path):
    # the threads take the (row, head, span) items in runs and prefetch the next: every item runs once, whatever the
    # thread count and however the runs divide the items (33 rows x 3 heads x 3 spans, an empty span between)
    g = torch.Generator().manual_seed(2)
    lens = torch.randint(1, cpu_attention.SPAN_BLOCKS * 32 * 3, (33,), generator=g).tolist()
    q, k_cache, v_cache, tables, ends = _case(len(lens), 9, 3, 64, 32, lens, torch.bfloat16, seed=2, num_blocks=1200)
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        out = cpu_attention.paged_decode(q, k_cache, v_cache, tables, torch.zeros_like(ends), ends, 0.125, 0.0, None)
    finally:
        torch.set_num_threads(before)
    torch.testing.assert_close(out.float(), _expected(q, k_cache, v_cache, tables, ends, 0.125), atol=2e-2, rtol=0)


@pytest.mark.parametrize("dtype,atol", [(torch.float32, 2e-5), (torch.bfloat16, 2e-2)])
def test_windows_softcap_and_sinks(dtype, atol, path):
    lens = [3, 40, 300, 17]
    q, k_cache, v_cache, tables, ends = _case(len(lens), 8, 2, 64, 16, lens, dtype, seed=1)
    sinks = torch.randn(8)
    for window, softcap, sink in [(32, None, None), (None, 2.0, None), (None, None, sinks), (24, 3.0, sinks)]:
        starts = torch.zeros_like(ends) if window is None else (ends - window).clamp(min=0)
        out = cpu_attention.paged_decode(q, k_cache, v_cache, tables, starts, ends, 0.125, softcap or 0.0, sink)
        expected = _expected(q, k_cache, v_cache, tables, ends, 0.125, window, softcap, sink)
        torch.testing.assert_close(out.float(), expected, atol=atol, rtol=0, msg=f"window {window}, "
                                   f"softcap {softcap}, sinks {sink is not None}")


def test_empty_batch_and_unsupported_shapes():
    q, k_cache, v_cache, tables, ends = _case(1, 4, 2, 64, 16, [5], torch.float32)
    empty = cpu_attention.paged_decode(q[:0], k_cache, v_cache, tables[:0], ends[:0], ends[:0], 1.0, 0.0, None)
    assert empty.shape == (0, 4, 64)
    assert not cpu_attention.supports(torch.float32, 4, 2, 48, 16)  # head_dim 48: not compiled for
    assert not cpu_attention.supports(torch.float16, 4, 2, 64, 16)
    assert not cpu_attention.supports(torch.float32, 34, 2, 64, 16)  # 17 query heads a KV head
    odd = torch.randn(1, 4, 48)
    cache = torch.randn(8, 2, 16, 48)
    with pytest.raises(ValueError, match="head_dim 48"):
        cpu_attention.paged_decode(odd, cache, cache, tables, torch.zeros_like(ends), ends, 1.0, 0.0, None)


def test_compiles_as_one_opaque_op():
    q, k_cache, v_cache, tables, ends = _case(3, 6, 2, 64, 16, [5, 40, 33], torch.float32, seed=2)
    starts = torch.zeros_like(ends)

    def step(q, tables, starts, ends):
        return cpu_attention.paged_decode(q * 2, k_cache, v_cache, tables, starts, ends, 0.125, 0.0, None) + 1

    with torch._dynamo.config.patch(disable=False):  # the suite runs eagerly (tests/conftest.py)
        compiled = torch.compile(step, dynamic=True, fullgraph=True)
        torch.testing.assert_close(compiled(q, tables, starts, ends), step(q, tables, starts, ends))
        torch.testing.assert_close(compiled(q[:2], tables[:2], starts[:2], ends[:2]),
                                   step(q[:2], tables[:2], starts[:2], ends[:2]))


def test_without_a_compiler_the_gather_serves(tmp_path):
    """No C++ compiler: ``available()`` is False with one warning naming why, and nothing raises."""
    script = ("import logging; logging.basicConfig(); from kvloom.kernels import cpu_attention as c; "
              "print('available', c.available())")
    env = {**os.environ, "CXX": str(tmp_path / "no-such-compiler"),
           "XDG_CACHE_HOME": str(tmp_path / "cache")}
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env, timeout=120)
    assert done.returncode == 0, done.stderr
    assert "available False" in done.stdout
    assert "attention gathers the cache instead" in done.stderr and "no-such-compiler" in done.stderr


needs_prompt_kernel = pytest.mark.skipif(
    not cpu_attention.prompt_serves(torch.bfloat16, 8, 2, 64), reason="no AVX512-BF16 build of the prompt kernel here")


def _prompt_expected(q, keys, values, scale):
    """Causal attention in float32, query i of Q at position S - Q + i: ``q`` [n, Q, Hq, D], K/V [n, Hkv, S, D]."""
    n, length, heads, _ = q.shape
    kv_heads, total = keys.shape[1], keys.shape[2]
    k = keys.float().repeat_interleave(heads // kv_heads, dim=1)
    v = values.float().repeat_interleave(heads // kv_heads, dim=1)
    scores = torch.einsum("nqhd,nhkd->nhqk", q.float(), k) * scale
    visible = torch.arange(total)[None, :] <= torch.arange(total - length, total)[:, None]
    probs = scores.masked_fill(~visible, float("-inf")).softmax(-1)
    return torch.einsum("nhqk,nhkd->nqhd", probs, v)


@needs_prompt_kernel
@pytest.mark.parametrize("heads,kv_heads,head_dim", [(9, 3, 64), (8, 8, 128), (4, 1, 64), (4, 2, 32), (2, 1, 256),
                                                     (6, 2, 96)])
@pytest.mark.parametrize("n,length,total", [(1, 1, 1), (2, 17, 17), (3, 70, 70), (2, 5, 40), (1, 130, 200),
                                            (2, 64, 64), (1, 129, 129)])
def test_prompt_attention_matches_reference(heads, kv_heads, head_dim, n, length, total):
    """Whole prompts (Q = S) and chunks after a cached prefix (Q < S); q, k and v cut from one fused projection's
    rows as the layers hand them over (strided views), and K/V as a gathered prefix's contiguous copy."""
    g = torch.Generator().manual_seed(length * 7 + total)
    width = (heads + 2 * kv_heads) * head_dim
    if length == total:
        qkv = torch.randn(n, length, width, generator=g).bfloat16()
        q = qkv[..., : heads * head_dim].unflatten(-1, (heads, head_dim))
        keys = qkv[..., heads * head_dim: (heads + kv_heads) * head_dim].unflatten(-1, (kv_heads, head_dim))
        values = qkv[..., (heads + kv_heads) * head_dim:].unflatten(-1, (kv_heads, head_dim))
        keys, values = keys.transpose(1, 2), values.transpose(1, 2)
    else:
        q = torch.randn(n, length, heads, head_dim, generator=g).bfloat16()
        keys = torch.randn(n, kv_heads, total, head_dim, generator=g).bfloat16()
        values = torch.randn(n, kv_heads, total, head_dim, generator=g).bfloat16()
    out = cpu_attention.prompt_attention(q, keys, values, head_dim ** -0.5)
    assert out.shape == (n, length, heads, head_dim) and out.dtype == torch.bfloat16
    torch.testing.assert_close(out.float(), _prompt_expected(q, keys, values, head_dim ** -0.5), atol=2e-2, rtol=0)


@needs_prompt_kernel
def test_prompt_attention_refuses_shapes_by_name():
    q = torch.zeros(1, 4, 2, 80, dtype=torch.bfloat16)
    kv = torch.zeros(1, 1, 4, 80, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="head_dim 80"):
        cpu_attention.prompt_attention(q, kv, kv, 0.1)
    assert not cpu_attention.prompt_serves(torch.bfloat16, 2, 1, 80)
    assert not cpu_attention.prompt_serves(torch.float32, 2, 1, 64)


def _rope_case(tokens, heads, kv_heads, head_dim, seed=0):
    """q/k/v as views of one fused projection's rows, a step's rotary tables, caches of 16-position blocks and the
    rows the step writes (distinct, in random order)."""
    g = torch.Generator().manual_seed(seed)
    qkv = torch.randn(tokens, (heads + 2 * kv_heads) * head_dim, generator=g).bfloat16()
    q, k, v = qkv.split([heads * head_dim, kv_heads * head_dim, kv_heads * head_dim], -1)
    q, k, v = (x.view(tokens, -1, head_dim) for x in (q, k, v))
    cos, sin = reference.rotary_tables(torch.randint(0, 500, (tokens,), generator=g),
                                       torch.randn(500, head_dim, generator=g), torch.bfloat16)
    k_cache = torch.randn(max(4, tokens), kv_heads, 16, head_dim, generator=g).bfloat16()
    v_cache = torch.randn(k_cache.shape, generator=g).bfloat16()
    rows = torch.randperm(k_cache.numel() // head_dim, generator=g)[: tokens * kv_heads]
    return q, k, v, cos, sin, k_cache, v_cache, rows


def _rotated(x, cos, sin):  # x * cos + swap(x) * sin in float32, rounded once
    half = x.shape[-1] // 2
    return (x.float() * cos.float() + torch.cat([x[..., half:], x[..., :half]], -1).float() * sin.float()).bfloat16()


@pytest.mark.parametrize("tokens", [1, 5, 32, 300])
@pytest.mark.parametrize("heads,kv_heads,head_dim", [(9, 3, 64), (4, 4, 32), (8, 2, 128), (6, 1, 80)])
def test_rope_write_rotates_and_writes_the_cache_rows(tokens, heads, kv_heads, head_dim):
    q, k, v, cos, sin, k_cache, v_cache, rows = _rope_case(tokens, heads, kv_heads, head_dim, seed=tokens)
    assert cpu_attention.rope_serves(q, k, v, k_cache, cos)
    before_k, before_v = k_cache.clone(), v_cache.clone()
    q_out, k_out = cpu_attention.rope_write(q, k, v, cos, sin, k_cache, v_cache, rows)
    assert q_out.is_contiguous() and k_out.is_contiguous()
    assert torch.equal(q_out, _rotated(q, cos, sin)) and torch.equal(k_out, _rotated(k, cos, sin))
    written = torch.zeros(k_cache.numel() // head_dim, dtype=torch.bool)
    written[rows] = True
    assert torch.equal(k_cache.view(-1, head_dim)[rows], k_out.reshape(-1, head_dim))
    assert torch.equal(v_cache.view(-1, head_dim)[rows], v.reshape(-1, head_dim))
    assert torch.equal(k_cache.view(-1, head_dim)[~written], before_k.view(-1, head_dim)[~written])  # no other row
    assert torch.equal(v_cache.view(-1, head_dim)[~written], before_v.view(-1, head_dim)[~written])
    # against the reference's rotary (both products and their sum rounded to bf16): within those roundings
    want_q, _ = reference.apply_rotary((cos, sin), q, k)
    half = head_dim // 2
    products = (q.float() * cos.float()).abs() + (torch.cat([q[..., half:], q[..., :half]], -1).float()
                                                  * sin.float()).abs()
    assert ((q_out.float() - want_q.float()).abs() <= products * 2**-7).all()


def test_rope_write_refuses_what_it_does_not_take_and_the_backend_rotates_those_itself():
    q, k, v, cos, sin, k_cache, v_cache, rows = _rope_case(6, 4, 2, 64)
    assert not cpu_attention.rope_serves(q.float(), k.float(), v.float(), k_cache.float(), cos.float())
    assert not cpu_attention.rope_serves(q, k, v, k_cache.to(torch.float8_e4m3fn), cos)  # fp8 cache
    assert not cpu_attention.rope_serves(q.transpose(0, 1).transpose(0, 1)[:, ::2], k, v, k_cache, cos)  # heads apart
    assert cpu_attention.rope_write(q[:0], k[:0], v[:0], cos[:0], sin[:0], k_cache, v_cache, rows[:0])[0].shape == \
        (0, 4, 64)


def test_rope_write_compiles_as_one_op_that_writes_the_cache_in_place():
    q, k, v, cos, sin, k_cache, v_cache, rows = _rope_case(7, 6, 2, 64, seed=3)
    eager_k, eager_v = k_cache.clone(), v_cache.clone()
    want = cpu_attention.rope_write(q, k, v, cos, sin, eager_k, eager_v, rows)

    def step(q, k, v, cos, sin, rows):
        q_out, k_out = cpu_attention.rope_write_op(q, k, v, cos, sin, k_cache, v_cache, rows)
        return q_out * 2, k_out

    with torch._dynamo.config.patch(disable=False):  # the suite runs eagerly (tests/conftest.py)
        got = torch.compile(step, fullgraph=True)(q, k, v, cos, sin, rows)
    assert torch.equal(got[0], want[0] * 2) and torch.equal(got[1], want[1])
    assert torch.equal(k_cache, eager_k) and torch.equal(v_cache, eager_v)
