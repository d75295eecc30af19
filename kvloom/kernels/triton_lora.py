"""Triton kernels that apply every LoRA adapter of a step in two launches per layer: ``shrink`` (each token's
input times its adapter's down-projections, all slices of a merged layer at once) and ``expand`` (that
times the up-projections, scaled, added to the layer's output across all its slices).

The step's tokens arrive grouped by adapter slot (``sorted_tokens``, ``seg_start``, ``seg_slot``: see
``lora_reference``), so each program multiplies a tile of one segment's tokens by one slot's weights, as in
Punica's segmented GEMM. The grid covers ``max_loras`` segments of up to every token each; programs past
their segment's end return at once, so the launch shape depends only on the token count and a CUDA graph
captured for it serves any mix of adapters.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


def _block_r(rank: int) -> int:
    return max(16, triton.next_power_of_2(rank))  # tl.dot's smallest inner size


@triton.jit
def _lora_shrink_kernel(
    x_ptr, a_ptr, out_ptr, sorted_ptr, seg_start_ptr, seg_slot_ptr,
    K, N, stride_xm, stride_a_slot, stride_om,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, SPLIT_K: tl.constexpr,
):
    """out[tok, n] (+)= sum_k x[tok, k] * a[slot, n, k] over a segment's tokens; ``a[slot]`` is ``[N, K]``
    with ``N`` = slices x rank. With ``SPLIT_K`` > 1 each program adds its share of ``K`` atomically."""
    seg = tl.program_id(0)
    pid_m = tl.program_id(1)
    pid_nk = tl.program_id(2)
    pid_n = pid_nk // SPLIT_K
    pid_k = pid_nk % SPLIT_K
    slot = tl.load(seg_slot_ptr + seg)
    lo = tl.load(seg_start_ptr + seg)
    hi = tl.load(seg_start_ptr + seg + 1)
    m0 = lo + pid_m * BLOCK_M
    if slot < 0 or m0 >= hi:
        return
    offs_m = m0 + tl.arange(0, BLOCK_M)
    mask_m = offs_m < hi
    rows = tl.load(sorted_ptr + offs_m, mask=mask_m, other=0).to(tl.int64)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_n = offs_n < N
    a_base = a_ptr + slot.to(tl.int64) * stride_a_slot
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(pid_k * BLOCK_K, K, BLOCK_K * SPLIT_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        mask_k = offs_k < K
        xt = tl.load(x_ptr + rows[:, None] * stride_xm + offs_k[None, :], mask=mask_m[:, None] & mask_k[None, :],
                     other=0.0)
        at = tl.load(a_base + offs_n[None, :] * K + offs_k[:, None], mask=mask_n[None, :] & mask_k[:, None],
                     other=0.0)
        acc += tl.dot(xt, at, input_precision="ieee")
    dst = out_ptr + rows[:, None] * stride_om + offs_n[None, :]
    mask = mask_m[:, None] & mask_n[None, :]
    if SPLIT_K == 1:
        tl.store(dst, acc, mask=mask)
    else:
        tl.atomic_add(dst, acc, mask=mask)


@triton.jit
def _lora_expand_kernel(
    buf_ptr, b_ptr, scale_ptr, y_ptr, sorted_ptr, seg_start_ptr, seg_slot_ptr,
    N, RANK, off1, off2, stride_bufm, stride_b_slot, stride_ym,
    NUM_SLICES: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_R: tl.constexpr,
):
    """y[tok, n] += scale[slot, s] * sum_r buf[tok, s, r] * b[slot, n, r], where output ``n`` lies in slice
    ``s`` (slices start at 0, ``off1``, ``off2``). A tile of outputs that spans two slices takes a product
    for each; most tiles lie within one."""
    seg = tl.program_id(0)
    pid_m = tl.program_id(1)
    pid_n = tl.program_id(2)
    slot = tl.load(seg_slot_ptr + seg)
    lo = tl.load(seg_start_ptr + seg)
    hi = tl.load(seg_start_ptr + seg + 1)
    m0 = lo + pid_m * BLOCK_M
    if slot < 0 or m0 >= hi:
        return
    offs_m = m0 + tl.arange(0, BLOCK_M)
    mask_m = offs_m < hi
    rows = tl.load(sorted_ptr + offs_m, mask=mask_m, other=0).to(tl.int64)
    n0 = pid_n * BLOCK_N
    offs_n = n0 + tl.arange(0, BLOCK_N)
    mask_n = offs_n < N
    offs_r = tl.arange(0, BLOCK_R)
    mask_r = offs_r < RANK
    b_base = b_ptr + slot.to(tl.int64) * stride_b_slot
    bt = tl.load(b_base + offs_n[None, :] * RANK + offs_r[:, None], mask=mask_n[None, :] & mask_r[:, None], other=0.0)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for s in tl.static_range(NUM_SLICES):
        start = 0 if s == 0 else (off1 if s == 1 else off2)
        end = N if s == NUM_SLICES - 1 else (off1 if s == 0 else off2)
        if (n0 < end) & (n0 + BLOCK_N > start):
            h = tl.load(buf_ptr + rows[:, None] * stride_bufm + s * RANK + offs_r[None, :],
                        mask=mask_m[:, None] & mask_r[None, :], other=0.0)
            in_slice = (offs_n >= start) & (offs_n < end)
            part = tl.dot(h.to(bt.dtype), tl.where(in_slice[None, :], bt, 0.0), input_precision="ieee")
            acc += part * tl.load(scale_ptr + slot * NUM_SLICES + s)
    dst = y_ptr + rows[:, None] * stride_ym + offs_n[None, :]
    mask = mask_m[:, None] & mask_n[None, :]
    y = tl.load(dst, mask=mask, other=0.0)
    tl.store(dst, (y.to(tl.float32) + acc).to(y_ptr.dtype.element_ty), mask=mask)


def shrink_tiles(num_tokens: int, n: int, k: int) -> dict:
    """Tile sizes and K-split of the shrink: a few tokens split K so a decode step fills the device."""
    block_n = min(64, max(16, triton.next_power_of_2(n)))
    split_k = 1 if num_tokens > 64 else min(8, max(1, k // 512))
    return dict(BLOCK_M=16 if num_tokens <= 16 else 32, BLOCK_N=block_n, BLOCK_K=64, SPLIT_K=split_k)


def lora_shrink(x: torch.Tensor, a: torch.Tensor, sorted_tokens: torch.Tensor, seg_start: torch.Tensor,
                seg_slot: torch.Tensor) -> torch.Tensor:
    """``[T, S, R]`` float32 (rows of tokens in no segment are zeros): ``lora_reference.lora_shrink``."""
    num_tokens, k = x.shape
    slots, num_slices, rank, _ = a.shape
    n = num_slices * rank
    if x.stride(-1) != 1:
        x = x.contiguous()
    out = torch.zeros(num_tokens, num_slices, rank, dtype=torch.float32, device=x.device)
    if num_tokens == 0:
        return out
    tiles = shrink_tiles(num_tokens, n, k)
    grid = (seg_slot.shape[0], triton.cdiv(num_tokens, tiles["BLOCK_M"]),
            triton.cdiv(n, tiles["BLOCK_N"]) * tiles["SPLIT_K"])
    _lora_shrink_kernel[grid](x, a, out, sorted_tokens, seg_start, seg_slot, k, n, x.stride(0), a.stride(0),
                              n, **tiles)
    return out


def lora_expand(y: torch.Tensor, buf: torch.Tensor, b: torch.Tensor, scale: torch.Tensor,
                slices: list[tuple[int, int]], sorted_tokens: torch.Tensor, seg_start: torch.Tensor,
                seg_slot: torch.Tensor) -> torch.Tensor:
    """``y`` plus the scaled up-projection of ``buf``, in place: ``lora_reference.lora_expand``."""
    num_tokens, n = y.shape
    rank = b.shape[2]
    if y.stride(-1) != 1:
        raise ValueError("lora_expand writes into y in place: its last dimension must be contiguous")
    if num_tokens == 0:
        return y
    offs = [start for start, _ in slices[1:]] + [n, n]
    block_m = 16 if num_tokens <= 16 else 32
    block_n = 64
    grid = (seg_slot.shape[0], triton.cdiv(num_tokens, block_m), triton.cdiv(n, block_n))
    _lora_expand_kernel[grid](buf, b, scale, y, sorted_tokens, seg_start, seg_slot, n, rank, offs[0], offs[1],
                              buf.stride(0), b.stride(0), y.stride(0), NUM_SLICES=len(slices), BLOCK_M=block_m,
                              BLOCK_N=block_n, BLOCK_R=_block_r(rank))
    return y
