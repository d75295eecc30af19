# Over ~600 lines on purpose: cache-write, decode and prefill kernels share one layout and these helpers.
"""Triton kernels for the paged KV cache: cache writes, decode attention and (chunked) prefill attention.

The PyTorch functions in ``reference.py`` are the specification; these kernels compute the same thing on
CUDA tensors. KV cache layout (one K and one V tensor per layer): ``[num_blocks, block_size, num_kv_heads,
head_dim]``; a token's slot is ``block_id * block_size + offset``; ``block_tables`` is int32
``[B, max_blocks_per_seq]``.

Design notes:

* Keys are visited in tiles of ``BLOCK_N`` positions independent of the cache block size: each key's
  block id is gathered from the block table, so any power-of-two ``block_size`` works with any tile.
* Grouped-query attention: a decode program serves all ``Hq / Hkv`` query heads of one KV head, so each
  K/V tile is read from memory once and fed to ``tl.dot`` as a (padded) ``[BLOCK_G, D]`` matrix.
* Decode reads the sequence lengths from the ``seq_lens`` tensor only; the host ``max_seq_len`` merely
  sizes the split-K partition. That keeps the launch shape fixed for CUDA-graph capture.
* Softmax runs in base 2 (``exp2``) with ``log2(e)`` folded into the scale; statistics are float32.
* An fp8 (e4m3) cache is quantized in the write kernel (``x / scale``, saturated at +-448) and read by the
  same attention kernels: each tile is converted to the query dtype on load, the per-tensor K scale is
  folded into the softmax scale and the V scale multiplies the output, so the key loop is unchanged.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from kvloom.kernels.pdl import gdc_launch_dependents, gdc_wait, pdl_args
from kvloom.kernels.triton_fused import _rotary_cos_sin, _rotate, _rotate_heads

_LOG2E = 1.4426950408889634

# Split-K heuristic: split only while (batch x kv heads) programs fill at most half of this many per SM;
# then aim for this many waves of split programs, but never give a split fewer keys than this (one tile).
_PROGRAMS_PER_SM = 2
_SPLIT_WAVES = 2
_MIN_KEYS_PER_SPLIT = 64
_MAX_SPLITS = 64
_DECODE_BLOCK_N = 64  # keys a decode tile


@functools.lru_cache(maxsize=None)
def _num_sms(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def _dot_precision(dtype: torch.dtype) -> str:
    # float32 inputs would otherwise go through tf32 tensor cores (~1e-3 error); keep them exact.
    return "ieee" if dtype == torch.float32 else "tf32"


def _check_cache(k_cache: torch.Tensor, v_cache: torch.Tensor) -> None:
    assert k_cache.shape == v_cache.shape and k_cache.stride() == v_cache.stride(), "K and V caches must match"
    assert k_cache.stride(-1) == 1, "cache head_dim must be contiguous"


# --------------------------------------------------------------------------------------------------
# KV cache write
# --------------------------------------------------------------------------------------------------


@triton.jit
def _round_to_e4m3(x):
    """``x`` (float32) rounded to the nearest float8 e4m3 value, ties to even, saturated at +-448 (an
    out-of-range value would otherwise become NaN), so that the cast to fp8 is exact. Done here rather
    than by the cast because Triton's interpreter rounds half up without carrying into the exponent
    (7.9 -> 4.0); on the GPU the result is the hardware's. Values below 2**-6 (e4m3's subnormals, spaced
    2**-9 like the normals of [2**-6, 2**-5)) are rounded after adding 2**-6, which is exact in float32."""
    a = tl.abs(x)
    small = a < 0.015625
    a = tl.where(small, a + 0.015625, a)
    bits = a.to(tl.int32, bitcast=True)
    bits = (bits + 0x7FFFF + ((bits >> 20) & 1)) & -1048576  # keep 3 of float32's 23 mantissa bits
    r = bits.to(tl.float32, bitcast=True)
    r = tl.minimum(tl.where(small, r - 0.015625, r), 448.0)
    # The sign bit copied, not ``-r``: compiled, a negation is ``0 - r``, which turns -0.0 into +0.0 (byte 0
    # where torch writes 128 for tiny negative values).
    sign = x.to(tl.int32, bitcast=True) & -2147483648
    return (r.to(tl.int32, bitcast=True) | sign).to(tl.float32, bitcast=True)


@triton.jit
def _write_kv_cache_kernel(
    k_ptr, v_ptr, k_cache_ptr, v_cache_ptr, slot_ptr,
    stride_kt, stride_kh, stride_vt, stride_vh,
    stride_cb, stride_cs, stride_ch,
    num_heads, k_inv_scale, v_inv_scale,
    BLOCK_SIZE: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr,
    FP8: tl.constexpr, PDL: tl.constexpr,
):
    t = tl.program_id(0)
    gdc_launch_dependents(PDL)  # the next kernel may start and wait
    gdc_wait(PDL)
    slot = tl.load(slot_ptr + t).to(tl.int64)
    offs_h = tl.arange(0, BLOCK_H)
    offs_d = tl.arange(0, BLOCK_D)
    # Negative slots are padding (CUDA-graph batches): mask off every head, nothing is touched. (Folded into
    # the head bound because the interpreter mishandles `scalar_bool & tensor_bool`.)
    heads_to_write = tl.where(slot >= 0, num_heads, 0)
    mask = (offs_h[:, None] < heads_to_write) & (offs_d[None, :] < HEAD_DIM)
    k = tl.load(k_ptr + t * stride_kt + offs_h[:, None] * stride_kh + offs_d[None, :], mask=mask)
    v = tl.load(v_ptr + t * stride_vt + offs_h[:, None] * stride_vh + offs_d[None, :], mask=mask)
    slot = tl.maximum(slot, 0)
    cache_off = (slot // BLOCK_SIZE) * stride_cb + (slot % BLOCK_SIZE) * stride_cs
    cache_off = cache_off + offs_h[:, None] * stride_ch + offs_d[None, :]
    if FP8:  # times the reciprocal scales: an IEEE-rounded product, where Triton's division is approximate
        k = _round_to_e4m3(k.to(tl.float32) * k_inv_scale)
        v = _round_to_e4m3(v.to(tl.float32) * v_inv_scale)
    tl.store(k_cache_ptr + cache_off, k.to(k_cache_ptr.dtype.element_ty), mask=mask)
    tl.store(v_cache_ptr + cache_off, v.to(v_cache_ptr.dtype.element_ty), mask=mask)


def write_kv_cache(
    k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, slot_mapping: torch.Tensor,
    k_scale: float = 1.0, v_scale: float = 1.0, pdl: bool = True,
) -> None:
    """Store ``k``/``v`` (``[T, Hkv, D]``, strided views allowed) at ``slot_mapping`` (``[T]``), quantized
    with the per-tensor ``k_scale``/``v_scale`` when the caches are fp8 (see ``reference.quantize_kv``).

    Negative slots are padding and skipped."""
    _check_cache(k_cache, v_cache)
    num_tokens, num_heads, head_dim = k.shape
    if num_tokens == 0:
        return
    assert k.stride(-1) == 1 and v.stride(-1) == 1, "k/v head_dim must be contiguous"
    _write_kv_cache_kernel[(num_tokens,)](
        k, v, k_cache, v_cache, slot_mapping,
        k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        num_heads, 1.0 / k_scale, 1.0 / v_scale,
        BLOCK_SIZE=k_cache.shape[1], HEAD_DIM=head_dim,
        BLOCK_H=triton.next_power_of_2(num_heads), BLOCK_D=triton.next_power_of_2(head_dim),
        FP8=k_cache.dtype == torch.float8_e4m3fn, **pdl_args(k, pdl),
    )


@triton.jit
def _rotary_write_kv_kernel(
    pos_ptr, q_ptr, k_ptr, v_ptr, cos_sin_ptr, k_cache_ptr, v_cache_ptr, slot_ptr,
    stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh, stride_cs,
    stride_cb, stride_cslot, stride_ch,
    num_q_heads, num_kv_heads, k_inv_scale, v_inv_scale,
    HALF: tl.constexpr, BLOCK_HALF: tl.constexpr, BLOCK_HQ: tl.constexpr, BLOCK_HKV: tl.constexpr,
    BLOCK_SIZE: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, FP8: tl.constexpr,
    PDL: tl.constexpr,
):
    # ``triton_fused.rotary_embedding`` then ``write_kv_cache`` in one pass: q rotated in place; k rotated
    # (rounded to its dtype, as the in-place rotation stores it) straight into the cache, with v.
    t = tl.program_id(0).to(tl.int64)
    gdc_launch_dependents(PDL)  # the next kernel may start and wait
    # The position, its cos/sin and the slot are step inputs and a table (no kernel writes them): read
    # before the wait, which leaves only q/k/v's loads after it.
    cos, sin = _rotary_cos_sin(pos_ptr, cos_sin_ptr, stride_cs, t, HALF, BLOCK_HALF)
    slot = tl.load(slot_ptr + t).to(tl.int64)
    gdc_wait(PDL)
    _rotate_heads(q_ptr, stride_qt, stride_qh, t, num_q_heads, cos, sin, BLOCK_HQ, HALF, BLOCK_HALF)
    offs_d = tl.arange(0, BLOCK_HALF)
    d_mask = offs_d < HALF
    offs_h = tl.arange(0, BLOCK_HKV)
    heads_to_write = tl.where(slot >= 0, num_kv_heads, 0)  # negative slots are padding: nothing written
    slot = tl.maximum(slot, 0)
    row = (slot // BLOCK_SIZE) * stride_cb + (slot % BLOCK_SIZE) * stride_cslot + offs_h[:, None] * stride_ch
    mask = (offs_h[:, None] < heads_to_write) & d_mask[None, :]
    k1_ptr = k_ptr + t * stride_kt + offs_h[:, None] * stride_kh + offs_d[None, :]
    r1, r2 = _rotate(tl.load(k1_ptr, mask=mask, other=0.0), tl.load(k1_ptr + HALF, mask=mask, other=0.0), cos, sin)
    r1, r2 = r1.to(k_ptr.dtype.element_ty), r2.to(k_ptr.dtype.element_ty)
    offs_v = tl.arange(0, BLOCK_D)
    v_mask = (offs_h[:, None] < heads_to_write) & (offs_v[None, :] < HEAD_DIM)
    v = tl.load(v_ptr + t * stride_vt + offs_h[:, None] * stride_vh + offs_v[None, :], mask=v_mask)
    if FP8:
        r1 = _round_to_e4m3(r1.to(tl.float32) * k_inv_scale)
        r2 = _round_to_e4m3(r2.to(tl.float32) * k_inv_scale)
        v = _round_to_e4m3(v.to(tl.float32) * v_inv_scale)
    tl.store(k_cache_ptr + row + offs_d[None, :], r1.to(k_cache_ptr.dtype.element_ty), mask=mask)
    tl.store(k_cache_ptr + row + HALF + offs_d[None, :], r2.to(k_cache_ptr.dtype.element_ty), mask=mask)
    tl.store(v_cache_ptr + row + offs_v[None, :], v.to(v_cache_ptr.dtype.element_ty), mask=v_mask)


def rotary_and_write_kv_cache(
    positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cos_sin_cache: torch.Tensor,
    k_cache: torch.Tensor, v_cache: torch.Tensor, slot_mapping: torch.Tensor,
    k_scale: float = 1.0, v_scale: float = 1.0, pdl: bool = True,
) -> torch.Tensor:
    """``rotary_embedding`` of ``q`` (in place; returned) and ``k``, and ``write_kv_cache`` of the rotated k
    and ``v``, in one kernel: the cache holds what the two would have written. ``k`` itself is left as
    it was."""
    _check_cache(k_cache, v_cache)
    num_tokens, num_q_heads, head_dim = q.shape
    num_kv_heads = k.shape[1]
    assert cos_sin_cache.shape[-1] == head_dim and head_dim % 2 == 0, "rotary dim must equal an even head_dim"
    assert q.stride(-1) == 1 and k.stride(-1) == 1 and v.stride(-1) == 1, "q/k/v head_dim must be contiguous"
    if num_tokens == 0:
        return q
    cos_sin_cache = cos_sin_cache.contiguous()
    half = head_dim // 2
    _rotary_write_kv_kernel[(num_tokens,)](
        positions, q, k, v, cos_sin_cache, k_cache, v_cache, slot_mapping,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1), cos_sin_cache.stride(0),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        num_q_heads, num_kv_heads, 1.0 / k_scale, 1.0 / v_scale,
        HALF=half, BLOCK_HALF=triton.next_power_of_2(half), BLOCK_HQ=triton.next_power_of_2(num_q_heads),
        BLOCK_HKV=triton.next_power_of_2(num_kv_heads), BLOCK_SIZE=k_cache.shape[1], HEAD_DIM=head_dim,
        BLOCK_D=triton.next_power_of_2(head_dim), FP8=k_cache.dtype == torch.float8_e4m3fn, **pdl_args(q, pdl),
    )
    return q


# --------------------------------------------------------------------------------------------------
# Attention over the paged cache: the key loop shared by decode and prefill
# --------------------------------------------------------------------------------------------------


@triton.jit
def _tanh(x):
    """tanh from one exp2 of a non-positive argument (no overflow); Triton has no tanh of its own."""
    t = tl.exp2(-2.0 * 1.4426950408889634 * tl.abs(x))  # log2(e): kernels take no module constants
    y = (1.0 - t) / (1.0 + t)
    return tl.where(x < 0, -y, y)


@triton.jit
def _attend_tiles(
    acc, l_i, m_i, q, q_pos,
    k_cache_ptr, v_cache_ptr, bt_row, head_off, seq_len, qk_scale,
    lo, hi,
    stride_cb, stride_cs,
    CAUSAL_MASK: tl.constexpr, LENGTH_MASK: tl.constexpr, BLOCK_SIZE: tl.constexpr, BLOCK_N: tl.constexpr,
    D_MASK, DOT_PRECISION: tl.constexpr,
    WINDOW: tl.constexpr = 0, WINDOW_MASK: tl.constexpr = False, SOFTCAP: tl.constexpr = False, softcap=1.0,
):
    """Online-softmax accumulation over keys ``[lo, hi)`` of one sequence, for decode and prefill programs
    alike: ``q`` ``[M, D]`` rows (query heads of a group, or query positions). ``CAUSAL_MASK`` hides keys
    after each row's ``q_pos`` and past ``seq_len``; ``LENGTH_MASK`` only those past ``seq_len``;
    ``WINDOW_MASK`` those at or before ``q_pos - WINDOW``; without any, every key of ``[lo, hi)`` must be
    visible to every row. ``SOFTCAP``: scores become ``softcap * tanh(scores / softcap)`` (``qk_scale`` is
    then in natural units, and the log2 factor is applied after the cap)."""
    offs_n = tl.arange(0, BLOCK_N)
    for n0 in range(lo, hi, BLOCK_N):
        pos = n0 + offs_n
        n_mask = pos < seq_len
        block_ids = tl.load(bt_row + pos // BLOCK_SIZE, mask=n_mask, other=0).to(tl.int64)
        kv_off = block_ids[:, None] * stride_cb + (pos % BLOCK_SIZE)[:, None] * stride_cs + head_off
        kv_mask = n_mask[:, None] & D_MASK[None, :]
        k = tl.load(k_cache_ptr + kv_off, mask=kv_mask, other=0.0).to(q.dtype)
        v = tl.load(v_cache_ptr + kv_off, mask=kv_mask, other=0.0).to(q.dtype)
        s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * qk_scale  # log2 units (natural with SOFTCAP)
        if SOFTCAP:
            s = _tanh(s / softcap) * (softcap * 1.4426950408889634)
        if CAUSAL_MASK:
            s = tl.where((pos[None, :] <= q_pos[:, None]) & n_mask[None, :], s, float("-inf"))
        elif LENGTH_MASK:
            s = tl.where(n_mask[None, :], s, float("-inf"))
        if WINDOW_MASK:
            s = tl.where(pos[None, :] > q_pos[:, None] - WINDOW, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        if WINDOW > 0:
            # A window can hide a whole tile from a row that has seen no key yet: keep its sums at zero.
            m_new = tl.where(m_new == float("-inf"), 0.0, m_new)
        # (Without a window every row sees at least one key of the first tile it visits, so m_new is finite.)
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
        m_i = m_new
    return acc, l_i, m_i


# --------------------------------------------------------------------------------------------------
# Decode attention (one query per sequence), optionally split-K
# --------------------------------------------------------------------------------------------------


@triton.jit
def _tiles_per_split(num_keys, NUM_SPLITS: tl.constexpr, BLOCK_N: tl.constexpr):
    """Key tiles in each split of a sequence's keys (the last live split may hold fewer); decode and reduce
    agree."""
    return tl.cdiv(tl.cdiv(num_keys, BLOCK_N), NUM_SPLITS)


@triton.jit
def _window_tile_start(seq_len, WINDOW: tl.constexpr, BLOCK_N: tl.constexpr):
    """The first key a decode query reads, rounded down to a tile: 0, or the start of its window's tile."""
    if WINDOW > 0:
        return (tl.maximum(seq_len - WINDOW, 0) // BLOCK_N) * BLOCK_N
    return seq_len * 0


@triton.jit
def _decode_kernel(
    q_ptr, k_cache_ptr, v_cache_ptr, block_tables_ptr, seq_lens_ptr,
    out_ptr, part_o_ptr, part_lse_ptr,
    stride_qb, stride_qh,
    stride_cb, stride_cs, stride_ch,
    stride_bt,
    stride_ob, stride_oh,
    qk_scale, v_scale, num_q_heads, sinks_ptr, softcap,
    NUM_SPLITS: tl.constexpr, GROUP: tl.constexpr, BLOCK_G: tl.constexpr,
    BLOCK_SIZE: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr,
    DOT_PRECISION: tl.constexpr, PDL: tl.constexpr,
    WINDOW: tl.constexpr = 0, SINKS: tl.constexpr = False, SOFTCAP: tl.constexpr = False,
):
    b = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    gdc_launch_dependents(PDL)  # the next kernel may start and wait
    # A step input (no kernel writes it): read before the wait.
    seq_len = tl.load(seq_lens_ptr + b)
    # This split's key range, whole BLOCK_N tiles so that only the sequence end needs masking. The split
    # count is fixed when a CUDA graph is captured (for max_model_len); a shorter sequence leaves the last
    # splits empty, and those store nothing (the reduce reads only the splits that hold keys). A window's
    # keys start at its first tile: blocks before it are never read.
    lo = _window_tile_start(seq_len, WINDOW, BLOCK_N)
    tiles_per_split = _tiles_per_split(seq_len - lo, NUM_SPLITS, BLOCK_N)
    start = lo + split * tiles_per_split * BLOCK_N
    end = tl.minimum(start + tiles_per_split * BLOCK_N, seq_len)
    gdc_wait(PDL)

    offs_g = tl.arange(0, BLOCK_G)
    offs_d = tl.arange(0, BLOCK_D)
    heads = kv_head * GROUP + offs_g
    g_mask = offs_g < GROUP
    d_mask = offs_d < HEAD_DIM

    q = tl.load(
        q_ptr + b * stride_qb + heads[:, None] * stride_qh + offs_d[None, :],
        mask=g_mask[:, None] & d_mask[None, :], other=0.0,
    )
    m_i = tl.full([BLOCK_G], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_G], tl.float32)
    acc = tl.zeros([BLOCK_G, BLOCK_D], tl.float32)

    bt_row = block_tables_ptr + b.to(tl.int64) * stride_bt
    head_off = kv_head * stride_ch + offs_d[None, :]
    # Keys [start, end): the split's end is the length mask; every visited tile holds a valid key (the
    # window's first tile holds its first key, seq_len - WINDOW, which every head's query sees).
    q_pos = seq_len - 1 + 0 * offs_g
    acc, l_i, m_i = _attend_tiles(
        acc, l_i, m_i, q, q_pos,
        k_cache_ptr, v_cache_ptr, bt_row, head_off, end, qk_scale,
        start, end,
        stride_cb, stride_cs,
        CAUSAL_MASK=False, LENGTH_MASK=True, BLOCK_SIZE=BLOCK_SIZE, BLOCK_N=BLOCK_N, D_MASK=d_mask,
        DOT_PRECISION=DOT_PRECISION, WINDOW=WINDOW, WINDOW_MASK=WINDOW > 0, SOFTCAP=SOFTCAP, softcap=softcap,
    )
    if SINKS and NUM_SPLITS == 1:  # each head's sink logit joins its denominator (split: in the reduce)
        sink = tl.load(sinks_ptr + heads, mask=g_mask, other=0.0).to(tl.float32) * 1.4426950408889634
        l_i = l_i + tl.where(l_i == 0.0, 0.0, tl.exp2(sink - m_i))
    # Empty ranges (padding rows with seq_len 0, or splits past the end) leave l_i == 0: emit zeros.
    empty = l_i == 0.0
    o = acc * (v_scale / tl.where(empty, 1.0, l_i))[:, None]
    if NUM_SPLITS == 1:
        tl.store(
            out_ptr + b * stride_ob + heads[:, None] * stride_oh + offs_d[None, :],
            o.to(out_ptr.dtype.element_ty), mask=g_mask[:, None] & d_mask[None, :],
        )
    else:
        # Partials are contiguous [B, Hq, NUM_SPLITS, BLOCK_D] and [B, Hq, NUM_SPLITS] float32.
        row = (b * num_q_heads + heads) * NUM_SPLITS + split
        live = g_mask & ((start + 0 * offs_g) < seq_len)  # a [BLOCK_G] mask: the interpreter takes no scalar
        tl.store(part_o_ptr + row[:, None] * BLOCK_D + offs_d[None, :], o, mask=live[:, None])
        lse = tl.where(empty, float("-inf"), m_i + tl.log2(tl.where(empty, 1.0, l_i)))
        tl.store(part_lse_ptr + row, lse, mask=live)


@triton.jit
def _decode_reduce_kernel(
    part_o_ptr, part_lse_ptr, out_ptr, seq_lens_ptr,
    stride_ob, stride_oh,
    num_q_heads, sinks_ptr,
    NUM_SPLITS: tl.constexpr, BLOCK_S: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
    BLOCK_N: tl.constexpr, PDL: tl.constexpr, WINDOW: tl.constexpr = 0, SINKS: tl.constexpr = False,
):
    b = tl.program_id(0)
    h = tl.program_id(1)
    gdc_launch_dependents(PDL)  # the next kernel may start and wait
    seq_len = tl.load(seq_lens_ptr + b)
    # The splits that hold keys (the decode kernel's split ranges); seq_len 0 has none.
    keys = seq_len - _window_tile_start(seq_len, WINDOW, BLOCK_N)
    live = tl.cdiv(tl.cdiv(keys, BLOCK_N), tl.maximum(_tiles_per_split(keys, NUM_SPLITS, BLOCK_N), 1))
    gdc_wait(PDL)
    offs_s = tl.arange(0, BLOCK_S)
    offs_d = tl.arange(0, BLOCK_D)
    s_mask = offs_s < live
    row = (b * num_q_heads + h) * NUM_SPLITS + offs_s
    lse = tl.load(part_lse_ptr + row, mask=s_mask, other=float("-inf"))
    m = tl.max(lse, 0)
    # All splits empty (seq_len 0): weights all zero, output zero.
    m = tl.where(m == float("-inf"), 0.0, m)
    w = tl.exp2(lse - m)
    denom = tl.sum(w, 0)
    if SINKS:  # the head's sink logit joins the denominator of every split's keys together
        sink = tl.load(sinks_ptr + h).to(tl.float32) * 1.4426950408889634
        denom = denom + tl.where(denom == 0.0, 0.0, tl.exp2(sink - m))
    o = tl.load(part_o_ptr + row[:, None] * BLOCK_D + offs_d[None, :], mask=s_mask[:, None], other=0.0)
    o = tl.sum(o * w[:, None], 0) / tl.where(denom == 0.0, 1.0, denom)
    tl.store(out_ptr + b * stride_ob + h * stride_oh + offs_d, o.to(out_ptr.dtype.element_ty), mask=offs_d < HEAD_DIM)


def _decode_num_splits(q: torch.Tensor, batch: int, num_kv_heads: int, max_seq_len: int) -> int:
    """Split the keys across programs only when (batch x kv heads) alone would leave SMs idle; then about
    ``_SPLIT_WAVES`` waves of programs, each at least one tile of keys (for ``max_seq_len``; shorter
    sequences leave splits empty, which cost a program that stores nothing)."""
    if not q.is_cuda:
        return 1
    sms = _num_sms(q.device.index if q.device.index is not None else torch.cuda.current_device())
    programs = batch * num_kv_heads
    if programs * 2 > _PROGRAMS_PER_SM * sms:
        return 1
    splits = min(triton.cdiv(_SPLIT_WAVES * sms, programs), triton.cdiv(max_seq_len, _MIN_KEYS_PER_SPLIT),
                 _MAX_SPLITS)
    return max(splits, 1)


def paged_decode_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    max_seq_len: int,
    scale: float,
    num_splits: int | None = None,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
    window: int | None = None,
    softcap: float | None = None,
    sinks: torch.Tensor | None = None,
    pdl: bool = True,
) -> torch.Tensor:
    """One query token per sequence: ``q`` ``[B, Hq, D]`` -> ``[B, Hq, D]`` (see ``reference.paged_decode_attention``).

    ``seq_lens`` (int32 ``[B]``, on the device) is authoritative; ``max_seq_len`` is only a hint (any value
    >= the true maximum) used to choose ``num_splits``, the number of programs the keys of one sequence are
    split across (flash-decoding). Pass ``num_splits`` to override the heuristic. ``k_scale``/``v_scale``
    dequantize an fp8 cache. ``window``/``softcap``/``sinks``: the layer's variant (``reference.attend``);
    a window's query reads only the tiles of its last ``window`` keys.
    """
    _check_cache(k_cache, v_cache)
    batch, num_q_heads, head_dim = q.shape
    _, block_size, num_kv_heads, _ = k_cache.shape
    assert num_q_heads % num_kv_heads == 0, "Hq must be a multiple of Hkv"
    assert q.stride(-1) == 1, "q head_dim must be contiguous"
    group = num_q_heads // num_kv_heads
    out = torch.empty(batch, num_q_heads, head_dim, dtype=q.dtype, device=q.device)
    if batch == 0:
        return out
    if num_splits is None:
        keys = max_seq_len if window is None else min(max_seq_len, window + _DECODE_BLOCK_N)
        num_splits = _decode_num_splits(q, batch, num_kv_heads, keys)
    block_d = max(16, triton.next_power_of_2(head_dim))  # tl.dot needs K >= 16; the padding is masked
    if num_splits > 1:
        part_o = torch.empty(batch, num_q_heads, num_splits, block_d, dtype=torch.float32, device=q.device)
        part_lse = torch.empty(batch, num_q_heads, num_splits, dtype=torch.float32, device=q.device)
    else:
        part_o = part_lse = out  # unused by the kernel
    _decode_kernel[(batch, num_kv_heads, num_splits)](
        q, k_cache, v_cache, block_tables, seq_lens,
        out, part_o, part_lse,
        q.stride(0), q.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        block_tables.stride(0),
        out.stride(0), out.stride(1),
        _qk_scale(scale * k_scale, softcap), v_scale, num_q_heads, _sinks_arg(sinks, q), float(softcap or 1.0),
        NUM_SPLITS=num_splits, GROUP=group,
        BLOCK_G=max(16, triton.next_power_of_2(group)),  # tl.dot needs M >= 16
        BLOCK_SIZE=block_size, HEAD_DIM=head_dim, BLOCK_D=block_d,
        BLOCK_N=_DECODE_BLOCK_N, DOT_PRECISION=_dot_precision(q.dtype),
        WINDOW=window or 0, SINKS=sinks is not None, SOFTCAP=softcap is not None,
        # 64-key tiles in 3 stages: the fastest decode configuration timed (docs/benchmarks.md).
        num_warps=4, num_stages=3 if q.element_size() <= 2 else 2, **pdl_args(q, pdl),
    )
    if num_splits > 1:
        _decode_reduce_kernel[(batch, num_q_heads)](
            part_o, part_lse, out, seq_lens,
            out.stride(0), out.stride(1),
            num_q_heads, _sinks_arg(sinks, q),
            NUM_SPLITS=num_splits, BLOCK_S=triton.next_power_of_2(num_splits),
            HEAD_DIM=head_dim, BLOCK_D=block_d, BLOCK_N=_DECODE_BLOCK_N, WINDOW=window or 0,
            SINKS=sinks is not None, **pdl_args(q, pdl),
        )
    return out


def _qk_scale(scale: float, softcap: float | None) -> float:
    """The factor of ``q . k``: in log2 units, or natural ones where the scores are soft-capped first."""
    return scale if softcap is not None else scale * _LOG2E


def _sinks_arg(sinks: torch.Tensor | None, like: torch.Tensor) -> torch.Tensor:
    """The sinks pointer argument (any tensor stands in when the layer has none: it is never read)."""
    if sinks is None:
        return like
    assert sinks.is_contiguous() and sinks.device == like.device, "sinks: one contiguous logit per query head"
    return sinks


# --------------------------------------------------------------------------------------------------
# Prefill attention (causal chunks of queries over the paged cache)
# --------------------------------------------------------------------------------------------------


@triton.jit
def _prefill_kernel(
    q_ptr, k_cache_ptr, v_cache_ptr, block_tables_ptr, query_start_loc_ptr, seq_lens_ptr, out_ptr,
    stride_qt, stride_qh,
    stride_cb, stride_cs, stride_ch,
    stride_bt,
    stride_ot, stride_oh,
    qk_scale, v_scale, sinks_ptr, softcap,
    GROUP: tl.constexpr, BLOCK_SIZE: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, DOT_PRECISION: tl.constexpr,
    WINDOW: tl.constexpr = 0, SINKS: tl.constexpr = False, SOFTCAP: tl.constexpr = False,
):
    m_block = tl.program_id(0)
    b = tl.program_id(1)
    head = tl.program_id(2)
    kv_head = head // GROUP

    q_start = tl.load(query_start_loc_ptr + b)
    q_len = tl.load(query_start_loc_ptr + b + 1) - q_start
    seq_len = tl.load(seq_lens_ptr + b)
    # The grid is sized for the longest query chunk; shorter sequences have nothing left to do.
    if m_block * BLOCK_M >= q_len:
        return
    context_len = seq_len - q_len  # cached prefix before this chunk

    offs_m = m_block * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    m_mask = offs_m < q_len
    d_mask = offs_d < HEAD_DIM
    q_rows = (q_start + offs_m).to(tl.int64)
    q = tl.load(
        q_ptr + q_rows[:, None] * stride_qt + head * stride_qh + offs_d[None, :],
        mask=m_mask[:, None] & d_mask[None, :], other=0.0,
    )
    q_pos = context_len + offs_m

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    bt_row = block_tables_ptr + b.to(tl.int64) * stride_bt
    head_off = kv_head * stride_ch + offs_d[None, :]

    # Keys below the block's first query position are visible to all its rows: no causal mask needed there.
    # With a window, keys start at the first query's window (its tile: earlier blocks are never read), and
    # those before the last query's window need the window mask: [lo, mid) window-masked, [mid,
    # unmasked_end) unmasked, [unmasked_end, masked_end) causal (and window) masked.
    first_q_pos = context_len + m_block * BLOCK_M
    unmasked_end = (first_q_pos // BLOCK_N) * BLOCK_N
    masked_end = tl.minimum(first_q_pos + BLOCK_M, seq_len)
    if WINDOW > 0:
        lo = (tl.maximum(first_q_pos - WINDOW + 1, 0) // BLOCK_N) * BLOCK_N
        mid = tl.cdiv(tl.maximum(masked_end - WINDOW, 0), BLOCK_N) * BLOCK_N  # the last row's window, a tile up
        mid = tl.minimum(tl.maximum(mid, lo), unmasked_end)
        acc, l_i, m_i = _attend_tiles(
            acc, l_i, m_i, q, q_pos, k_cache_ptr, v_cache_ptr, bt_row, head_off, seq_len, qk_scale,
            lo, mid, stride_cb, stride_cs,
            CAUSAL_MASK=False, LENGTH_MASK=False, BLOCK_SIZE=BLOCK_SIZE, BLOCK_N=BLOCK_N, D_MASK=d_mask,
            DOT_PRECISION=DOT_PRECISION, WINDOW=WINDOW, WINDOW_MASK=True, SOFTCAP=SOFTCAP, softcap=softcap,
        )
    else:
        mid = unmasked_end * 0
    acc, l_i, m_i = _attend_tiles(
        acc, l_i, m_i, q, q_pos, k_cache_ptr, v_cache_ptr, bt_row, head_off, seq_len, qk_scale,
        mid, unmasked_end, stride_cb, stride_cs,
        CAUSAL_MASK=False, LENGTH_MASK=False, BLOCK_SIZE=BLOCK_SIZE, BLOCK_N=BLOCK_N, D_MASK=d_mask,
        DOT_PRECISION=DOT_PRECISION, WINDOW=WINDOW, SOFTCAP=SOFTCAP, softcap=softcap,
    )
    acc, l_i, m_i = _attend_tiles(
        acc, l_i, m_i, q, q_pos, k_cache_ptr, v_cache_ptr, bt_row, head_off, seq_len, qk_scale,
        tl.maximum(unmasked_end, mid), masked_end, stride_cb, stride_cs,
        CAUSAL_MASK=True, LENGTH_MASK=True, BLOCK_SIZE=BLOCK_SIZE, BLOCK_N=BLOCK_N, D_MASK=d_mask,
        DOT_PRECISION=DOT_PRECISION, WINDOW=WINDOW, WINDOW_MASK=WINDOW > 0, SOFTCAP=SOFTCAP, softcap=softcap,
    )
    if SINKS:  # the head's sink logit joins every row's denominator
        sink = tl.load(sinks_ptr + head).to(tl.float32) * 1.4426950408889634
        l_i = l_i + tl.exp2(sink - m_i)
    if WINDOW > 0:  # rows past the chunk's end may see no key at all (never stored): no division by zero
        l_i = tl.where(l_i == 0.0, 1.0, l_i)

    o = acc * (v_scale / l_i)[:, None]
    tl.store(
        out_ptr + q_rows[:, None] * stride_ot + head * stride_oh + offs_d[None, :],
        o.to(out_ptr.dtype.element_ty), mask=m_mask[:, None] & d_mask[None, :],
    )


def _prefill_config(max_query_len: int, block_d: int, element_size: int) -> tuple[int, int, int, int]:
    """``(BLOCK_M, BLOCK_N, num_warps, num_stages)`` for the prefill kernel."""
    if max_query_len < 64:
        # Short chunks (decode-like steps mixed into a prefill batch): don't pad to a big query tile.
        return max(16, triton.next_power_of_2(max_query_len)), 64, 4, 2
    if max_query_len >= 512 and block_d <= 128 and element_size <= 2:
        # 128 x 128 tiles beat 64 x 64 on long prompts (docs/benchmarks.md); the 3-stage K/V ring needs ~220 KB
        # of shared memory, hence 16-bit inputs and D <= 128 only.
        return 128, 128, 8, 3
    return 64, 64 if block_d <= 128 else 32, 4, 2


def paged_prefill_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    max_query_len: int,
    scale: float,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
    window: int | None = None,
    softcap: float | None = None,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """Causal attention for chunks of queries over the paged cache (see ``reference.paged_prefill_attention``).

    ``q`` is ``[T, Hq, D]``; ``query_start_loc`` (int32 ``[B+1]``) delimits each sequence's queries in ``q``;
    ``seq_lens`` (int32 ``[B]``) counts each sequence's tokens including the cached prefix. ``max_query_len``
    sizes the grid and must be >= the longest chunk. ``window``/``softcap``/``sinks``: the layer's variant.
    """
    _check_cache(k_cache, v_cache)
    num_tokens, num_q_heads, head_dim = q.shape
    _, block_size, num_kv_heads, _ = k_cache.shape
    assert num_q_heads % num_kv_heads == 0, "Hq must be a multiple of Hkv"
    assert q.stride(-1) == 1, "q head_dim must be contiguous"
    batch = seq_lens.shape[0]
    out = torch.empty(num_tokens, num_q_heads, head_dim, dtype=q.dtype, device=q.device)
    if num_tokens == 0 or batch == 0 or max_query_len == 0:
        return out
    block_d = max(16, triton.next_power_of_2(head_dim))  # tl.dot needs K >= 16; the padding is masked
    block_m, block_n, num_warps, num_stages = _prefill_config(max_query_len, block_d, q.element_size())
    grid = (triton.cdiv(max_query_len, block_m), batch, num_q_heads)
    _prefill_kernel[grid](
        q, k_cache, v_cache, block_tables, query_start_loc, seq_lens, out,
        q.stride(0), q.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        block_tables.stride(0),
        out.stride(0), out.stride(1),
        _qk_scale(scale * k_scale, softcap), v_scale, _sinks_arg(sinks, q), float(softcap or 1.0),
        GROUP=num_q_heads // num_kv_heads, BLOCK_SIZE=block_size, HEAD_DIM=head_dim, BLOCK_D=block_d,
        BLOCK_M=block_m, BLOCK_N=block_n, DOT_PRECISION=_dot_precision(q.dtype),
        WINDOW=window or 0, SINKS=sinks is not None, SOFTCAP=softcap is not None,
        num_warps=num_warps, num_stages=num_stages,
    )
    return out
