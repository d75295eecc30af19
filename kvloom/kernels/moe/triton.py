"""The fused MoE in Triton: a step's (token, expert) rows sorted by expert and padded to the block size
(``align.moe_align``'s order, built by one small kernel), then two grouped GEMMs, one launch each, every program
reading its block's expert id: gate/up with the gated activation in its epilogue (both halves of a tile's outputs
accumulated side by side), and down with the bias and top-k weight in its epilogue; a sum over each token's top-k
rows ends it. Weights dense or quantized (``weights``), dequantized in registers."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kvloom.kernels.moe.align import ExpertBlocks, block_capacity
from kvloom.kernels.moe.reference import MoEActivation
from kvloom.kernels.moe.weights import FP8_BLOCK, ExpertWeights, KernelWeight, dense_kernel_weight
from kvloom.kernels.options import DEFAULT_KERNELS, KernelOptions
from kvloom.kernels.triton_attention import _dot_precision

# Tiles by the rows an expert gets on average (tokens x top-k / experts), ``((up to rows, tile), ...)`` with
# None for the rest: the 16-row tile for decode, taller ones as batches grow. Tuned on the GPU separately.
MOE_TILES = (
    (16, dict(BLOCK_M=16, BLOCK_N=64, BLOCK_K=128, num_warps=4, num_stages=3)),
    (48, dict(BLOCK_M=32, BLOCK_N=64, BLOCK_K=64, num_warps=4, num_stages=3)),
    (None, dict(BLOCK_M=64, BLOCK_N=64, BLOCK_K=64, num_warps=4, num_stages=3)),
)


def moe_tiles(num_tokens: int, top_k: int, num_experts: int, options: KernelOptions = DEFAULT_KERNELS) -> dict:
    """The tile for a step of ``num_tokens`` tokens (``options.moe_tiles`` replaces the built-in table)."""
    rows = -(-num_tokens * top_k // num_experts)
    for limit, tile in options.moe_tiles or MOE_TILES:
        if limit is None or rows <= limit:
            return dict(tile)
    return dict((options.moe_tiles or MOE_TILES)[-1][1])


@triton.jit
def _weight_tile(w_ptr, s_ptr, z_ptr, g_ptr, e, rn, row0, srow0, rk, n_ok, k_ok, N, K, s_se, s_sr, group_size,
                 scale_bn, scale_bk, HALF: tl.constexpr, FORMAT: tl.constexpr, BITS: tl.constexpr,
                 GIDX_HALVES: tl.constexpr, DTYPE: tl.constexpr):
    """Expert ``e``'s weight at inputs ``rk`` and outputs ``row0 + rn`` of its ``[N, K]`` rows, as a
    ``[BLOCK_K, BLOCK_N]`` tile of ``W.T`` in ``DTYPE``; ``srow0``: the block-FP8 scale row of output ``row0``."""
    e64 = e.to(tl.int64)
    cols = (row0 + rn).to(tl.int64)
    mask = k_ok[:, None] & n_ok[None, :]
    if FORMAT == 3:  # MXFP4: byte k // 2, low nibble for even k; e2m1 and e8m0 built as float32 bit patterns
        half_k = K // 2
        b = tl.load(w_ptr + e64 * N * half_k + cols[None, :] * half_k + (rk // 2)[:, None], mask=mask, other=0)
        nib = (b.to(tl.int32) >> ((rk % 2) * 4)[:, None]) & 15
        ex = (nib >> 1) & 3
        man = nib & 1
        mag = tl.where(ex == 0, man * (126 << 23), ((ex + 126) << 23) | (man << 22)).to(tl.float32, bitcast=True)
        sb = tl.load(s_ptr + e64 * s_se + cols[None, :] * s_sr + (rk // 32)[:, None], mask=mask, other=127)
        sb = sb.to(tl.int32)
        scale = tl.where(sb == 0, 0x400000, sb << 23).to(tl.float32, bitcast=True)  # 2 ** (sb - 127)
        w = (tl.where(nib >= 8, -mag, mag) * scale).to(DTYPE)
    elif FORMAT == 4:  # AWQ/GPTQ, packed along the inputs: (q - z) * s of input k's group
        PER: tl.constexpr = 32 // BITS
        MASK: tl.constexpr = (1 << BITS) - 1
        words = tl.load(w_ptr + e64 * (K // PER) * N + (rk // PER)[:, None].to(tl.int64) * N + cols[None, :],
                        mask=mask, other=0)
        q = (words >> ((rk % PER) * BITS)[:, None]) & MASK
        if GIDX_HALVES > 0:
            g = tl.load(g_ptr + (e64 * GIDX_HALVES + HALF) * K + rk, mask=k_ok, other=0)
        else:
            g = rk // group_size
        off = e64 * s_se + g[:, None].to(tl.int64) * s_sr + cols[None, :]
        z = tl.load(z_ptr + off, mask=mask, other=0).to(tl.int32)
        s = tl.load(s_ptr + off, mask=mask, other=0.0).to(tl.float32)
        w = ((q - z).to(tl.float32) * s).to(DTYPE)
    else:  # dense, or FP8 (per-channel scales applied to the accumulator, block scales here)
        w = tl.load(w_ptr + e64 * N * K + cols[None, :] * K + rk[:, None], mask=mask, other=0.0)
        if FORMAT == 2:
            s = tl.load(s_ptr + e64 * s_se + (srow0 + rn // scale_bn)[None, :].to(tl.int64) * s_sr
                        + (rk // scale_bk)[:, None], mask=mask, other=0.0)
            w = (w.to(tl.float32) * s).to(DTYPE)
        else:
            w = w.to(DTYPE)
    return w


@triton.jit
def _moe_gate_up_kernel(
    x_ptr, w_ptr, s_ptr, z_ptr, g_ptr, bias_ptr, out_ptr, sorted_ptr, expert_ptr,
    num_rows, I, K, stride_xm, s_se, s_sr, group_size, scale_bn, scale_bk, up_srow, alpha, limit,
    TOP_K: tl.constexpr, FORMAT: tl.constexpr, BITS: tl.constexpr, GIDX_HALVES: tl.constexpr,
    ACTIVATION: tl.constexpr, HAS_BIAS: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, DOT_PRECISION: tl.constexpr,
):
    """``out[row, n] = act(gate, up)`` of ``x[row // TOP_K] @ w13[e].T`` for a block of one expert's sorted rows
    and a tile of ``n`` in ``[0, I)``: the gate (outputs ``n``) and up (``I + n``) accumulated side by side."""
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    e = tl.load(expert_ptr + pid_m)
    if e < 0:  # past the last expert's run
        return
    rows = tl.load(sorted_ptr + pid_m * BLOCK_M + tl.arange(0, BLOCK_M))
    m_ok = rows < num_rows
    x_rows = x_ptr + (rows // TOP_K)[:, None].to(tl.int64) * stride_xm
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = rn < I
    N = 2 * I
    dtype = x_ptr.dtype.element_ty
    acc_g = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    acc_u = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        rk = k0 + tl.arange(0, BLOCK_K)
        k_ok = rk < K
        x = tl.load(x_rows + rk[None, :], mask=m_ok[:, None] & k_ok[None, :], other=0.0)
        wg = _weight_tile(w_ptr, s_ptr, z_ptr, g_ptr, e, rn, 0, 0, rk, n_ok, k_ok, N, K, s_se, s_sr, group_size,
                          scale_bn, scale_bk, 0, FORMAT, BITS, GIDX_HALVES, dtype)
        acc_g = tl.dot(x, wg, acc_g, input_precision=DOT_PRECISION)
        wu = _weight_tile(w_ptr, s_ptr, z_ptr, g_ptr, e, rn, I, up_srow, rk, n_ok, k_ok, N, K, s_se, s_sr,
                          group_size, scale_bn, scale_bk, GIDX_HALVES - 1 if GIDX_HALVES > 1 else 0, FORMAT, BITS,
                          GIDX_HALVES, dtype)
        acc_u = tl.dot(x, wu, acc_u, input_precision=DOT_PRECISION)
    e64 = e.to(tl.int64)
    if FORMAT == 1:  # per-channel FP8 scales commute with the sum over K
        acc_g *= tl.load(s_ptr + e64 * s_se + rn, mask=n_ok, other=0.0)[None, :]
        acc_u *= tl.load(s_ptr + e64 * s_se + I + rn, mask=n_ok, other=0.0)[None, :]
    if HAS_BIAS:
        acc_g += tl.load(bias_ptr + e64 * N + rn, mask=n_ok, other=0.0).to(tl.float32)[None, :]
        acc_u += tl.load(bias_ptr + e64 * N + I + rn, mask=n_ok, other=0.0).to(tl.float32)[None, :]
    # rounded to the activations' dtype first, as the reference's gate_up is
    g = acc_g.to(dtype).to(tl.float32)
    u = acc_u.to(dtype).to(tl.float32)
    if ACTIVATION == 0:  # silu(gate) * up
        act = g / (1.0 + tl.exp(-g)) * u
    else:  # gpt-oss: clamped, gate * sigmoid(alpha * gate) * (up + 1)
        g = tl.minimum(g, limit)
        u = tl.minimum(tl.maximum(u, -limit), limit)
        act = g / (1.0 + tl.exp(-alpha * g)) * (u + 1.0)
    tl.store(out_ptr + rows[:, None].to(tl.int64) * I + rn[None, :], act.to(dtype), mask=m_ok[:, None] & n_ok[None, :])


@triton.jit
def _moe_down_kernel(
    a_ptr, w_ptr, s_ptr, z_ptr, g_ptr, bias_ptr, tw_ptr, out_ptr, sorted_ptr, expert_ptr,
    num_rows, N, K, s_se, s_sr, group_size, scale_bn, scale_bk,
    FORMAT: tl.constexpr, BITS: tl.constexpr, GIDX_HALVES: tl.constexpr, HAS_BIAS: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, DOT_PRECISION: tl.constexpr,
):
    """``out[row, n] = topk_weight[row] * (a[row] @ w2[e].T + bias)[n]`` (float32) for a block of one expert's
    sorted rows; each (token, expert) row is written once, so the top-k sum after needs no atomics."""
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    e = tl.load(expert_ptr + pid_m)
    if e < 0:
        return
    rows = tl.load(sorted_ptr + pid_m * BLOCK_M + tl.arange(0, BLOCK_M))
    m_ok = rows < num_rows
    rows64 = rows.to(tl.int64)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = rn < N
    dtype = a_ptr.dtype.element_ty
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        rk = k0 + tl.arange(0, BLOCK_K)
        k_ok = rk < K
        a = tl.load(a_ptr + rows64[:, None] * K + rk[None, :], mask=m_ok[:, None] & k_ok[None, :], other=0.0)
        w = _weight_tile(w_ptr, s_ptr, z_ptr, g_ptr, e, rn, 0, 0, rk, n_ok, k_ok, N, K, s_se, s_sr, group_size,
                         scale_bn, scale_bk, 0, FORMAT, BITS, GIDX_HALVES, dtype)
        acc = tl.dot(a, w, acc, input_precision=DOT_PRECISION)
    e64 = e.to(tl.int64)
    if FORMAT == 1:
        acc *= tl.load(s_ptr + e64 * s_se + rn, mask=n_ok, other=0.0)[None, :]
    if HAS_BIAS:
        acc += tl.load(bias_ptr + e64 * N + rn, mask=n_ok, other=0.0).to(tl.float32)[None, :]
    weight = tl.load(tw_ptr + rows, mask=m_ok, other=0.0).to(tl.float32)
    acc = acc.to(dtype).to(tl.float32) * weight[:, None]
    tl.store(out_ptr + rows64[:, None] * N + rn[None, :], acc, mask=m_ok[:, None] & n_ok[None, :])


@triton.jit
def _moe_align_kernel(ids_ptr, offsets_ptr, rank_ptr, sorted_ptr, expert_ptr, num_rows, num_experts, num_blocks,
                      BLOCK_M: tl.constexpr, ROWS: tl.constexpr, EXPERTS: tl.constexpr, BLOCKS: tl.constexpr):
    """``align.moe_align`` in one program (one launch instead of a dozen small PyTorch kernels a layer): each row
    takes its rank within its expert from an atomic counter, the padded runs' starts are a cumulative sum, then
    each row is placed at its run's start plus its rank. Phases share global memory behind barriers (one CTA);
    the order of rows within an expert's run is any (each row's products do not depend on it)."""
    re = tl.arange(0, EXPERTS)
    e_ok = re < num_experts
    tl.store(offsets_ptr + re, tl.zeros((EXPERTS,), dtype=tl.int32), mask=e_ok)
    tl.debug_barrier()
    for r0 in range(0, num_rows, ROWS):
        r = r0 + tl.arange(0, ROWS)
        ok = r < num_rows
        e = tl.load(ids_ptr + r, mask=ok, other=0).to(tl.int32)
        rank = tl.atomic_add(offsets_ptr + e, tl.full((ROWS,), 1, tl.int32), mask=ok, sem="relaxed")
        tl.store(rank_ptr + r, rank, mask=ok)
    tl.debug_barrier()
    counts = tl.load(offsets_ptr + re, mask=e_ok, other=0, cache_modifier=".cg")
    padded = (counts + BLOCK_M - 1) // BLOCK_M * BLOCK_M
    padded_end = tl.cumsum(padded, 0)
    total = tl.sum(padded, 0)
    tl.debug_barrier()  # every thread has read the counts before they become offsets
    tl.store(offsets_ptr + re, padded_end - padded, mask=e_ok)
    for b0 in range(0, num_blocks, BLOCKS):
        b = b0 + tl.arange(0, BLOCKS)
        start = b * BLOCK_M
        # a block's expert: how many runs end at or before its start (empty runs included)
        before = (padded_end[None, :] <= start[:, None]) & e_ok[None, :]
        expert = tl.where(start < total, tl.sum(before.to(tl.int32), 1), -1)
        tl.store(expert_ptr + b, expert, mask=b < num_blocks)
        slots = start[:, None] + tl.arange(0, BLOCK_M)[None, :]
        tl.store(sorted_ptr + slots, tl.full((BLOCKS, BLOCK_M), 0, tl.int32) + num_rows, mask=(b < num_blocks)[:, None])
    tl.debug_barrier()
    for r0 in range(0, num_rows, ROWS):
        r = r0 + tl.arange(0, ROWS)
        ok = r < num_rows
        e = tl.load(ids_ptr + r, mask=ok, other=0).to(tl.int32)
        dest = tl.load(offsets_ptr + e, mask=ok, other=0, cache_modifier=".cg") + \
            tl.load(rank_ptr + r, mask=ok, other=0, cache_modifier=".cg")
        tl.store(sorted_ptr + dest, r, mask=ok)


def moe_align_triton(topk_ids: torch.Tensor, num_experts: int, block_m: int) -> ExpertBlocks:
    """``align.moe_align`` by ``_moe_align_kernel``."""
    flat = topk_ids.reshape(-1)
    if not flat.is_contiguous():
        flat = flat.contiguous()
    num_rows = flat.numel()
    capacity = block_capacity(num_rows, num_experts, block_m)
    device = flat.device
    sorted_rows = torch.empty(capacity, dtype=torch.int32, device=device)
    block_expert = torch.empty(capacity // block_m, dtype=torch.int32, device=device)
    offsets = torch.empty(num_experts, dtype=torch.int32, device=device)
    rank = torch.empty(max(num_rows, 1), dtype=torch.int32, device=device)
    experts = triton.next_power_of_2(num_experts)
    _moe_align_kernel[(1,)](flat, offsets, rank, sorted_rows, block_expert, num_rows, num_experts,
                            capacity // block_m, BLOCK_M=block_m, ROWS=min(1024, triton.next_power_of_2(num_rows)),
                            EXPERTS=experts, BLOCKS=max(16, min(64, 8192 // experts)), num_warps=8)
    return ExpertBlocks(sorted_rows, block_expert, num_rows, block_m)


def kernel_weight(w: torch.Tensor | ExpertWeights) -> KernelWeight:
    return w.kernel_weight() if isinstance(w, ExpertWeights) else dense_kernel_weight(w)


def _weight_args(kw: KernelWeight) -> tuple[list, dict]:
    """(pointer and scalar arguments, constexprs) of a projection; absent tensors point at the weight."""
    dummy = kw.weight
    args = [kw.weight, dummy if kw.scale is None else kw.scale, dummy if kw.zeros is None else kw.zeros,
            dummy if kw.g_idx is None else kw.g_idx]
    scalars = [kw.scale_stride_e, kw.scale_stride_r, kw.group_size, kw.block[0], kw.block[1]]
    return args + scalars, dict(FORMAT=kw.fmt, BITS=kw.bits, GIDX_HALVES=kw.gidx_halves if kw.g_idx is not None else 0)


def fused_experts_triton(x: torch.Tensor, w13: torch.Tensor | ExpertWeights, w2: torch.Tensor | ExpertWeights,
                         topk_weights: torch.Tensor, topk_ids: torch.Tensor, *,
                         activation: MoEActivation | str = MoEActivation.SILU, w13_bias: torch.Tensor | None = None,
                         w2_bias: torch.Tensor | None = None, swiglu_alpha: float = 1.702, swiglu_limit: float = 7.0,
                         tiles: dict | None = None, options: KernelOptions = DEFAULT_KERNELS) -> torch.Tensor:
    """``reference.fused_experts_reference`` on the Triton kernels; ``w13``/``w2`` dense ``[E, N, K]`` tensors or
    ``weights`` objects. ``tiles`` fixes the tile (a test's or benchmark's), else ``moe_tiles``."""
    activation = MoEActivation(activation)
    num_tokens, hidden = x.shape
    top_k = topk_ids.shape[1]
    k13, k2 = kernel_weight(w13), kernel_weight(w2)
    num_experts, n13, k_in = w13.shape
    inter = n13 // 2
    if k_in != hidden or n13 % 2 or tuple(w2.shape) != (num_experts, hidden, inter):
        raise ValueError(f"fused_experts: w13 {tuple(w13.shape)} and w2 {tuple(w2.shape)} do not fit x "
                         f"{tuple(x.shape)}: expected w13 [E, 2*I, {hidden}] and w2 [E, {hidden}, I]")
    if k13.fmt == FP8_BLOCK and k13.up_scale_row < 0:
        raise ValueError(f"fused_experts: w13's FP8 scale blocks of {k13.block[0]} rows straddle its gate and up "
                         f"halves of {inter} rows: stack gate and up with their own scale grids (halves=2)")
    if num_tokens == 0:
        return torch.empty(0, hidden, dtype=x.dtype, device=x.device)
    tile = dict(tiles or moe_tiles(num_tokens, top_k, num_experts, options))
    launch = dict(num_warps=tile.pop("num_warps", 4), num_stages=tile.pop("num_stages", 2))
    if x.element_size() == 4 and not tiles:  # float32 tiles: three stages of the gate and up tiles overflow sm90's smem
        launch["num_stages"] = min(launch["num_stages"], 2)
    blocks = moe_align_triton(topk_ids, num_experts, tile["BLOCK_M"])
    if x.stride(-1) != 1:
        x = x.contiguous()
    num_rows = num_tokens * top_k
    precision = _dot_precision(x.dtype)
    act = torch.empty(num_rows, inter, dtype=x.dtype, device=x.device)
    args, const = _weight_args(k13)
    grid = (blocks.block_expert.numel(), triton.cdiv(inter, tile["BLOCK_N"]))
    _moe_gate_up_kernel[grid](
        x, *args[:4], x if w13_bias is None else w13_bias, act, blocks.sorted_rows, blocks.block_expert,
        num_rows, inter, hidden, x.stride(0), *args[4:], k13.up_scale_row, swiglu_alpha, swiglu_limit,
        TOP_K=top_k, ACTIVATION=0 if activation == MoEActivation.SILU else 1, HAS_BIAS=w13_bias is not None,
        DOT_PRECISION=precision, **const, **tile, **launch)
    rows_out = torch.empty(num_rows, hidden, dtype=torch.float32, device=x.device)
    args, const = _weight_args(k2)
    grid = (blocks.block_expert.numel(), triton.cdiv(hidden, tile["BLOCK_N"]))
    _moe_down_kernel[grid](
        act, *args[:4], act if w2_bias is None else w2_bias, topk_weights.reshape(-1).contiguous(), rows_out,
        blocks.sorted_rows, blocks.block_expert, num_rows, hidden, inter, *args[4:],
        HAS_BIAS=w2_bias is not None, DOT_PRECISION=precision, **const, **tile, **launch)
    return torch.sum(rows_out.view(num_tokens, top_k, hidden), dim=1).to(x.dtype)
