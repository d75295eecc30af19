"""Triton W4A16/W8A16 GEMM that dequantizes in the kernel: ``out = x @ W.T`` with ``W`` held as int32
words packed along the inputs (the K-packed layout of ``kvloom.kernels.quant_reference.int_matmul``,
which AWQ and GPTQ checkpoints are repacked into at load), uint8 zero points and fp16 scales per group;
and the dequantize pass of that layout, for dequantize + cuBLAS.

Two tile shapes: for few rows (decode) a GEMV-shaped tile with split-K, so that the K loop of a single
row is spread over many programs and the whole GPU streams the packed weight; for many rows, larger M/N
tiles without split-K. Both accumulate in float32 with the reference's dequantization ``(q - z) * s``.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kvloom.kernels.quant.common import _autotuned, _cfg, _grid, _row_bucket, _scratch
from kvloom.kernels.triton_attention import _dot_precision


@triton.jit
def _int_matmul_kernel(
    x_ptr, qw_ptr, z_ptr, s_ptr, out_ptr,
    M, N, K, group_size, M_BUCKET,
    stride_xm, stride_om,
    BITS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    SPLIT_K: tl.constexpr, DOT_PRECISION: tl.constexpr, GROUP_ALIGNED: tl.constexpr,
    UNPACK_ROWS: tl.constexpr = False,
):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    pid_k = tl.program_id(2)
    PER: tl.constexpr = 32 // BITS
    WORDS: tl.constexpr = BLOCK_K // PER
    MASK: tl.constexpr = (1 << BITS) - 1
    rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rk = tl.arange(0, BLOCK_K)
    rw = tl.arange(0, WORDS)
    shifts = tl.arange(0, PER) * BITS
    m_ok = rm < M
    n_ok = rn < N
    x_rows = x_ptr + rm[:, None].to(tl.int64) * stride_xm
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    k_tiles = tl.cdiv(K, BLOCK_K)
    for t in range(pid_k, k_tiles, SPLIT_K):
        k = t * BLOCK_K + rk
        k_ok = k < K
        x = tl.load(x_rows + k[None, :], mask=m_ok[:, None] & k_ok[None, :], other=0.0)
        # Each int32 word once ([WORDS, BLOCK_N]), unpacked to its PER rows of K by shifts: the word at
        # row w holds inputs w * PER .. w * PER + PER - 1 (K-packed layout).
        if UNPACK_ROWS:
            # Each of the tile's K rows loads its own word (PER rows share one, served from L1) and
            # shifts it by its position: the [BLOCK_K, BLOCK_N] tile comes out in the plain blocked
            # layout, without the reshape of the packed words that costs a shuffle through shared memory.
            words = tl.load(qw_ptr + (k // PER)[:, None].to(tl.int64) * N + rn[None, :],
                            mask=k_ok[:, None] & n_ok[None, :], other=0)
            q = (words >> ((k % PER) * BITS)[:, None]) & MASK
        else:
            w_rows = t * WORDS + rw
            words = tl.load(qw_ptr + w_rows[:, None].to(tl.int64) * N + rn[None, :],
                            mask=(w_rows < K // PER)[:, None] & n_ok[None, :], other=0)
            q = tl.reshape((words[:, None, :] >> shifts[None, :, None]) & MASK, (BLOCK_K, BLOCK_N))
        if GROUP_ALIGNED:
            # A K tile lies inside one group (the host picks BLOCK_K dividing group_size): its zero point
            # and scale are one row of [G, N], loaded once per tile rather than per element.
            g = ((t * BLOCK_K) // group_size).to(tl.int64) * N + rn
            z = tl.load(z_ptr + g, mask=n_ok, other=0)[None, :]
            s = tl.load(s_ptr + g, mask=n_ok, other=0.0)[None, :]
        else:  # ragged groups (a group of all K inputs that no tile divides): per element
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
    """Tiles by row count: GEMV-shaped with split-K for decode (enough programs to stream the packed
    weight with the whole GPU), larger and pipelined tiles for batched steps."""
    if m <= 16:
        programs = triton.cdiv(n, 64)
        split = max(1, min(16, k // 256, triton.cdiv(4 * 132, programs)))
        return dict(BLOCK_M=16, BLOCK_N=64, BLOCK_K=128, SPLIT_K=split, num_warps=4, num_stages=4)
    if m <= 64:
        return dict(BLOCK_M=32 if m <= 32 else 64, BLOCK_N=128, BLOCK_K=64, SPLIT_K=1, num_warps=4, num_stages=4)
    if m <= 128:
        return dict(BLOCK_M=64, BLOCK_N=128, BLOCK_K=64, SPLIT_K=1, num_warps=4, num_stages=4)
    return dict(BLOCK_M=128, BLOCK_N=128, BLOCK_K=64, SPLIT_K=1, num_warps=8, num_stages=3)


def _fit_block_k(block_k: int, group_size: int) -> tuple[int, bool]:
    """``(BLOCK_K, aligned)``: the largest power of two ``<= block_k`` and ``>= 16`` (``tl.dot``'s minimum)
    that divides ``group_size``, so that a tile needs one row of scales and zeros; else ``block_k``,
    not aligned."""
    b = block_k
    while b > 16 and group_size % b:
        b //= 2
    return (b, True) if group_size % b == 0 else (block_k, False)


# --------------------------------------------------------------------------------------------------
# Autotuning on CUDA: a few tile configs per (row bucket, N, K), tried once outside any CUDA graph (the
# model runner warms every graph size up first). Two families: decode-sized row counts with split-K
# into a zeroed float32 buffer, and batches without split-K, written in the model dtype directly.
# --------------------------------------------------------------------------------------------------

SMALL_M = 16


_INT_SMALL = [_cfg(16, bn, bk, sp, w, st) for bn, bk, sp, w, st in (
    (32, 128, 4, 4, 4), (64, 128, 4, 4, 4), (64, 128, 8, 4, 3), (128, 128, 4, 4, 3), (64, 256, 4, 4, 3),
    (128, 64, 8, 4, 4), (32, 256, 8, 4, 3), (64, 64, 16, 4, 4), (128, 128, 1, 4, 4))] + [
    _cfg(16, bn, bk, sp, w, st, True) for bn, bk, sp, w, st in ((64, 128, 4, 4, 4), (128, 64, 8, 4, 4))]
_INT_LARGE = [_cfg(bm, bn, bk, 1, w, st) for bm, bn, bk, w, st in (
    (32, 128, 64, 4, 4), (64, 128, 64, 4, 4), (128, 128, 64, 8, 3), (128, 256, 64, 8, 3), (64, 256, 64, 8, 3),
    (128, 128, 128, 8, 3), (64, 64, 128, 4, 4))] + [
    _cfg(bm, bn, bk, 1, w, st, True) for bm, bn, bk, w, st in ((128, 128, 64, 8, 3), (64, 128, 64, 4, 4),
                                                               (128, 256, 64, 8, 3))]


def _int_prune(configs, named_args, **kwargs):
    """Tiles whose K size divides the group (one scale row per tile) and that the K loop can split."""
    g, k = named_args["group_size"], named_args["K"]
    return [c for c in configs if g % c.kwargs["BLOCK_K"] == 0
            and triton.cdiv(k, c.kwargs["BLOCK_K"]) >= c.kwargs["SPLIT_K"]]


_TUNED: dict[str, object] = {}


def _tuned(name: str):
    if name not in _TUNED:
        kernel, configs, prune, restore = {
            "int_small": (_int_matmul_kernel, _INT_SMALL, _int_prune, ("out_ptr",)),
            "int_large": (_int_matmul_kernel, _INT_LARGE, _int_prune, ()),
        }[name]
        _TUNED[name] = _autotuned(kernel, configs, prune, restore)
    return _TUNED[name]


def int_matmul(x: torch.Tensor, qweight: torch.Tensor, zeros: torch.Tensor, scales: torch.Tensor,
               group_size: int, bits: int, bias: torch.Tensor | None = None, config: dict | None = None) -> torch.Tensor:
    """``x [.., K] @ W.T`` for ``qweight [K * bits // 32, N]`` int32, ``zeros [G, N]`` uint8, ``scales [G, N]``.
    ``config`` fixes the tiles; without it, autotuned on CUDA (groups of a multiple of 64), else
    ``tile_config``'s."""
    shape = x.shape
    x2 = x.reshape(-1, shape[-1])
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    m, k = x2.shape
    n = qweight.shape[1]
    qweight, zeros, scales = qweight.contiguous(), zeros.contiguous(), scales.contiguous()  # row-major [.., N]
    if config is None and x2.is_cuda and group_size % 64 == 0:
        small = m <= SMALL_M
        out = torch.zeros((m, n), device=x.device, dtype=torch.float32) if small else \
            torch.empty((m, n), device=x.device, dtype=x.dtype)
        _tuned("int_small" if small else "int_large")[_grid(m, n)](
            x2, qweight, zeros, scales, out, m, n, k, group_size, _row_bucket(m), x2.stride(0), out.stride(0),
            BITS=bits, DOT_PRECISION=_dot_precision(x2.dtype), GROUP_ALIGNED=True)
        out = out.to(x.dtype)
        if bias is not None:
            out = out + bias
        return out.reshape(*shape[:-1], n)
    cfg = dict(config or tile_config(m, n, k))
    cfg["BLOCK_K"], aligned = _fit_block_k(cfg["BLOCK_K"], group_size)
    split = cfg["SPLIT_K"]
    out = (torch.zeros if split > 1 else torch.empty)((m, n), device=x.device,
                                                      dtype=torch.float32 if split > 1 else x.dtype)
    grid = (triton.cdiv(m, cfg["BLOCK_M"]), triton.cdiv(n, cfg["BLOCK_N"]), split)
    _int_matmul_kernel[grid](x2, qweight, zeros, scales, out, m, n, k, group_size, _row_bucket(m),
                             x2.stride(0), out.stride(0),
                             BITS=bits, DOT_PRECISION=_dot_precision(x2.dtype),
                             GROUP_ALIGNED=aligned, **cfg)
    out = out.to(x.dtype)
    if bias is not None:
        out = out + bias
    return out.reshape(*shape[:-1], n)


@triton.jit
def _int_dequantize_kernel(qw_ptr, z_ptr, s_ptr, w_ptr, N, KW, group_size,
                           BITS: tl.constexpr, BLOCK_W: tl.constexpr, BLOCK_N: tl.constexpr):
    PER: tl.constexpr = 32 // BITS
    MASK: tl.constexpr = (1 << BITS) - 1
    rw = tl.program_id(0) * BLOCK_W + tl.arange(0, BLOCK_W)
    rn = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    ok = (rw < KW)[:, None] & (rn < N)[None, :]
    words = tl.load(qw_ptr + rw[:, None].to(tl.int64) * N + rn[None, :], mask=ok, other=0)
    for j in tl.static_range(PER):
        k = rw * PER + j
        g = (k // group_size)[:, None].to(tl.int64) * N + rn[None, :]
        z = tl.load(z_ptr + g, mask=ok, other=0).to(tl.float32)
        s = tl.load(s_ptr + g, mask=ok, other=0.0).to(tl.float32)
        w = (((words >> (j * BITS)) & MASK).to(tl.float32) - z) * s
        tl.store(w_ptr + k[:, None].to(tl.int64) * N + rn[None, :], w.to(w_ptr.dtype.element_ty), mask=ok)


def int_dequantize(qweight: torch.Tensor, zeros: torch.Tensor, scales: torch.Tensor, group_size: int, bits: int,
                   out: torch.Tensor) -> torch.Tensor:
    """The K-packed weight as a dense ``[K, N]`` matrix written into ``out`` (its dtype), as the reference
    dequantizes it: ``(q - z) * s`` in float32, rounded once."""
    kw, n = qweight.shape
    w = out[: kw * (32 // bits) * n].view(kw * (32 // bits), n)
    _int_dequantize_kernel[(triton.cdiv(kw, 16), triton.cdiv(n, 128))](
        qweight, zeros, scales, w, n, kw, group_size, BITS=bits, BLOCK_W=16, BLOCK_N=128, num_warps=4)
    return w


def int_matmul_dequantized(x: torch.Tensor, qweight: torch.Tensor, zeros: torch.Tensor, scales: torch.Tensor,
                           group_size: int, bits: int, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``int_matmul`` for big batches: dequantize the weight into the shared scratch buffer, then the dense
    cuBLAS GEMM. Reading the packed weight and writing bf16 costs about one extra pass over the bf16
    weight, small beside a GEMM of hundreds of rows, and the GEMM is then cuBLAS's."""
    kw, n = qweight.shape
    buf = _scratch(x, kw * (32 // bits) * n)
    if buf is None:  # capturing without the buffer: stay in registers
        return int_matmul(x, qweight, zeros, scales, group_size, bits, bias)
    w = int_dequantize(qweight, zeros, scales, group_size, bits, buf)
    out = torch.matmul(x, w)
    return out if bias is None else out + bias
