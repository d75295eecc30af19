"""Triton W4A16/W8A16 GEMM that dequantizes in the kernel: ``out = x @ W.T`` with ``W`` held as int32
words packed along the inputs (the K-packed layout of ``kvloom.kernels.quant_reference.int_matmul``,
which AWQ and GPTQ checkpoints are repacked into at load), uint8 zero points and fp16 scales per group.

Two tile shapes: for few rows (decode) a GEMV-shaped tile with split-K, so that the K loop of a single
row is spread over many programs and the whole GPU streams the packed weight; for many rows, larger M/N
tiles without split-K. Both accumulate in float32 with the reference's dequantization ``(q - z) * s``.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kvloom.kernels.triton_attention import _dot_precision


@triton.jit
def _int_matmul_kernel(
    x_ptr, qw_ptr, z_ptr, s_ptr, out_ptr,
    M, N, K, group_size,
    stride_xm, stride_om,
    BITS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    SPLIT_K: tl.constexpr, DOT_PRECISION: tl.constexpr,
):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    pid_k = tl.program_id(2)
    PER: tl.constexpr = 32 // BITS
    MASK: tl.constexpr = (1 << BITS) - 1
    rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rk = tl.arange(0, BLOCK_K)
    m_ok = rm < M
    n_ok = rn < N
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    k_tiles = tl.cdiv(K, BLOCK_K)
    for t in range(pid_k, k_tiles, SPLIT_K):
        k = t * BLOCK_K + rk
        k_ok = k < K
        x = tl.load(x_ptr + rm[:, None].to(tl.int64) * stride_xm + k[None, :],
                    mask=m_ok[:, None] & k_ok[None, :], other=0.0)
        words = tl.load(qw_ptr + (k // PER)[:, None].to(tl.int64) * N + rn[None, :],
                        mask=k_ok[:, None] & n_ok[None, :], other=0)
        q = (words >> ((k % PER) * BITS)[:, None]) & MASK
        g = (k // group_size)[:, None].to(tl.int64) * N + rn[None, :]
        z = tl.load(z_ptr + g, mask=k_ok[:, None] & n_ok[None, :], other=0)
        s = tl.load(s_ptr + g, mask=k_ok[:, None] & n_ok[None, :], other=0.0)
        w = ((q - z.to(tl.int32)).to(tl.float32) * s.to(tl.float32)).to(x.dtype)
        acc += tl.dot(x, w, input_precision=DOT_PRECISION)
    out = out_ptr + rm[:, None].to(tl.int64) * stride_om + rn[None, :]
    if SPLIT_K == 1:
        tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=m_ok[:, None] & n_ok[None, :])
    else:
        tl.atomic_add(out, acc, mask=m_ok[:, None] & n_ok[None, :])


def tile_config(m: int, n: int, k: int) -> dict:
    """Tiles by row count: GEMV-shaped with split-K for decode, square-ish for batched steps."""
    if m <= 16:
        split = max(1, min(8, k // 512))
        return dict(BLOCK_M=16, BLOCK_N=64, BLOCK_K=128, SPLIT_K=split, num_warps=4)
    if m <= 64:
        return dict(BLOCK_M=32, BLOCK_N=64, BLOCK_K=64, SPLIT_K=1, num_warps=4)
    return dict(BLOCK_M=64, BLOCK_N=128, BLOCK_K=64, SPLIT_K=1, num_warps=8)


def int_matmul(x: torch.Tensor, qweight: torch.Tensor, zeros: torch.Tensor, scales: torch.Tensor,
               group_size: int, bits: int, bias: torch.Tensor | None = None, config: dict | None = None) -> torch.Tensor:
    """``x [.., K] @ W.T`` for ``qweight [K * bits // 32, N]`` int32, ``zeros [G, N]`` uint8, ``scales [G, N]``."""
    shape = x.shape
    x2 = x.reshape(-1, shape[-1])
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    m, k = x2.shape
    n = qweight.shape[1]
    qweight, zeros, scales = qweight.contiguous(), zeros.contiguous(), scales.contiguous()  # row-major [.., N]
    cfg = dict(config or tile_config(m, n, k))
    split = cfg["SPLIT_K"]
    out = (torch.zeros if split > 1 else torch.empty)((m, n), device=x.device,
                                                      dtype=torch.float32 if split > 1 else x.dtype)
    grid = (triton.cdiv(m, cfg["BLOCK_M"]), triton.cdiv(n, cfg["BLOCK_N"]), split)
    _int_matmul_kernel[grid](x2, qweight, zeros, scales, out, m, n, k, group_size, x2.stride(0), out.stride(0),
                             BITS=bits, DOT_PRECISION=_dot_precision(x2.dtype), **cfg)
    out = out.to(x.dtype)
    if bias is not None:
        out = out + bias
    return out.reshape(*shape[:-1], n)
