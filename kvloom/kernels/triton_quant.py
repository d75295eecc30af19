"""Triton W4A16/W8A16 GEMM that dequantizes in the kernel: ``out = x @ W.T`` with ``W`` held as int32
words packed along the inputs (the K-packed layout of ``kvloom.kernels.quant_reference.int_matmul``,
which AWQ and GPTQ checkpoints are repacked into at load), uint8 zero points and fp16 scales per group.

Two tile shapes: for few rows (decode) a GEMV-shaped tile with split-K, so that the K loop of a single
row is spread over many programs and the whole GPU streams the packed weight; for many rows, larger M/N
tiles without split-K. Both accumulate in float32 with the reference's dequantization ``(q - z) * s``.

Also the FP8 weight-only GEMV that FP8 layers use for decode-sized batches (``fp8_weight_only_linear``).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kvloom.kernels.arrivals import arrival_counters
from kvloom.kernels.pdl import gdc_launch_dependents, gdc_wait, pdl_args
from kvloom.kernels.triton_attention import _dot_precision, _round_to_e4m3
from kvloom.kernels.triton_fused import _rms_norm_row, _rotate, _row_warps, _rows



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


def _rows_2d(x: torch.Tensor) -> torch.Tensor:
    """``x [.., K]`` as ``[rows, K]`` with a unit last stride."""
    x2 = x.reshape(-1, x.shape[-1])
    return x2 if x2.stride(-1) == 1 else x2.contiguous()


def _out_buffer(m: int, n: int, split: int, like: torch.Tensor) -> torch.Tensor:
    """A kernel's ``[m, n]`` output: zeroed float32 for split-K's atomic adds, else ``like``'s dtype."""
    if split > 1:
        return torch.zeros((m, n), device=like.device, dtype=torch.float32)
    return torch.empty((m, n), device=like.device, dtype=like.dtype)


# Whether the one-row GEMVs' split-K programs (the int4 row GEMV's, the FP8 GEMV's) combine their partials
# themselves (the last split of an output tile, kvloom/kernels/arrivals.py) instead of atomically adding into
# a zeroed float32 output that a cast kernel then rounds: two PyTorch kernels fewer a layer, which also broke
# the chain of PDL launches, and a deterministic sum.
SPLIT_COMBINE = True


def _split_outputs(x2: torch.Tensor, m: int, n: int, tiles: int, split: int, combine: bool = True):
    """``(part, arrivals, out)`` for a kernel of ``m`` rows, ``n`` outputs, ``tiles`` output tiles (one arrival
    counter each) and ``split`` K-splits: with ``combine`` and ``SPLIT_COMBINE`` (and counters to be had) the
    float32 partials ``[split, m, n]``, the counters and an output in x's dtype; otherwise no partials and
    ``_out_buffer``'s output."""
    arrivals = arrival_counters(x2, tiles) if split > 1 and combine and SPLIT_COMBINE else None
    if arrivals is None:
        return None, None, _out_buffer(m, n, split, x2)
    part = torch.empty((split, m, n), device=x2.device, dtype=torch.float32)
    return part, arrivals, torch.empty((m, n), device=x2.device, dtype=x2.dtype)


def _finish(out: torch.Tensor, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """``out [rows, n]`` in x's dtype and leading shape, plus ``bias``."""
    out = out.to(x.dtype)
    if bias is not None:
        out = out + bias
    return out.reshape(*x.shape[:-1], out.shape[-1])


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


def _cfg(bm, bn, bk, split, warps, stages, unpack_rows=False):
    tiles = dict(BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, SPLIT_K=split)
    if unpack_rows:  # the int kernel's other way to unpack (the FP8 kernel has no such argument)
        tiles["UNPACK_ROWS"] = True
    return triton.Config(tiles, num_warps=warps, num_stages=stages)


_INT_SMALL = [_cfg(16, bn, bk, sp, w, st) for bn, bk, sp, w, st in (
    (32, 128, 4, 4, 4), (64, 128, 4, 4, 4), (64, 128, 8, 4, 3), (128, 128, 4, 4, 3), (64, 256, 4, 4, 3),
    (128, 64, 8, 4, 4), (32, 256, 8, 4, 3), (64, 64, 16, 4, 4), (128, 128, 1, 4, 4))] + [
    _cfg(16, bn, bk, sp, w, st, True) for bn, bk, sp, w, st in ((64, 128, 4, 4, 4), (128, 64, 8, 4, 4))]
_INT_LARGE = [_cfg(bm, bn, bk, 1, w, st) for bm, bn, bk, w, st in (
    (32, 128, 64, 4, 4), (64, 128, 64, 4, 4), (128, 128, 64, 8, 3), (128, 256, 64, 8, 3), (64, 256, 64, 8, 3),
    (128, 128, 128, 8, 3), (64, 64, 128, 4, 4))] + [
    _cfg(bm, bn, bk, 1, w, st, True) for bm, bn, bk, w, st in ((128, 128, 64, 8, 3), (64, 128, 64, 4, 4),
                                                               (128, 256, 64, 8, 3))]
_FP8_SMALL = [_cfg(16, bn, bk, sp, w, st) for bn, bk, sp, w, st in (
    (64, 256, 1, 4, 4), (64, 256, 4, 4, 4), (32, 256, 4, 4, 4), (128, 128, 4, 4, 4), (64, 512, 2, 4, 3),
    (128, 256, 2, 8, 3), (32, 512, 2, 4, 3), (16, 256, 1, 4, 4), (64, 128, 8, 4, 4))]


def _row_bucket(m: int) -> int:
    return min(triton.next_power_of_2(m), 4096)


def _int_prune(configs, named_args, **kwargs):
    """Tiles whose K size divides the group (one scale row per tile) and that the K loop can split."""
    g, k = named_args["group_size"], named_args["K"]
    return [c for c in configs if g % c.kwargs["BLOCK_K"] == 0
            and triton.cdiv(k, c.kwargs["BLOCK_K"]) >= c.kwargs["SPLIT_K"]]


def _autotuned(kernel, configs, prune=None, restore=()):
    quick = dict(do_bench=lambda fn, quantiles: triton.testing.do_bench(fn, warmup=5, rep=20, quantiles=quantiles))
    kw = dict(key=["M_BUCKET", "N", "K"], restore_value=list(restore) or None,
              prune_configs_by={"early_config_prune": prune} if prune else None)
    try:
        return triton.autotune(configs, **kw, **quick)(kernel)
    except TypeError:  # a Triton without the do_bench argument
        return triton.autotune(configs, **kw)(kernel)


_TUNED: dict[str, object] = {}


def _tuned(name: str):
    if name not in _TUNED:
        kernel, configs, prune, restore = {
            "int_small": (_int_matmul_kernel, _INT_SMALL, _int_prune, ("out_ptr",)),
            "int_large": (_int_matmul_kernel, _INT_LARGE, _int_prune, ()),
            "fp8_small": (_fp8_weight_only_kernel, _FP8_SMALL, None, ("out_ptr",)),
        }[name]
        _TUNED[name] = _autotuned(kernel, configs, prune, restore)
    return _TUNED[name]


def _grid(m, n):
    return lambda meta: (triton.cdiv(m, meta["BLOCK_M"]), triton.cdiv(n, meta["BLOCK_N"]), meta["SPLIT_K"])


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


# --------------------------------------------------------------------------------------------------
# FP8 weight-only GEMV for decode-sized batches
# --------------------------------------------------------------------------------------------------

# Up to this many rows an FP8 layer runs weight-only here (bf16 activations, FP8 weight converted in
# registers): a decode step is bound by reading the weight, which is half of bf16's bytes, while the
# W8A8 path pays an activation quantization pass and cuBLASLt's padded 16-row tile.
FP8_GEMV_MAX_ROWS = 16


@triton.jit
def _fp8_weight_only_kernel(
    x_ptr, w_ptr, ws_ptr, out_ptr,
    M, N, K, M_BUCKET,
    stride_xm, stride_wn, stride_om,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, SPLIT_K: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    pid_k = tl.program_id(2)
    rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rk = tl.arange(0, BLOCK_K)
    m_ok = rm < M
    n_ok = rn < N
    x_rows = x_ptr + rm[:, None].to(tl.int64) * stride_xm
    w_cols = w_ptr + rn[None, :].to(tl.int64) * stride_wn
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for t in range(pid_k, tl.cdiv(K, BLOCK_K), SPLIT_K):
        k = t * BLOCK_K + rk
        k_ok = k < K
        x = tl.load(x_rows + k[None, :], mask=m_ok[:, None] & k_ok[None, :], other=0.0)
        w = tl.load(w_cols + k[:, None], mask=k_ok[:, None] & n_ok[None, :], other=0.0)  # [BLOCK_K, BLOCK_N]
        acc += tl.dot(x, w.to(x.dtype), input_precision=DOT_PRECISION)
    # the per-output-channel scale commutes with the sum over K: applied once, to the accumulator
    acc = acc * tl.load(ws_ptr + rn, mask=n_ok, other=0.0)[None, :]
    out = out_ptr + rm[:, None].to(tl.int64) * stride_om + rn[None, :]
    if SPLIT_K == 1:
        tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=m_ok[:, None] & n_ok[None, :])
    else:
        tl.atomic_add(out, acc, mask=m_ok[:, None] & n_ok[None, :])


def fp8_gemv_config(m: int, n: int, k: int) -> dict:
    """Narrow N tiles so that even a 4096-wide output gives every SM a couple of programs without split-K
    (whose float32 buffer and extra passes cost more than they save at these sizes)."""
    block_n = 16 if n <= 8192 else 64
    return dict(BLOCK_M=16, BLOCK_N=block_n, BLOCK_K=256, SPLIT_K=1, num_warps=4, num_stages=4)


def fp8_weight_only_linear(x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor,
                           bias: torch.Tensor | None = None, config: dict | None = None) -> torch.Tensor:
    """``x @ (W * s).T + b`` for an FP8 ``weight [N, K]`` (rows contiguous) with ``weight_scale [N, 1]``
    float32, ``x`` in its own dtype (no activation quantization)."""
    shape = x.shape
    x2 = x.reshape(-1, shape[-1])
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    m, k = x2.shape
    n = weight.shape[0]
    if config is None and x2.is_cuda:
        out = torch.zeros((m, n), device=x.device, dtype=torch.float32)
        _tuned("fp8_small")[_grid(m, n)](x2, weight, weight_scale.reshape(-1), out, m, n, k, _row_bucket(m),
                                         x2.stride(0), weight.stride(0), out.stride(0),
                                         DOT_PRECISION=_dot_precision(x2.dtype))
        out = out.to(x.dtype)
        return (out if bias is None else out + bias).reshape(*shape[:-1], n)
    cfg = dict(config or fp8_gemv_config(m, n, k))
    split = cfg["SPLIT_K"]
    out = (torch.zeros if split > 1 else torch.empty)((m, n), device=x.device,
                                                      dtype=torch.float32 if split > 1 else x.dtype)
    grid = (triton.cdiv(m, cfg["BLOCK_M"]), triton.cdiv(n, cfg["BLOCK_N"]), split)
    _fp8_weight_only_kernel[grid](x2, weight, weight_scale.reshape(-1), out, m, n, k, _row_bucket(m),
                                  x2.stride(0), weight.stride(0), out.stride(0),
                                  DOT_PRECISION=_dot_precision(x2.dtype), **cfg)
    if split > 1:
        out = out.to(x.dtype)
    if bias is not None:
        out = out + bias
    return out.reshape(*shape[:-1], n)


# --------------------------------------------------------------------------------------------------
# Dynamic per-token FP8 activation quantization in one pass
# --------------------------------------------------------------------------------------------------


@triton.jit
def _store_row_scale(amax, row, live, scale_ptr, min_scale: tl.constexpr):
    """A row's scale ``amax / 448`` (at least ``min_scale``; 1 for a padding row), stored and returned."""
    scale = tl.where(live, tl.maximum(amax / 448.0, min_scale), 1.0)
    tl.store(scale_ptr + row, scale)
    return scale


def _fp8_rows_out(m: int, k: int, device, pad_to: int):
    """Empty FP8 rows ``[M padded to pad_to, K]`` and their float32 scales ``[.., 1]``."""
    rows = -(-m // pad_to) * pad_to
    return (torch.empty(rows, k, dtype=torch.float8_e4m3fn, device=device),
            torch.empty(rows, 1, dtype=torch.float32, device=device))


@triton.jit
def _fp8_quantize_rows_kernel(x_ptr, q_ptr, scale_ptr, M, K, stride_xm, stride_qm,
                              BLOCK_K: tl.constexpr, min_scale: tl.constexpr):
    row = tl.program_id(0)
    offs = tl.arange(0, BLOCK_K)
    x_row = x_ptr + row.to(tl.int64) * stride_xm
    q_row = q_ptr + row.to(tl.int64) * stride_qm
    live = row < M  # rows past M are cuBLASLt's padding: zeros with scale 1
    # (folded into the bound because the interpreter mishandles `scalar_bool & tensor_bool`)
    k_read = tl.where(live, K, 0)
    amax = tl.zeros([BLOCK_K], tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k = k0 + offs
        x = tl.load(x_row + k, mask=k < k_read, other=0.0).to(tl.float32)
        amax = tl.maximum(amax, tl.abs(x))
    scale = _store_row_scale(tl.max(amax, 0), row, live, scale_ptr, min_scale)
    for k0 in range(0, K, BLOCK_K):
        k = k0 + offs
        x = tl.load(x_row + k, mask=k < k_read, other=0.0).to(tl.float32)
        tl.store(q_row + k, _round_to_e4m3(x / scale).to(q_ptr.dtype.element_ty), mask=k < K)


def fp8_quantize_rows(x: torch.Tensor, pad_to: int = 16) -> tuple[torch.Tensor, torch.Tensor]:
    """``(xq, scale)``: each row of ``x [M, K]`` over its own scale ``amax / 448`` in FP8, as
    ``quant_reference.fp8_scale_per_row`` and ``fp8_quantize`` compute it, in one kernel instead of a
    chain of elementwise passes; rows padded with zeros (scale 1) to a multiple of ``pad_to``."""
    if x.stride(-1) != 1:
        x = x.contiguous()
    m, k = x.shape
    xq, scale = _fp8_rows_out(m, k, x.device, pad_to)
    _fp8_quantize_rows_kernel[(xq.shape[0],)](x, xq, scale, m, k, x.stride(0), xq.stride(0),
                                       BLOCK_K=min(1024, triton.next_power_of_2(k)), min_scale=1e-12)
    return xq, scale


# The producers of a W8A8 layer's input quantize it themselves where that layer takes FP8 rows
# (``FP8LinearMethod.takes_fp8_rows``): RMSNorm before qkv and gate/up, SiLU-and-mul before down. Each
# keeps a whole row in registers (up to ``FP8_FUSED_MAX_COLS``), rounds its output to the activation's
# dtype as the unfused kernel does, then quantizes it as ``fp8_quantize_rows`` would: the same bytes, one
# kernel and one bf16 round trip less per layer. Rows past M are the same zero padding with scale 1.
FP8_FUSED_QUANT = True
FP8_FUSED_MAX_COLS = 16384
_TL_DTYPES = {torch.bfloat16: tl.bfloat16, torch.float16: tl.float16, torch.float32: tl.float32}


@triton.jit
def _quantize_row(y, row, live, q_ptr, scale_ptr, stride_q, cols, mask, min_scale: tl.constexpr):
    """Store ``y`` (float32, 0 where masked) as FP8 over its amax / 448, and the scale (padding: 1)."""
    scale = _store_row_scale(tl.max(tl.abs(y), 0), row, live, scale_ptr, min_scale)
    q_row = q_ptr + row.to(tl.int64) * stride_q
    tl.store(q_row + cols, _round_to_e4m3(y / scale).to(q_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _rms_norm_fp8_kernel(x_ptr, res_ptr, w_ptr, q_ptr, scale_ptr, new_res_ptr, M,
                         stride_x, stride_res, stride_q, stride_new_res, n_cols, eps,
                         HAS_RESIDUAL: tl.constexpr, OUT_DTYPE: tl.constexpr, BLOCK: tl.constexpr,
                         min_scale: tl.constexpr, PDL: tl.constexpr):
    row = tl.program_id(0)
    cols = tl.arange(0, BLOCK)
    mask = cols < n_cols
    w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    gdc_launch_dependents(PDL)
    gdc_wait(PDL)
    live = row < M
    read = cols < tl.where(live, n_cols, 0)  # padding rows read nothing (a bound, as in fp8_quantize_rows)
    normed = _rms_norm_row(x_ptr, res_ptr, new_res_ptr, row.to(tl.int64), stride_x, stride_res, stride_new_res,
                           cols, read, n_cols, eps, HAS_RESIDUAL)
    y = (w * normed).to(OUT_DTYPE).to(tl.float32)  # rms_norm's output, as the next layer would read it
    _quantize_row(y, row, live, q_ptr, scale_ptr, stride_q, cols, mask, min_scale)


@triton.jit
def _silu_and_mul_fp8_kernel(x_ptr, q_ptr, scale_ptr, M, stride_x, stride_q, n_cols,
                             BLOCK: tl.constexpr, min_scale: tl.constexpr, PDL: tl.constexpr):
    row = tl.program_id(0)
    gdc_launch_dependents(PDL)
    gdc_wait(PDL)
    cols = tl.arange(0, BLOCK)
    mask = cols < n_cols
    live = row < M
    read = cols < tl.where(live, n_cols, 0)
    x_row = x_ptr + row.to(tl.int64) * stride_x
    gate = tl.load(x_row + cols, mask=read, other=0.0)
    up = tl.load(x_row + n_cols + cols, mask=read, other=0.0)
    g = gate.to(tl.float32)
    act = (g / (1.0 + tl.exp(-g))).to(gate.dtype).to(tl.float32)
    y = (act * up.to(tl.float32)).to(gate.dtype).to(tl.float32)  # silu_and_mul's output
    _quantize_row(y, row, live, q_ptr, scale_ptr, stride_q, cols, mask, min_scale)


def rms_norm_fp8(x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None,
                 pad_to: int = 16):
    """``triton_fused.rms_norm`` with its output quantized per row as ``fp8_quantize_rows`` does:
    ``FP8Rows``, or ``(FP8Rows, x + residual)`` with ``residual``. None where a row is too wide to hold."""
    from kvloom.kernels.quant_reference import FP8Rows

    n = x.shape[-1]
    if not FP8_FUSED_QUANT or n > FP8_FUSED_MAX_COLS:
        return None
    x2 = _rows(x)
    m = x2.shape[0]
    stream = x.dtype if residual is None else torch.promote_types(x.dtype, residual.dtype)
    out_dtype = torch.promote_types(weight.dtype, stream)
    if out_dtype not in _TL_DTYPES:
        return None
    xq, scale = _fp8_rows_out(m, n, x.device, pad_to)
    if residual is not None:
        res2 = _rows(residual)
        new_res = torch.empty(m, n, dtype=stream, device=x.device)
    else:
        res2 = new_res = x2
    block = triton.next_power_of_2(n)
    if m > 0:
        _rms_norm_fp8_kernel[(xq.shape[0],)](
            x2, res2, weight.contiguous(), xq, scale, new_res, m, x2.stride(0), res2.stride(0), xq.stride(0),
            new_res.stride(0), n, eps, HAS_RESIDUAL=residual is not None, OUT_DTYPE=_TL_DTYPES[out_dtype],
            BLOCK=block, min_scale=1e-12, num_warps=_row_warps(block), **pdl_args(x2))
    rows = FP8Rows(xq, scale, m, out_dtype)
    return rows if residual is None else (rows, new_res.view(residual.shape))


def silu_and_mul_fp8(x: torch.Tensor, pad_to: int = 16):
    """``triton_fused.silu_and_mul`` with its output quantized per row as ``fp8_quantize_rows`` does
    (``FP8Rows``); None where a row is too wide to hold."""
    from kvloom.kernels.quant_reference import FP8Rows

    n = x.shape[-1] // 2
    if not FP8_FUSED_QUANT or n > FP8_FUSED_MAX_COLS:
        return None
    x2 = _rows(x)
    m = x2.shape[0]
    xq, scale = _fp8_rows_out(m, n, x.device, pad_to)
    block = triton.next_power_of_2(n)
    if m > 0 and n > 0:
        _silu_and_mul_fp8_kernel[(xq.shape[0],)](x2, xq, scale, m, x2.stride(0), xq.stride(0), n, BLOCK=block,
                                                 min_scale=1e-12, num_warps=_row_warps(block),
                                                 **pdl_args(x2))
    return FP8Rows(xq, scale, m, x.dtype)


# --------------------------------------------------------------------------------------------------
# GEMVs without tensor cores for a handful of rows, and the dequantize-then-cuBLAS path for big batches
# --------------------------------------------------------------------------------------------------
# ``tl.dot`` needs a 16-row tile and the dequantized weight in its operand layout (a shuffle through
# shared memory per tile); a decode row only needs each weight value once, multiplied and summed along K.
# These kernels keep the loaded tile in the layout it arrives in (128-bit loads along the contiguous dim)
# and reduce with plain FMAs. Row programs are the fastest grid axis, so the rows that share a weight
# tile run together and all but the first read it from L2. (An int4 GEMV on the K-packed layout,
# converting each value with an integer-to-float instruction, was replaced by the row GEMV below.)


# --------------------------------------------------------------------------------------------------
# 4-bit GEMV for one row, on the row-major layout of the weight. The K-packed kernels above convert each
# value with an integer-to-float instruction (a quarter-rate conversion on Hopper) after a shift, a mask
# and a sign fix: about six instructions per weight, which capped the int4 GEMVs near 1.85 TB/s of packed
# bytes, below HBM's rate. Here a value costs about four: its nibble is shifted into float32 mantissa
# bits 16-19 and OR-ed with 1.0's bit pattern, which is the float ``1 + q / 128`` exactly, and one FMA; the
# offset and the zero point are taken out once per group, ``sum x (q - z) s = s (128 sum x f - (128 + z) sum x)``.
# The layout (``int4_row_pack``): ``[N, K / 8]`` int32, nibble ``j`` of word ``w`` holding input
# ``(w // 4) * 32 + 4 * j + w % 4``, so that one 128-bit load is 32 consecutive inputs of one output and
# the 4 inputs of a nibble position are one 8-byte load of x.
# --------------------------------------------------------------------------------------------------


def int4_row_pack(qweight: torch.Tensor) -> torch.Tensor:
    """The row GEMV's ``[N, K / 8]`` layout of a K-packed 4-bit ``qweight [K / 8, N]``."""
    from kvloom.kernels.quant_reference import pack_int32, unpack_int32

    q = unpack_int32(qweight, 4, 0).t()  # [N, K], 0..15
    n, k = q.shape
    if k % 32:
        raise ValueError(f"int4_row_pack needs the inputs ({k}) to be a multiple of 32")
    # [n, chunk of 32, nibble j, word w % 4] -> words [n, chunk, w % 4] holding nibbles j = 0..7
    q = q.reshape(n, k // 32, 8, 4).transpose(2, 3).reshape(n, k)
    return pack_int32(q, 4, 1)


@triton.jit
def _int4_word_input(w, MMA_LAYOUT: tl.constexpr):
    """The first input of word ``w`` (of a row): ``(w // 4) * 32 + w % 4`` in the row layout; in the MMA row
    layout ``64 (w // 8) + 32 (w % 2) + 2 ((w % 8) // 2)``. Nibble ``j`` adds ``_int4_nibble_input(j)``."""
    if MMA_LAYOUT:
        return (w // 8) * 64 + (w % 2) * 32 + ((w % 8) // 2) * 2
    return (w // 4) * 32 + (w % 4)


@triton.jit
def _int4_nibble_input(J: tl.constexpr, MMA_LAYOUT: tl.constexpr):
    """What nibble ``J`` of a word adds to its first input: ``4 J`` in the row layout, ``16 n2 + 8 n1 + n0`` in
    the MMA row layout (``J = n1 + 2 n2 + 4 n0``)."""
    if MMA_LAYOUT:
        return 16 * ((J >> 1) & 1) + 8 * (J & 1) + (J >> 2)
    return 4 * J


@triton.jit
def _int4_row_nibbles(words, J: tl.constexpr, NIB_MASK):
    """Nibble ``J`` of each word as the float ``1 + q / 128`` (its bits in mantissa bits 16-19 of 1.0)."""
    if J < 4:
        bits = (words << (16 - 4 * J)) & NIB_MASK
    elif J == 4:
        bits = words & NIB_MASK
    else:
        bits = (words >> (4 * J - 16)) & NIB_MASK
    return (bits | 0x3F800000).to(tl.float32, bitcast=True)


@triton.jit
def _int4_row_gemv_kernel(
    x_ptr, qw_ptr, z_ptr, s_ptr, out_ptr,
    M, N, K, stride_xm, stride_qn, stride_om, NIB_MASK, part_ptr=None, arrivals_ptr=None,
    GROUP: tl.constexpr = 128, BLOCK_N: tl.constexpr = 16, BLOCK_K: tl.constexpr = 1024, SPLIT_K: tl.constexpr = 1,
    PDL: tl.constexpr = False, SILU_MUL: tl.constexpr = False, SPLIT_COMBINE: tl.constexpr = False,
    MMA_LAYOUT: tl.constexpr = False,
):
    # With MMA_LAYOUT the words are in the Gluon GEMM's layout (gluon_quant.int4_mma_pack): the same words
    # and groups, other inputs at each nibble, so only x's offsets change.
    # NIB_MASK (0x000F0000) comes in as an argument, not an immediate: ptxas then keeps it in a register
    # instead of rematerializing it before every OR with 1.0's bits (a third fewer instructions).
    # Under PDL the first tile of words is read before the wait for the previous kernel. With SILU_MUL the
    # weight is a merged [gate; up] of 2N rows (zeros and scales of 2N columns): a program reads rows n of
    # both halves and stores silu(gate) * up (N outputs).
    gdc_launch_dependents(PDL)  # the next kernel may start (and read its weights) and wait
    row = tl.program_id(0)
    pid_n = tl.program_id(1)
    pid_k = tl.program_id(2)
    KW: tl.constexpr = BLOCK_K // 8
    GPT: tl.constexpr = BLOCK_K // GROUP  # the host makes BLOCK_K a multiple of the group
    WPG: tl.constexpr = GROUP // 8
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rw = tl.arange(0, KW)
    n_ok = rn < N
    NZ = N  # columns of zeros and scales
    if SILU_MUL:
        NZ = 2 * N
    x_row = x_ptr + row.to(tl.int64) * stride_xm + _int4_word_input(rw, MMA_LAYOUT)
    w_rows = qw_ptr + rn[:, None].to(tl.int64) * stride_qn + rw[None, :]
    u_rows = w_rows + N.to(tl.int64) * stride_qn  # SILU_MUL: the up half
    acc = tl.zeros((BLOCK_N, GPT), dtype=tl.float32)
    acc_u = tl.zeros((BLOCK_N, GPT), dtype=tl.float32)
    for t in range(pid_k, K // BLOCK_K, SPLIT_K):
        words = tl.load(w_rows + t * KW, mask=n_ok[:, None], other=0)
        if SILU_MUL:
            words_u = tl.load(u_rows + t * KW, mask=n_ok[:, None], other=0)
        if t == pid_k:  # the first tile of words is on its way: now wait for the previous kernel
            gdc_wait(PDL)
        part = tl.zeros((BLOCK_N, KW), dtype=tl.float32)
        part_u = tl.zeros((BLOCK_N, KW), dtype=tl.float32)
        xs = tl.zeros((KW,), dtype=tl.float32)
        for j in tl.static_range(8):
            xj = tl.load(x_row + t * BLOCK_K + _int4_nibble_input(j, MMA_LAYOUT)).to(tl.float32)
            part += _int4_row_nibbles(words, j, NIB_MASK) * xj[None, :]  # (1 + q / 128) x
            if SILU_MUL:
                part_u += _int4_row_nibbles(words_u, j, NIB_MASK) * xj[None, :]
            xs += xj
        sx = tl.sum(tl.reshape(xs, (GPT, WPG)), 1)
        gi = (t * GPT + tl.arange(0, GPT)).to(tl.int64)[None, :] * NZ + rn[:, None]  # [BLOCK_N, GPT]
        dot = tl.sum(tl.reshape(part, (BLOCK_N, GPT, WPG)), 2)  # per group: sum x (1 + q / 128)
        z = tl.load(z_ptr + gi, mask=n_ok[:, None], other=0).to(tl.float32)
        s = tl.load(s_ptr + gi, mask=n_ok[:, None], other=0.0).to(tl.float32)
        acc += s * (128.0 * dot - (128.0 + z) * sx[None, :])
        if SILU_MUL:
            dot_u = tl.sum(tl.reshape(part_u, (BLOCK_N, GPT, WPG)), 2)
            z_u = tl.load(z_ptr + gi + N, mask=n_ok[:, None], other=0).to(tl.float32)
            s_u = tl.load(s_ptr + gi + N, mask=n_ok[:, None], other=0.0).to(tl.float32)
            acc_u += s_u * (128.0 * dot_u - (128.0 + z_u) * sx[None, :])
    gdc_wait(PDL)  # a no-op after the one above; it waits in a program that had no tile
    res = tl.sum(acc, 1)
    if SILU_MUL:
        res = _silu_mul_epilogue(res, tl.sum(acc_u, 1), out_ptr.dtype.element_ty)
    out = out_ptr + row.to(tl.int64) * stride_om + rn
    if SPLIT_K == 1:
        tl.store(out, res.to(out_ptr.dtype.element_ty), mask=n_ok)
    elif SPLIT_COMBINE:
        _combine_split_k(res, out, part_ptr, arrivals_ptr, row, pid_n, pid_k, rn, n_ok, M, N, SPLIT_K)
    else:
        tl.atomic_add(out, res, mask=n_ok)


@triton.jit
def _combine_split_k(res, out, part_ptr, arrivals_ptr, row, pid_n, pid_k, rn, n_ok, M, N, SPLIT_K: tl.constexpr):
    """A split-K program's end without a zeroed float32 output: its partial sums ``res`` go to
    ``part [SPLIT_K, M, N]`` (float32), and the split that arrives last at the output tile (row ``row``,
    column tile ``pid_n``: one counter each) adds the partials in split order, in float32, and stores them in
    ``out``'s dtype (kvloom/kernels/arrivals.py)."""
    counter = arrivals_ptr + row * tl.num_programs(1) + pid_n
    n64 = N.to(tl.int64)
    tl.store(part_ptr + (pid_k * M + row) * n64 + rn, res, mask=n_ok)
    tl.debug_barrier()
    if tl.atomic_add(counter, 1, sem="acq_rel") == SPLIT_K - 1:
        tl.atomic_xchg(counter, 0)
        total = tl.zeros_like(res)
        for j in tl.static_range(SPLIT_K):
            total += tl.load(part_ptr + (j * M + row) * n64 + rn, mask=n_ok, other=0.0, cache_modifier=".cg")
        tl.store(out, total.to(out.dtype.element_ty), mask=n_ok)


# --------------------------------------------------------------------------------------------------
# 4-bit GEMM for up to 64 rows (the engine gives it 5-16) on the tensor cores, output-major
# (``out.T = W x.T``: the dequantized weight tile is the MMA's first operand, x's rows padded to 16, 32 or
# 64 its second), on the row GEMV's layout.
# A shift and a mask of a word give two nibbles in its two 16-bit halves at once; OR-ed with 0x4300 (bf16
# 128.0; for fp16 x 0x6400, 1024.0) each half is exactly ``OFF + q``. Per group the MMA sums
# ``(OFF + q) x`` in float32 and ``s (d - (OFF + z) sum x)`` takes out the offset and the zero point. The
# tile's K order is the layout's (input ``(w // 4) * 32 + 4 j + w % 4`` at word ``w``, nibble ``j``): x is
# loaded in input order (vector loads) and permuted to it in registers.
# --------------------------------------------------------------------------------------------------


@triton.jit
def _int4_pair(words, SHIFT: tl.constexpr, F16: tl.constexpr, BITS: tl.constexpr):
    """Nibbles ``SHIFT / 4`` and ``SHIFT / 4 + 4`` of each word as ``OFF + q`` (bf16, or fp16 with ``F16``):
    ``[..., 2]``. Without ``BITS`` (the Triton interpreter, which gets 16-bit float bitcasts and dots wrong)
    by conversion."""
    if BITS:
        if F16:
            v = ((words >> SHIFT) & 0x000F000F) | 0x64006400
            lo = (v & 0xFFFF).to(tl.int16).to(tl.float16, bitcast=True)
            hi = (v >> 16).to(tl.int16).to(tl.float16, bitcast=True)
        else:
            v = ((words >> SHIFT) & 0x000F000F) | 0x43004300
            lo = (v & 0xFFFF).to(tl.int16).to(tl.bfloat16, bitcast=True)
            hi = (v >> 16).to(tl.int16).to(tl.bfloat16, bitcast=True)
    else:
        off = 1024 if F16 else 128
        lo = (((words >> SHIFT) & 15) + off).to(tl.float32)
        hi = (((words >> (SHIFT + 16)) & 15) + off).to(tl.float32)
    return tl.join(lo, hi)


@triton.jit
def _int4_mma_kernel(
    x_ptr, qw_ptr, z_ptr, s_ptr, out_ptr,
    M, N, K, stride_xm, stride_qn, stride_om,
    GROUP: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, SPLIT_K: tl.constexpr,
    F16: tl.constexpr = False, BITS: tl.constexpr = True,
):
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    KW: tl.constexpr = GROUP // 8
    OFF: tl.constexpr = 1024.0 if F16 else 128.0
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rm = tl.arange(0, BLOCK_M)
    n_ok = rn < N
    m_ok = rm < M
    w_rows = qw_ptr + rn[:, None].to(tl.int64) * stride_qn + tl.arange(0, KW)[None, :]
    x_rows = x_ptr + rm[:, None].to(tl.int64) * stride_xm + tl.arange(0, GROUP)[None, :]
    acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    for g in range(pid_k, K // GROUP, SPLIT_K):
        words = tl.load(w_rows + g * KW, mask=n_ok[:, None], other=0)
        x = tl.load(x_rows + g * GROUP, mask=m_ok[:, None], other=0.0)  # [BLOCK_M, GROUP], inputs in order
        # Input (w // 4) * 32 + 16 h + 4 jj + w % 4 of the group is column 8 w + 2 jj + h of the tile below:
        # x [BM, w // 4, h, jj, w % 4] -> [BM, w // 4, w % 4, jj, h].
        x = tl.reshape(tl.permute(tl.reshape(x, (BLOCK_M, KW // 4, 2, 4, 4)), (0, 1, 4, 3, 2)), (BLOCK_M, GROUP))
        pairs = tl.join(tl.join(_int4_pair(words, 0, F16, BITS), _int4_pair(words, 4, F16, BITS)),
                        tl.join(_int4_pair(words, 8, F16, BITS), _int4_pair(words, 12, F16, BITS)))
        a = tl.reshape(tl.permute(pairs, (0, 1, 4, 3, 2)), (BLOCK_N, GROUP))  # [BN, KW, jj, h]
        if BITS:
            d = tl.dot(a, tl.trans(x.to(a.dtype)))  # [BN, BM]: sum (OFF + q) x, float32
        else:
            d = tl.dot(a, tl.trans(x.to(tl.float32)))
        sx = tl.sum(x.to(tl.float32), 1)
        gi = rn.to(tl.int64) + g * N
        z = tl.load(z_ptr + gi, mask=n_ok, other=0).to(tl.float32)
        s = tl.load(s_ptr + gi, mask=n_ok, other=0.0).to(tl.float32)
        acc += s[:, None] * (d - (OFF + z)[:, None] * sx[None, :])
    out = out_ptr + rm[None, :].to(tl.int64) * stride_om + rn[:, None]
    ok = n_ok[:, None] & m_ok[None, :]
    if SPLIT_K == 1:
        tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=ok)
    else:
        tl.atomic_add(out, acc, mask=ok)


INT4_MMA_MAX_ROWS = 64  # what the kernel takes (x padded to 16, 32 or 64 rows)
# What the engine gives it: up to 16 rows. Alone it is faster than dequantize + cuBLAS at 32 and 63 rows
# too (gate_up 70 and 95 against 173 us), but end to end (256 x (512 + 256) offline, the same H200 run,
# session 10) routing 17-63 rows to it gave 5,100 output tok/s against 7,303 with 16: those rows come in
# eager mixed steps (the last layer's kept rows); an unverified guess is that each new row count compiles its
# variant there, inside the timed run (its BLOCK_M follows the rows). From 17 rows int4_row_gemm runs, whose
# row count is not specialized (one compiled kernel a tile).
INT4_MMA_ROWS = 16
# Tiles from benchmarks/int4_gemv_sweep_gpu.py --kernel mma on an H200 (session 10): 64 outputs and K in four
# up to 16 rows; 128 outputs a program beyond (o_proj at 63 rows 25.6 against 28.2 us) and for wide
# weights (gate_up_proj, 28672 outputs, K whole: 95 against 146 us at 63 rows, 60 against 63 at 4-16).
INT4_MMA_TILE = dict(BLOCK_N=64, SPLIT_K=4, num_warps=4, num_stages=3)
INT4_MMA_TILE_ROWS = dict(BLOCK_N=128, SPLIT_K=4, num_warps=8, num_stages=4)
INT4_MMA_TILE_WIDE = dict(BLOCK_N=128, SPLIT_K=1, num_warps=4, num_stages=3)


def int4_mma_tiles(rows: int, n: int) -> dict:
    """The tensor-core kernel's tiles for ``rows`` rows and ``n`` outputs."""
    if n >= 16384:
        return dict(INT4_MMA_TILE_WIDE)
    return dict(INT4_MMA_TILE if rows <= 16 else INT4_MMA_TILE_ROWS)


def int4_mma_gemm(x: torch.Tensor, packed: torch.Tensor, zeros: torch.Tensor, scales: torch.Tensor,
                  group_size: int, bias: torch.Tensor | None = None, config: dict | None = None) -> torch.Tensor:
    """``x [.., K] @ W.T`` for up to ``INT4_MMA_MAX_ROWS`` rows of bf16/fp16 x and a 4-bit weight in
    ``int4_row_pack``'s layout (``zeros``/``scales`` ``[G, N]``, as ``int_matmul`` takes them)."""
    x2 = _rows_2d(x)
    m, k = x2.shape
    n = packed.shape[0]
    if m > INT4_MMA_MAX_ROWS or k % group_size or group_size % 32 or x2.dtype not in (torch.bfloat16, torch.float16):
        raise ValueError(f"int4_mma_gemm takes up to {INT4_MMA_MAX_ROWS} rows (got {m}) of bf16 or fp16 x "
                         f"(got {x2.dtype}) and groups of a multiple of 32 dividing K (group_size={group_size}, K={k})")
    cfg = dict(config or INT4_MMA_TILE)
    out = _out_buffer(m, n, cfg["SPLIT_K"], x)
    _int4_mma_kernel[(triton.cdiv(n, cfg["BLOCK_N"]), cfg["SPLIT_K"])](
        x2, packed, zeros, scales, out, m, n, k, x2.stride(0), packed.stride(0), out.stride(0),
        GROUP=group_size, BLOCK_M=max(16, triton.next_power_of_2(m)), F16=x2.dtype == torch.float16,
        BITS=x2.is_cuda, **cfg)
    return _finish(out, x, bias)


@triton.jit
def _int4_row_value(words, J: tl.constexpr, a, b, NIB_MASK, FMA: tl.constexpr):
    """Nibble ``J`` of each word dequantized, ``(q - z) s`` in float32: with FMA from its float 1 + q / 128
    as ``f a + b`` (``a = 128 s``, ``b = -(128 + z) s``), otherwise converted, ``(q - b) a`` (``a = s``,
    ``b = z``)."""
    if FMA:  # an explicit FMA: the exactness needs the one rounding, and Triton 3.10 stops fusing by default
        return tl.fma(_int4_row_nibbles(words, J, NIB_MASK), a, b)
    return (((words >> (4 * J)) & 15).to(tl.float32) - b) * a


@triton.jit
def _int4_row_tile(words, z, s, NIB_MASK, FMA: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                   MMA_LAYOUT: tl.constexpr = False):
    """A ``[BLOCK_N, BLOCK_K / 8]`` tile of row-layout words dequantized (``_int4_row_value``; the float32 zero
    points ``z`` and scales ``s`` broadcast to the words) as ``[BLOCK_N, BLOCK_K]`` float32 in input order.
    Each word's 8 values are put in input order in registers, so that a row of the tile is contiguous."""
    KW: tl.constexpr = BLOCK_K // 8
    if FMA:
        a, b = s * 128.0, -((128.0 + z) * s)
    else:
        a, b = s, z
    v0 = _int4_row_value(words, 0, a, b, NIB_MASK, FMA)
    v1 = _int4_row_value(words, 1, a, b, NIB_MASK, FMA)
    v2 = _int4_row_value(words, 2, a, b, NIB_MASK, FMA)
    v3 = _int4_row_value(words, 3, a, b, NIB_MASK, FMA)
    v4 = _int4_row_value(words, 4, a, b, NIB_MASK, FMA)
    v5 = _int4_row_value(words, 5, a, b, NIB_MASK, FMA)
    v6 = _int4_row_value(words, 6, a, b, NIB_MASK, FMA)
    v7 = _int4_row_value(words, 7, a, b, NIB_MASK, FMA)
    vals = tl.join(tl.join(tl.join(v0, v1), tl.join(v2, v3)), tl.join(tl.join(v4, v5), tl.join(v6, v7)))
    if MMA_LAYOUT:
        # [BN, KW, n1, n2, n0] (nibble n1 + 2 n2 + 4 n0); word w = 8 (w // 8) + 2 q + c; input
        # 64 (w // 8) + 32 c + 16 n2 + 8 n1 + 2 q + n0
        vals = tl.reshape(vals, (BLOCK_N, KW // 8, 4, 2, 2, 2, 2))
        return tl.reshape(tl.permute(vals, (0, 1, 3, 5, 4, 2, 6)), (BLOCK_N, BLOCK_K))
    # [BN, KW, a, b, c] holds nibble a + 2 b + 4 c; word w = 4 (w // 4) + w % 4; input (w // 4) * 32 + 4 nib + w % 4
    vals = tl.reshape(vals, (BLOCK_N, KW // 4, 4, 2, 2, 2))
    return tl.reshape(tl.permute(vals, (0, 1, 5, 4, 3, 2)), (BLOCK_N, BLOCK_K))


@triton.jit
def _int4_row_dequantize_kernel(qw_ptr, z_ptr, s_ptr, w_ptr, N, K, stride_qn, NIB_MASK=0x000F0000,
                                GROUP: tl.constexpr = 128, BLOCK_N: tl.constexpr = 64, BLOCK_K: tl.constexpr = 256,
                                FMA: tl.constexpr = False, MMA_LAYOUT: tl.constexpr = False):
    # Each word's 8 values are put in input order in registers, so that the [BLOCK_N, BLOCK_K] tile is one
    # contiguous store per row (not 8 strided ones). With FMA a value is the row GEMV's float 1 + q / 128
    # (a shift and a LOP3, no integer-to-float conversion) times 128 s plus -(128 + z) s, one FMA: the exact
    # (q - z) s, as without it (q - z has 5 significant bits and an fp16 scale 11, so no step rounds),
    # so the two ways give the same bits.
    KW: tl.constexpr = BLOCK_K // 8
    rn = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    rw = tl.program_id(1) * KW + tl.arange(0, KW)
    n_ok = rn < N
    ok = n_ok[:, None] & (rw < K // 8)[None, :]
    words = tl.load(qw_ptr + rn[:, None].to(tl.int64) * stride_qn + rw[None, :], mask=ok, other=0)
    gi = ((rw * 8) // GROUP)[None, :].to(tl.int64) * N + rn[:, None]  # a word's 8 inputs share a group
    z = tl.load(z_ptr + gi, mask=ok, other=0).to(tl.float32)
    s = tl.load(s_ptr + gi, mask=ok, other=0.0).to(tl.float32)
    vals = _int4_row_tile(words, z, s, NIB_MASK, FMA, BLOCK_N, BLOCK_K, MMA_LAYOUT)  # z, s per word, its group
    rk = tl.program_id(1) * BLOCK_K + tl.arange(0, BLOCK_K)
    tl.store(w_ptr + rn[:, None].to(tl.int64) * K + rk[None, :], vals.to(w_ptr.dtype.element_ty),
             mask=n_ok[:, None] & (rk < K)[None, :])


def int4_row_dequantize(packed: torch.Tensor, zeros: torch.Tensor, scales: torch.Tensor, group_size: int,
                        out: torch.Tensor, mma_layout: bool = False) -> torch.Tensor:
    """The row layout's weight (or with ``mma_layout`` the MMA row layout's) as a dense ``[N, K]`` matrix
    written into ``out`` (its dtype), as the reference dequantizes it: ``(q - z) * s`` in float32, rounded
    once."""
    n, kw = packed.shape
    w = out[: n * kw * 8].view(n, kw * 8)
    fma = INT4_DEQUANT_FMA and scales.dtype in (torch.float16, torch.bfloat16)  # exact only for 16-bit scales
    _int4_row_dequantize_kernel[(triton.cdiv(n, 64), triton.cdiv(kw * 8, 256))](
        packed, zeros, scales, w, n, kw * 8, packed.stride(0), 0x000F0000, GROUP=group_size, BLOCK_N=64,
        BLOCK_K=256, FMA=fma, MMA_LAYOUT=mma_layout, num_warps=4)
    return w


@triton.jit(do_not_specialize=["M"])  # any row count, one compiled kernel a tile
def _int4_row_gemm_kernel(x_ptr, qw_ptr, z_ptr, s_ptr, out_ptr, M, N, K, stride_xm, stride_qn, stride_om,
                          NIB_MASK=0x000F0000, GROUP: tl.constexpr = 128, BLOCK_M: tl.constexpr = 128,
                          BLOCK_N: tl.constexpr = 128, BLOCK_K: tl.constexpr = 64, GROUP_M: tl.constexpr = 8,
                          SPLIT_K: tl.constexpr = 1, SWAP: tl.constexpr = False, FMA: tl.constexpr = True,
                          F32_DOT: tl.constexpr = False):
    # x [M, K] @ W.T for many rows, W dequantized tile by tile in registers from the row layout (each thread's
    # 128-bit load is 32 consecutive inputs of one output, put in input order by a register-only permute) to
    # x's dtype, the same values as int4_row_dequantize, into the tensor cores: the dequantize + cuBLAS path
    # without writing and reading back the 16-bit weight. A K tile lies within one group (GROUP % BLOCK_K ==
    # 0). SWAP computes the transposed tile, W as the MMA's first operand: on Hopper that operand can stay in
    # registers, so the next tile's dequantization overlaps the running MMA (the other way round the tile goes
    # through shared memory and each MMA is waited for). SPLIT_K programs take every SPLIT_K-th K tile and add
    # into a zeroed float32 output (narrow weights: otherwise fewer programs than the GPU has SMs), atomically,
    # so in no fixed order, as the 5-16-row kernel's split-K.
    pid = tl.program_id(0)
    pid_k = tl.program_id(1)
    num_m = tl.cdiv(M, BLOCK_M)
    num_n = tl.cdiv(N, BLOCK_N)
    per_group = GROUP_M * num_n  # GROUP_M row tiles walk the N tiles together, so a weight tile is read once
    first_m = (pid // per_group) * GROUP_M
    size_m = min(num_m - first_m, GROUP_M)
    pid_m = first_m + (pid % per_group) % size_m
    pid_n = (pid % per_group) // size_m
    KW: tl.constexpr = BLOCK_K // 8
    rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    m_ok = rm < M
    n_ok = rn < N
    w_ptrs = qw_ptr + rn[:, None].to(tl.int64) * stride_qn + (pid_k * KW + tl.arange(0, KW))[None, :]
    x_ptrs = x_ptr + rm[:, None].to(tl.int64) * stride_xm + (pid_k * BLOCK_K + tl.arange(0, BLOCK_K))[None, :]
    if SWAP:
        acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    else:
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(pid_k * BLOCK_K, K, BLOCK_K * SPLIT_K):
        words = tl.load(w_ptrs, mask=n_ok[:, None], other=0)
        x = tl.load(x_ptrs, mask=m_ok[:, None], other=0.0)
        gi = (k0 // GROUP) * N + rn
        z = tl.load(z_ptr + gi, mask=n_ok, other=0).to(tl.float32)[:, None]
        s = tl.load(s_ptr + gi, mask=n_ok, other=0.0).to(tl.float32)[:, None]
        w = _int4_row_tile(words, z, s, NIB_MASK, FMA, BLOCK_N, BLOCK_K).to(x.dtype)
        if F32_DOT:  # the Triton interpreter, whose 16-bit dots are wrong
            x = x.to(tl.float32)
            w = w.to(tl.float32)
        if SWAP:
            acc = tl.dot(w, tl.trans(x), acc)
        else:
            acc = tl.dot(x, tl.trans(w), acc)
        w_ptrs += KW * SPLIT_K
        x_ptrs += BLOCK_K * SPLIT_K
    if SWAP:
        out = out_ptr + rm[None, :].to(tl.int64) * stride_om + rn[:, None]
        ok = m_ok[None, :] & n_ok[:, None]
    else:
        out = out_ptr + rm[:, None].to(tl.int64) * stride_om + rn[None, :]
        ok = m_ok[:, None] & n_ok[None, :]
    if SPLIT_K == 1:
        tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=ok)
    else:
        tl.atomic_add(out, acc, mask=ok)


INT4_GEMM_TILE = dict(BLOCK_M=128, BLOCK_N=128, BLOCK_K=64, GROUP_M=8, SPLIT_K=1, SWAP=False, num_warps=8,
                      num_stages=3)
INT4_GEMM_TILE_FEW = dict(BLOCK_M=64, BLOCK_N=64, BLOCK_K=128, GROUP_M=8, SPLIT_K=1, SWAP=True, num_warps=4,
                          num_stages=3)
# Rows up to which 4-bit layers may run int4_row_gemm (from INT4_MMA_ROWS + 1); beyond, dequantize + cuBLAS.
INT4_GEMM_MAX_ROWS = 256
# Up to how many rows a layer on the MMA row layout (Hopper) takes the Gluon GEMM (kvloom/kernels/gluon_quant.py),
# and beyond, dequantize + cuBLAS. On an H200 at Llama-3-8B's shapes (session 18, pairs of values dequantized an
# instruction) it is 1.0-2.1x faster than this module's row-layout paths from 4 to 256 rows, and 1.2x cuBLAS
# bf16's time for gate_up and down at 256 rows.
INT4_MMA_GLUON_MAX_ROWS = 256
SM_PROGRAMS = 264  # about two programs an SM on an H100/H200: split-K until a layer has that many


def _gemm_tile(bm, bn, bk, split, swap, warps):
    return dict(BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, GROUP_M=8, SPLIT_K=split, SWAP=swap, num_warps=warps, num_stages=3)


# Tiles read off benchmarks/int4_gemm_sweep_gpu.py on an H200 (session 16; CUDA-graph replay, weights past L2,
# group 128), by weight shape: {(n, k): ((max_rows, tile or None), ...)}, the first bucket holding the row
# count wins, None where dequantize + cuBLAS was faster. Microseconds against cuBLAS bf16 and dequantize +
# cuBLAS at 32 / 64 / 128 / 256 rows:
# * qkv_proj  6144 x 4096:  23.2 / 26.8 / 40.5 / -      (cuBLAS 15.6-20.7; dequantize 41.3 / 42.5 / 44.0 / 48.9)
# * o_proj    4096 x 4096:  20.4 / 23.4 / - / -         (12.8-16.6; 28.8 / 27.3 / 31.3 / 32.9)
# * gate_up  28672 x 4096:  59.6 / 63.8 / 82.5 / 158.1  (58.3 / 62.4 / 67.1 / 92.1; 173.7 / 175.6 / 179.9 / 200.7)
# * down      4096 x 14336: 51.5 / 55.4 / 70.5 / 93.8   (33.4 / 36.2 / 37.5 / 49.0; 93.4 / 96.4 / 98.9 / 107.1)
# (Mistral-7B has the same shapes.) Other shapes take int4_gemm_tiles' rule, which follows these.
INT4_GEMM_TILES: dict = {
    (6144, 4096): ((64, _gemm_tile(64, 64, 128, 4, True, 4)), (128, _gemm_tile(64, 64, 128, 2, True, 4)),
                   (256, None)),
    (4096, 4096): ((64, _gemm_tile(64, 64, 128, 4, True, 4)), (256, None)),
    (28672, 4096): ((32, _gemm_tile(32, 64, 128, 1, True, 4)), (64, _gemm_tile(64, 128, 128, 1, False, 4)),
                    (256, _gemm_tile(128, 128, 64, 1, False, 8))),
    (4096, 14336): ((64, _gemm_tile(64, 64, 128, 4, True, 4)), (128, _gemm_tile(128, 64, 128, 4, True, 4)),
                    (256, _gemm_tile(128, 128, 64, 4, False, 8))),
}


def int4_gemm_tiles(rows: int, n: int, k: int) -> dict | None:
    """``int4_row_gemm``'s tiles for ``rows`` rows of an ``[n, k]`` weight, or None where dequantize +
    cuBLAS is faster: the measured table, else a rule read off it. Up to 64 rows, output-major 64 x 64
    tiles; more rows, 128 x 128 tiles with the weight as the MMA's second operand. Split-K until the layer
    has ``SM_PROGRAMS`` programs (each split keeping four K tiles or more); dequantize + cuBLAS beyond 128
    rows for weights neither wide (16,384 outputs) nor long (8,192 inputs), where the kernel lost."""
    for max_rows, tile in INT4_GEMM_TILES.get((n, k), ()):
        if rows <= max_rows:
            return None if tile is None else dict(tile)
    if rows > 128 and n < 16384 and k < 8192:
        return None
    tile = dict(INT4_GEMM_TILE_FEW if rows <= 64 else INT4_GEMM_TILE)
    programs = triton.cdiv(rows, tile["BLOCK_M"]) * triton.cdiv(n, tile["BLOCK_N"])
    tile["SPLIT_K"] = max(1, min(4, SM_PROGRAMS // programs, k // (4 * tile["BLOCK_K"])))
    return tile


def int4_row_gemm(x: torch.Tensor, packed: torch.Tensor, zeros: torch.Tensor, scales: torch.Tensor,
                  group_size: int, bias: torch.Tensor | None = None, config: dict | None = None) -> torch.Tensor:
    """``x [.., K] @ W.T`` for many rows of a 4-bit weight in ``int4_row_pack``'s layout, dequantized in
    registers tile by tile (the values of ``int4_row_dequantize``) into the tensor cores."""
    x2 = _rows_2d(x)
    m, k = x2.shape
    n = packed.shape[0]
    cfg = dict(INT4_GEMM_TILE, **(config or {}))
    bk = min(cfg["BLOCK_K"], group_size)
    if group_size % 32 or k % group_size or group_size % bk or bk % 32:
        raise ValueError(f"int4_row_gemm needs groups of a multiple of 32 dividing K (group_size={group_size}, K={k})")
    cfg["BLOCK_K"] = bk
    fma = cfg.pop("FMA", scales.dtype in (torch.float16, torch.bfloat16))  # exact only for 16-bit scales
    out = _out_buffer(m, n, cfg["SPLIT_K"], x2)
    grid = (triton.cdiv(m, cfg["BLOCK_M"]) * triton.cdiv(n, cfg["BLOCK_N"]), cfg["SPLIT_K"])
    _int4_row_gemm_kernel[grid](x2, packed, zeros, scales, out, m, n, k, x2.stride(0), packed.stride(0),
                                out.stride(0), 0x000F0000, GROUP=group_size, FMA=fma, F32_DOT=not x2.is_cuda, **cfg)
    return _finish(out, x, bias)


# Whether the row-layout dequantization (dequantize, then cuBLAS) builds each value with the row GEMV's bit
# pattern and one FMA instead of an integer-to-float conversion, a subtraction and a product: the same bits;
# compiled for sm90 (session 16, Triton 3.9, the engine's 64 x 256 tile), 2,144 instructions a program instead
# of 2,280, none of them the 128 quarter-rate I2FP (session 15 counted 1,056 and 1,200 another way).
# Timed on an H200 (session 16, awq 256 x (512 + 256) offline, alternated): 7,418 and 7,358 output tok/s
# against 7,445 and 7,472 without, so the pass is not bound by its instructions; off. (int4_row_gemm builds
# its values this way.)
INT4_DEQUANT_FMA = False


INT4_ROW_TILE = dict(BLOCK_N=16, BLOCK_K=1024, SPLIT_K=1, num_warps=4, num_stages=3)


def int4_row_gemv(x: torch.Tensor, packed: torch.Tensor, zeros: torch.Tensor, scales: torch.Tensor,
                  group_size: int, bias: torch.Tensor | None = None, config: dict | None = None,
                  silu_mul: bool = False, mma_layout: bool = False) -> torch.Tensor:
    """``x [.., K] @ W.T`` of a 4-bit weight in ``int4_row_pack``'s layout (or with ``mma_layout``
    ``gluon_quant.int4_mma_pack``'s; ``zeros``/``scales`` ``[G, N]`` as ``int_matmul`` takes them), one program
    per row of x (the engine runs it at one row). With
    ``silu_mul`` (no bias, no split-K; ``packed`` a merged [gate; up]): ``silu(gate) * up`` of the output."""
    x2 = _rows_2d(x)
    m, k = x2.shape
    n = packed.shape[0]
    cfg = dict(config or INT4_ROW_TILE)
    if silu_mul:
        if bias is not None or n % 2:
            raise ValueError("int4_row_gemv(silu_mul=True) takes an even weight without bias")
        n //= 2
        cfg.update(BLOCK_N=max(cfg["BLOCK_N"] // 2, 2), SPLIT_K=1)  # the same rows a program, from both halves
    bk = cfg["BLOCK_K"]
    while bk > group_size and (bk % group_size or k % bk):
        bk //= 2
    if bk < group_size or bk % group_size or k % bk:
        bk = group_size  # one group per tile
    if k % bk or group_size % (64 if mma_layout else 32):
        raise ValueError(f"int4_row_gemv needs group_size={group_size} to be a multiple of "
                         f"{64 if mma_layout else 32} dividing K={k}")
    cfg["BLOCK_K"] = bk
    tiles = triton.cdiv(n, cfg["BLOCK_N"])
    part, arrivals, out = _split_outputs(x2, m, n, m * tiles, cfg["SPLIT_K"])
    _int4_row_gemv_kernel[(m, tiles, cfg["SPLIT_K"])](
        x2, packed, zeros, scales, out, m, n, k, x2.stride(0), packed.stride(0), out.stride(0), 0x000F0000,
        part, arrivals, GROUP=group_size, **cfg, **pdl_args(x2), SILU_MUL=silu_mul, SPLIT_COMBINE=arrivals is not None,
        MMA_LAYOUT=mma_layout)
    return _finish(out, x, bias)


@triton.jit
def _silu_mul_epilogue(gate, up, dtype: tl.constexpr):
    """``silu(gate) * up`` of two GEMV outputs, rounded as ``silu_and_mul`` on the stored outputs rounds."""
    g = gate.to(dtype).to(tl.float32)
    act = (g / (1.0 + tl.exp(-g))).to(dtype).to(tl.float32)
    return act * up.to(dtype).to(tl.float32)


@triton.jit
def _qkv_rope_epilogue(first, second, head, freq, rn, out_row, bias_ptr, cos, sin, slot, k_cache_ptr,
                       v_cache_ptr, stride_cb, stride_cslot, stride_ch, block_size,
                       num_q_heads, num_kv_heads, k_inv_scale, v_inv_scale, HALF: tl.constexpr,
                       KV_FP8: tl.constexpr):
    """A ROPE program's end (``_fp8_gemv_kernel``): the rows ``rn`` (``first``) and ``rn + HALF``
    (``second``) of one head of a qkv output, each rounded to the output's dtype with its bias added as
    the unfused ``out + bias`` rounds; q and k heads rotated as ``rotary_and_write_kv_cache`` rotates;
    stored, and k/v heads written into the cache at the token's slot (a negative slot: padding, none).
    ``cos``/``sin`` (the position's, at ``freq``) and ``slot`` are step inputs, read before the wait."""
    dtype: tl.constexpr = out_row.dtype.element_ty
    a = first.to(dtype)
    b = second.to(dtype)
    if bias_ptr is not None:
        a = (a.to(tl.float32) + tl.load(bias_ptr + rn).to(tl.float32)).to(dtype)
        b = (b.to(tl.float32) + tl.load(bias_ptr + rn + HALF).to(tl.float32)).to(dtype)
    if head < num_q_heads + num_kv_heads:  # q or k: rotated
        a, b = _rotate(a, b, cos, sin)
        a, b = a.to(dtype), b.to(dtype)
    tl.store(out_row + rn, a)
    tl.store(out_row + rn + HALF, b)
    if head >= num_q_heads and slot >= 0:
        is_k = head < num_q_heads + num_kv_heads
        kv_head = tl.where(is_k, head - num_q_heads, head - num_q_heads - num_kv_heads)
        off = (slot // block_size) * stride_cb + (slot % block_size) * stride_cslot + kv_head * stride_ch + freq
        ca, cb = a, b
        if KV_FP8:  # the values the cache holds: times the reciprocal scale, rounded to e4m3
            inv_scale = tl.where(is_k, k_inv_scale, v_inv_scale)
            ca = _round_to_e4m3(a.to(tl.float32) * inv_scale)
            cb = _round_to_e4m3(b.to(tl.float32) * inv_scale)
        cache_ty: tl.constexpr = k_cache_ptr.dtype.element_ty  # the v cache's too (_check_cache)
        # Every lane to the k cache for a k head, to the v cache otherwise. (A bound, not `tensor & scalar`,
        # which the interpreter mishandles.)
        into_k = freq < tl.where(is_k, HALF, 0)
        into_v = freq >= tl.where(is_k, HALF, 0)
        tl.store(k_cache_ptr + off, ca.to(cache_ty), mask=into_k)
        tl.store(k_cache_ptr + off + HALF, cb.to(cache_ty), mask=into_k)
        tl.store(v_cache_ptr + off, ca.to(cache_ty), mask=into_v)
        tl.store(v_cache_ptr + off + HALF, cb.to(cache_ty), mask=into_v)


@triton.jit
def _fp8_gemv_kernel(
    x_ptr, w_ptr, ws_ptr, out_ptr,
    M, N, K, M_BUCKET, stride_xm, stride_wn, stride_om,
    bias_ptr=None, pos_ptr=None, cos_sin_ptr=None, k_cache_ptr=None, v_cache_ptr=None, slot_ptr=None,
    stride_cs=0, stride_cb=0, stride_cslot=0, stride_ch=0, block_size=1, num_q_heads=0, num_kv_heads=0,
    k_inv_scale=1.0, v_inv_scale=1.0, part_ptr=None, arrivals_ptr=None,
    BLOCK_N: tl.constexpr = 16, BLOCK_K: tl.constexpr = 256, SPLIT_K: tl.constexpr = 1, PDL: tl.constexpr = False,
    SILU_MUL: tl.constexpr = False, X_TILE: tl.constexpr = False, ROPE: tl.constexpr = False,
    HEAD_DIM: tl.constexpr = 128, KV_FP8: tl.constexpr = False, SPLIT_COMBINE: tl.constexpr = False,
):
    # The FP8 weight [N, K] is read along K (its contiguous dim, 16 values per 128-bit load), converted
    # in registers and multiplied by the row of x; one reduction along K at the end. x is read once per
    # tile and handed to the weight's layout through shared memory (two barriers a conversion), or with
    # X_TILE read by each thread for its own weights (no barriers, a bf16 -> float32 conversion per
    # weight instead of per input; FP8_GEMV_X_TILE, to be timed on the GPU). Under PDL the first
    # weight tile is read before the wait for the previous kernel. With SILU_MUL the weight is a merged
    # [gate; up] of 2N rows: a program reads rows n of both halves and stores silu(gate) * up (N outputs).
    # With ROPE (one row of a qkv projection, heads of HEAD_DIM: q, then k, then v) a program takes the
    # BLOCK_N frequencies j of one head and reads its rows j and j + HEAD_DIM / 2, the two halves neox
    # rotary pairs. The epilogue adds the bias, rotates q and k by the position's cos/sin and stores the
    # head, and writes a k or v head into the paged cache at the token's slot: ``rotary_and_write_kv_cache``
    # folded in, with its roundings.
    gdc_launch_dependents(PDL)  # the next kernel may start (and read its weights) and wait
    row = tl.program_id(0)
    pid_n = tl.program_id(1)
    pid_k = tl.program_id(2)
    HALF: tl.constexpr = HEAD_DIM // 2
    if ROPE:
        head = pid_n // (HALF // BLOCK_N)
        freq = (pid_n % (HALF // BLOCK_N)) * BLOCK_N + tl.arange(0, BLOCK_N)
        rn = head * HEAD_DIM + freq
    else:
        rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rk = tl.arange(0, BLOCK_K)
    n_ok = rn < N
    x_row = x_ptr + row.to(tl.int64) * stride_xm
    w_rows = w_ptr + rn[:, None].to(tl.int64) * stride_wn
    if ROPE:
        u_rows = w_rows + HALF * stride_wn  # the second half of the head
    else:
        u_rows = w_rows + N.to(tl.int64) * stride_wn  # SILU_MUL: the up half
    # The products of a tile are summed over runs of 16 inputs (one 128-bit load of a thread) as they come,
    # so the accumulators are [BLOCK_N, BLOCK_K / 16]: a sixteenth of the registers of a full tile.
    acc = tl.zeros((BLOCK_N, BLOCK_K // 16), dtype=tl.float32)
    acc_u = tl.zeros((BLOCK_N, BLOCK_K // 16), dtype=tl.float32)
    if ROPE:  # the step's inputs (pdl.py: no kernel of the step writes them), read before the wait
        pos = tl.load(pos_ptr + row).to(tl.int64)
        cos = tl.load(cos_sin_ptr + pos * stride_cs + freq)
        sin = tl.load(cos_sin_ptr + pos * stride_cs + HALF + freq)
        slot = tl.load(slot_ptr + row).to(tl.int64)
    for t in range(pid_k, tl.cdiv(K, BLOCK_K), SPLIT_K):
        k = t * BLOCK_K + rk
        k_ok = k < K
        w = tl.load(w_rows + k[None, :], mask=n_ok[:, None] & k_ok[None, :], other=0.0)
        if SILU_MUL or ROPE:
            w_u = tl.load(u_rows + k[None, :], mask=n_ok[:, None] & k_ok[None, :], other=0.0)
        if t == pid_k:  # the first tile of weights is on its way: now wait for the previous kernel
            gdc_wait(PDL)
        if X_TILE:
            x = tl.load(x_row + k[None, :] + 0 * rn[:, None], mask=k_ok[None, :], other=0.0).to(tl.float32)
        else:
            x = tl.load(x_row + k, mask=k_ok, other=0.0).to(tl.float32)[None, :]
        acc += tl.sum(tl.reshape(w.to(tl.float32) * x, (BLOCK_N, BLOCK_K // 16, 16)), 2)
        if SILU_MUL or ROPE:
            acc_u += tl.sum(tl.reshape(w_u.to(tl.float32) * x, (BLOCK_N, BLOCK_K // 16, 16)), 2)
    gdc_wait(PDL)  # a no-op after the one above; it waits in a program that had no tile
    res = tl.sum(acc, 1) * tl.load(ws_ptr + rn, mask=n_ok, other=0.0)
    if ROPE:
        _qkv_rope_epilogue(
            res, tl.sum(acc_u, 1) * tl.load(ws_ptr + rn + HALF), head, freq, rn, out_ptr + row.to(tl.int64) * stride_om,
            bias_ptr, cos, sin, slot, k_cache_ptr, v_cache_ptr,
            stride_cb, stride_cslot, stride_ch, block_size, num_q_heads, num_kv_heads, k_inv_scale,
            v_inv_scale, HALF, KV_FP8)
    else:
        if SILU_MUL:
            up = tl.sum(acc_u, 1) * tl.load(ws_ptr + N + rn, mask=n_ok, other=0.0)
            res = _silu_mul_epilogue(res, up, out_ptr.dtype.element_ty)
        out = out_ptr + row.to(tl.int64) * stride_om + rn
        if SPLIT_K == 1:
            tl.store(out, res.to(out_ptr.dtype.element_ty), mask=n_ok)
        elif SPLIT_COMBINE:
            _combine_split_k(res, out, part_ptr, arrivals_ptr, row, pid_n, pid_k, rn, n_ok, M, N, SPLIT_K)
        else:
            tl.atomic_add(out, res, mask=n_ok)


def _fp8_gemv_cfg(bn, bk, split, warps, stages=3):
    return triton.Config(dict(BLOCK_N=bn, BLOCK_K=bk, SPLIT_K=split), num_warps=warps, num_stages=stages)


_FP8_GEMV = [_fp8_gemv_cfg(bn, bk, sp, w) for bn, bk, sp, w in (
    (16, 256, 1, 4), (8, 512, 1, 4), (32, 256, 1, 4), (16, 512, 1, 8), (64, 128, 1, 4), (16, 256, 2, 4),
    (32, 256, 4, 4), (8, 1024, 1, 8))]


def fp8_gemv(x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor,
             bias: torch.Tensor | None = None, config: dict | None = None, silu_mul: bool = False) -> torch.Tensor:
    """``fp8_weight_only_linear`` for a few rows without tensor cores (``_fp8_gemv_kernel``). With
    ``silu_mul`` (one row, no bias; ``weight`` a merged [gate; up]): ``silu(gate) * up`` of the output."""
    x2 = _rows_2d(x)
    m, k = x2.shape
    n = weight.shape[0]
    if silu_mul:
        if bias is not None or m != 1 or n % 2:
            raise ValueError("fp8_gemv(silu_mul=True) takes one row of x and an even weight without bias")
        n //= 2
        config = fp8_silu_mul_tiles(n, k)
    if config is None and x2.is_cuda and m == 1:
        config = fp8_row_tiles(n, k)
    if config is None and x2.is_cuda:
        out = _out_buffer(m, n, 2, x)  # the autotuned configs may split K: zeroed float32
        if "fp8_gemv" not in _TUNED:
            _TUNED["fp8_gemv"] = _autotuned(_fp8_gemv_kernel, _FP8_GEMV, None, ("out_ptr",))
        _TUNED["fp8_gemv"][lambda meta: (m, triton.cdiv(n, meta["BLOCK_N"]), meta["SPLIT_K"])](
            x2, weight, weight_scale.reshape(-1), out, m, n, k, _row_bucket(m), x2.stride(0), weight.stride(0),
            out.stride(0))  # without PDL: the autotuner's benchmark launches must not wait on each other
    else:
        cfg = dict(config or dict(BLOCK_N=16, BLOCK_K=256, SPLIT_K=1, num_warps=4))
        cfg.setdefault("X_TILE", FP8_GEMV_X_TILE)
        tiles = triton.cdiv(n, cfg["BLOCK_N"])
        part, arrivals, out = _split_outputs(x2, m, n, m * tiles, cfg["SPLIT_K"])
        _fp8_gemv_kernel[(m, tiles, cfg["SPLIT_K"])](
            x2, weight, weight_scale.reshape(-1), out, m, n, k, _row_bucket(m), x2.stride(0), weight.stride(0),
            out.stride(0), part_ptr=part, arrivals_ptr=arrivals, **cfg, **pdl_args(x2), SILU_MUL=silu_mul,
            SPLIT_COMBINE=arrivals is not None)
    return _finish(out, x, bias)


def fp8_qkv_rope_gemv(x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor, bias: torch.Tensor | None,
                      positions: torch.Tensor, cos_sin_cache: torch.Tensor, k_cache: torch.Tensor,
                      v_cache: torch.Tensor, slot_mapping: torch.Tensor, num_q_heads: int, num_kv_heads: int,
                      k_scale: float = 1.0, v_scale: float = 1.0, config: dict | None = None) -> torch.Tensor:
    """One row of a qkv projection on the FP8 GEMV with rotary and the KV-cache write in its epilogue: the
    ``[1, (Hq + 2 Hkv) D]`` output with q and k rotated (``triton_attention.rotary_and_write_kv_cache`` of
    ``fp8_gemv``'s output, bias added), and the token's k and v in the cache. ``config``: the GEMV's tiles
    (default ``fp8_qkv_rope_tiles``); a program covers ``BLOCK_N`` frequencies of one head, twice."""
    from kvloom.kernels.triton_attention import _check_cache

    _check_cache(k_cache, v_cache)
    x2 = _rows_2d(x)
    m, k = x2.shape
    n = weight.shape[0]
    head_dim = k_cache.shape[-1]
    cfg = dict(config or fp8_qkv_rope_tiles(n, k) or {})
    if (m != 1 or not cfg or cfg.get("SPLIT_K", 1) != 1 or n != (num_q_heads + 2 * num_kv_heads) * head_dim
            or head_dim % 2 or (head_dim // 2) % cfg["BLOCK_N"] or cos_sin_cache.shape[-1] != head_dim
            or k_cache.shape[2] != num_kv_heads):
        raise ValueError(f"fp8_qkv_rope_gemv takes one row, fixed tiles without split-K and a qkv weight of "
                         f"(Hq + 2 Hkv) x head_dim rows; got {m} rows, an [{n}, {k}] weight, {num_q_heads} + "
                         f"2 x {num_kv_heads} heads of {head_dim}, tiles {cfg}")
    cfg.setdefault("X_TILE", FP8_GEMV_X_TILE)
    cos_sin_cache = cos_sin_cache.contiguous()
    out = torch.empty((1, n), device=x.device, dtype=x.dtype)
    _fp8_gemv_kernel[(1, n // (2 * cfg["BLOCK_N"]), 1)](
        x2, weight, weight_scale.reshape(-1), out, m, n, k, 1, x2.stride(0), weight.stride(0), out.stride(0),
        bias, positions, cos_sin_cache, k_cache, v_cache, slot_mapping,
        cos_sin_cache.stride(0), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), k_cache.shape[1],
        num_q_heads, num_kv_heads, 1.0 / k_scale, 1.0 / v_scale,
        **cfg, **pdl_args(x2), ROPE=True, HEAD_DIM=head_dim, KV_FP8=k_cache.dtype == torch.float8_e4m3fn)
    return out.reshape(*x.shape[:-1], n)


# The fused qkv + rotary GEMV's K tile at least this (up to K's power of two): on an H200 at Llama-3-8B's
# qkv_proj, in the decode step, 1024 took 259 us a step against 310 for the one-row tile's 512 (session 15,
# docs/benchmarks.md); the plain qkv GEMV keeps 512, which its own sweep picked.
FP8_QKV_ROPE_MIN_BLOCK_K = 1024


def fp8_qkv_rope_tiles(n: int, k: int) -> dict | None:
    """The fused qkv + rotary GEMV's tiles: the one-row tiles with a K tile of at least
    ``FP8_QKV_ROPE_MIN_BLOCK_K``, each program's rows split between the two halves of a head (so
    ``BLOCK_N`` halves), or None where there are no fixed ones."""
    tiles = fp8_row_tiles(n, k)
    if tiles is None or tiles.get("SPLIT_K", 1) != 1:
        return None
    block_k = max(tiles["BLOCK_K"], min(FP8_QKV_ROPE_MIN_BLOCK_K, triton.next_power_of_2(k)))
    return dict(tiles, BLOCK_N=max(tiles["BLOCK_N"] // 2, 1), BLOCK_K=block_k)


# Whether a one-row decode step's qkv projection on the FP8 GEMV rotates q/k and writes the KV cache in
# its epilogue (``fp8_qkv_rope_gemv``: the rotary + cache-write kernel folded in). On: an H200's Llama-3-8B
# decode step took 63 us less with it (2,940 -> 2,877 us in one process; docs/benchmarks.md, session 15).
FP8_QKV_ROPE = True


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


_SCRATCH: dict[tuple, torch.Tensor] = {}


def _scratch(x: torch.Tensor, numel: int) -> torch.Tensor | None:
    """The dequantized-weight buffer shared by every layer (they run one after another on one stream), at
    least ``numel`` of x's dtype; None inside a CUDA-graph capture that would have to make it: a buffer
    made then would live in the graph's private pool, which replays reuse (the eager warm-up makes it
    first)."""
    key = (x.device, x.dtype)
    buf = _SCRATCH.get(key)
    if buf is None or buf.numel() < numel:
        if x.is_cuda and torch.cuda.is_current_stream_capturing():
            return None
        buf = _SCRATCH[key] = torch.empty(numel, device=x.device, dtype=x.dtype)
    return buf


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


def int4_row_matmul_dequantized(x: torch.Tensor, packed: torch.Tensor, zeros: torch.Tensor, scales: torch.Tensor,
                                group_size: int, bias: torch.Tensor | None = None,
                                mma_layout: bool = False) -> torch.Tensor:
    """``int_matmul_dequantized`` on the row layout (or the MMA row layout): the dense ``[N, K]`` weight in the
    shared scratch buffer, then cuBLAS. Capturing without the buffer: slices of rows through the tensor-core
    kernels instead (the Gluon GEMM's 256 on the MMA layout, the Triton one's 64 on the row layout)."""
    n, k = packed.shape[0], packed.shape[1] * 8
    buf = _scratch(x, n * k)
    if buf is None:
        if mma_layout:
            from kvloom.kernels import gluon_quant as gq

            gemm, step = gq.int4_mma_gemm, INT4_MMA_GLUON_MAX_ROWS
        else:
            gemm, step = int4_mma_gemm, INT4_MMA_MAX_ROWS
        x2 = _rows_2d(x)
        out = torch.cat([gemm(x2[i:i + step], packed, zeros, scales, group_size) for i in range(0, x2.shape[0], step)])
        return _finish(out, x, bias)
    w = int4_row_dequantize(packed, zeros, scales, group_size, buf, mma_layout)
    return torch.nn.functional.linear(x, w, bias)


# --------------------------------------------------------------------------------------------------
# Which path a quantized layer takes, by row count and shape: a fixed rule read off the CUDA-graph timings
# of benchmarks/quant_kernels_gpu.py at Llama-3-8B's shapes on an H200 (docs/benchmarks.md; weights
# rotated past L2). Timing the candidates at start-up instead was tried and chose wrongly: eager calls
# of a few microseconds measure their Python launch, not the kernel that a CUDA graph replays.
# --------------------------------------------------------------------------------------------------
TINYGEMM_MAX_ROWS = 4  # 1.6-1.8x bf16 at one row; 0.44-0.60x at 16 rows, where the tensor-core kernel wins
INT_DEQUANTIZE_MIN_ROWS = 64  # 0.54-0.61x bf16 at 256 rows against the tensor-core kernel's 0.28-0.41x
FP8_WIDE_N = 16384  # at 2-16 rows, W8A8 beats the weight-only GEMV on wide outputs (gate_up: 1.58x vs 1.28x)


def int_linear(x: torch.Tensor, qweight: torch.Tensor, zeros: torch.Tensor, scales: torch.Tensor,
               group_size: int, bits: int, bias: torch.Tensor | None = None, tinygemm=None) -> torch.Tensor:
    """A K-packed layer on CUDA (8-bit, and 4-bit with one group of all inputs; other 4-bit layers run
    ``int4_linear`` on the row layout): PyTorch's int4 GEMM for a few rows (``tinygemm``), the tensor-core
    kernel up to 63 rows, dequantize + cuBLAS beyond."""
    rows = x.numel() // x.shape[-1]
    if tinygemm is not None and rows <= TINYGEMM_MAX_ROWS and x.dtype == torch.bfloat16:
        return tinygemm_linear(x, *tinygemm, group_size, bias)
    if rows >= INT_DEQUANTIZE_MIN_ROWS:
        return int_matmul_dequantized(x, qweight, zeros, scales, group_size, bits, bias)
    return int_matmul(x, qweight, zeros, scales, group_size, bits, bias)


# 4-bit layers on CUDA hold the row layout (``int4_row_pack``) and, where PyTorch's int4 GEMM takes the
# shape, tinygemm's copy of the weight. By rows (benchmarks/int4_gemv_sweep_gpu.py at Llama-3-8B's shapes
# on an H200, session 10; CUDA-graph replay, weights past L2; microseconds):
# * one row: the row GEMV, except on weights of 4096 x 4096 and less, where tinygemm is faster (o_proj
#   6.84 against 8.02); qkv_proj 8.99 (tinygemm 9.26), gate_up_proj 27.44 (33.2), down_proj 17.59 (18.69);
# * 2-4 rows: tinygemm (gate_up 34.6 at 2 rows, 47.1 at 4), the tensor-core kernel where it is missing;
# * 5-16 rows: the output-major tensor-core kernel on the row layout (gate_up 60 at 8 and 16 rows; the
#   K-packed tensor-core kernel took 67-70, dequantize + cuBLAS 173, tinygemm 78-135);
# * 17-256 rows: the many-row GEMM dequantizing tiles in registers into wgmma (``int4_row_gemm``, tiles by
#   shape and rows from ``int4_gemm_tiles``), except where dequantize + cuBLAS measured faster (qkv_proj
#   and o_proj from 129 rows; ``INT4_GEMM_TILES``);
# * more rows: dequantize into the scratch buffer, then cuBLAS.
# Row GEMV tiles: split-K for long, narrow weights (down_proj: 64 outputs a program, K in four).
INT4_ROW_MIN_WEIGHT = 4096 * 4096 + 1
# Groups the row-layout kernels take: a tile of theirs spans whole groups (the tensor-core kernel's K tile
# is one group), so a group of all K inputs (GPTQ group_size -1) keeps the K-packed layout and kernels.
INT4_ROW_GROUPS = (32, 64, 128)


def int4_row_layout_ok(k: int, group_size: int) -> bool:
    """Whether a 4-bit layer of ``k`` inputs in groups of ``group_size`` runs on the row layout."""
    return group_size in INT4_ROW_GROUPS and k % group_size == 0
INT4_ROW_LONG_K = dict(BLOCK_N=64, BLOCK_K=1024, SPLIT_K=4, num_warps=8, num_stages=2)


def int4_row_tiles(n: int, k: int) -> dict:
    """The row GEMV's tiles for an ``[n, k]`` weight."""
    return dict(INT4_ROW_LONG_K if k >= 8192 and n <= 8192 else INT4_ROW_TILE)


# Whether a merged gate/up 4-bit layer's one-row GEMV stores silu(gate) * up itself (``int4_row_gemv``'s
# ``silu_mul``), saving the SiLU-and-mul kernel. Off: see the session-11 measurements in docs/benchmarks.md.
INT4_FUSED_SILU_MUL = False


def int4_one_row_path(n: int, k: int, dtype: torch.dtype, tinygemm) -> str:
    """What runs one row of an ``[n, k]`` 4-bit layer: ``row`` (the row GEMV) or ``tinygemm``."""
    if tinygemm is None or n * k >= INT4_ROW_MIN_WEIGHT or dtype != torch.bfloat16:
        return "row"
    return "tinygemm"


def int4_linear(x: torch.Tensor, packed: torch.Tensor, zeros: torch.Tensor, scales: torch.Tensor,
                group_size: int, bias: torch.Tensor | None = None, tinygemm=None,
                mma_layout: bool = False) -> torch.Tensor:
    """A 4-bit layer on CUDA by rows, on the row layout, or with ``mma_layout`` on the Gluon GEMM's MMA row
    layout (Hopper), and tinygemm's copy where there is one. On the MMA layout one row also takes the Gluon
    GEMM (x padded to 8 rows): at Llama-3-8B's shapes on an H200 (session 18) its 29.7, 16.5 and 10.5 us for
    gate_up, down and qkv are the row GEMV's time on the row layout (27.6, 17.4, 11.4), where the GEMV on the
    MMA layout, reading x at scattered inputs, made batch-1 decode 10% slower (335 against 371 tok/s)."""
    rows = x.numel() // x.shape[-1]
    n, k = packed.shape[0], packed.shape[1] * 8
    one_row = rows == 1 and int4_one_row_path(n, k, x.dtype, tinygemm) == "row"
    if one_row and not mma_layout:
        return int4_row_gemv(x, packed, zeros, scales, group_size, bias, config=int4_row_tiles(n, k))
    if tinygemm is not None and rows <= TINYGEMM_MAX_ROWS and x.dtype == torch.bfloat16:
        return tinygemm_linear(x, *tinygemm, group_size, bias)
    if mma_layout:
        from kvloom.kernels import gluon_quant as gq

        if rows <= INT4_MMA_GLUON_MAX_ROWS:
            tile = gq.int4_mma_tiles(rows, n, k)
            if gq.int4_mma_gemm_ok(n, k, group_size, x.dtype, tile):
                return gq.int4_mma_gemm(x, packed, zeros, scales, group_size, bias, config=tile)
        if one_row:  # a shape the Gluon GEMM does not take
            return int4_row_gemv(x, packed, zeros, scales, group_size, bias, config=int4_row_tiles(n, k),
                                 mma_layout=True)
        return int4_row_matmul_dequantized(x, packed, zeros, scales, group_size, bias, mma_layout=True)
    if rows <= INT4_MMA_ROWS and x.dtype in (torch.bfloat16, torch.float16):
        return int4_mma_gemm(x, packed, zeros, scales, group_size, bias, config=int4_mma_tiles(rows, n))
    tile = int4_gemm_tiles(rows, n, k) if rows <= INT4_GEMM_MAX_ROWS else None
    if tile is not None and x.dtype in (torch.bfloat16, torch.float16):
        return int4_row_gemm(x, packed, zeros, scales, group_size, bias, config=tile)
    return int4_row_matmul_dequantized(x, packed, zeros, scales, group_size, bias)


# One row of FP8 weights: fixed tiles of the FMA GEMV, read off a sweep of 132 tile configs per shape on an
# H200 (benchmarks/gemv_sweep_gpu.py, session 9: CUDA-graph replay, weights past L2), by weight size up to
# Llama-3-8B's gate_up_proj. Microseconds against what ran before (the autotuned GEMV, which timing eager
# calls had picked slower tiles, or for o_proj the tl.dot GEMV): o_proj 7.47 (12.54), qkv_proj 9.98
# (12.85), down_proj 22.07 (30.49), gate_up_proj 36.01 (39.41). Batch-1 decode of the 8B shape went from
# 1.30x to 1.43x of bf16 (302 against 211 tok/s). Larger weights keep the autotuner.
# Session 11 re-timed them inside the decode step (PDL on, benchmarks/decode_profile_gpu.py --set): only
# down_proj moved, 8 x 1024 in 2 stages taking 17.1 us of the step's critical path against 19.4 for
# 16 x 1024 in 4; wider and 8-warp tiles were slower everywhere. Session 17 (same profile): down_proj in two
# K splits (SPLIT_COMBINE) took 522 us a step against 576 unsplit, the step 2,618 against 2,667-2,669 (382.6
# against 375.6-375.9 tok/s); o_proj split in two moved 225 to 217 us, within noise, and stays unsplit.
FP8_ROW_TILES = (
    (4096 * 4096, dict(BLOCK_N=8, BLOCK_K=1024, SPLIT_K=1, num_warps=4, num_stages=2)),
    (6144 * 4096, dict(BLOCK_N=8, BLOCK_K=512, SPLIT_K=1, num_warps=4, num_stages=2)),
    (4096 * 14336, dict(BLOCK_N=8, BLOCK_K=1024, SPLIT_K=2, num_warps=4, num_stages=2)),
    (28672 * 4096, dict(BLOCK_N=8, BLOCK_K=512, SPLIT_K=1, num_warps=4, num_stages=2)),
)


def fp8_silu_mul_tiles(n: int, k: int) -> dict:
    """The FMA GEMV's tiles for one row of a merged [gate; up] FP8 weight of ``2 n`` rows with SiLU-and-mul
    fused: the one-row tiles of the whole weight, each program taking half its rows from either half."""
    if FP8_SILU_MUL_TILES is not None:
        return dict(FP8_SILU_MUL_TILES)
    tiles = fp8_row_tiles(2 * n, k) or dict(BLOCK_N=8, BLOCK_K=512, SPLIT_K=1, num_warps=4, num_stages=2)
    return dict(tiles, BLOCK_N=max(tiles["BLOCK_N"] // 2, 2), SPLIT_K=1, X_TILE=FP8_SILU_MUL_X_TILE)


FP8_SILU_MUL_TILES = None  # fixed tiles for the fused gate/up GEMV (a benchmark's override); None: derived
# Whether the fixed-tile FP8 GEMV reads x in its weights' layout (``_fp8_gemv_kernel``'s X_TILE): on sm90,
# 147 -> 181 instructions a loop at 8 x 512 but none of its 8 barriers. Timed on the H200 (one row, Llama-3-8B,
# session 12): the fused gate/up 31.6 -> 30.2 us (4 x 512 a half), but qkv 9.1 -> 9.6, o 6.3 -> 7.3 and down
# 18.0 -> 23.4 us. So on for the SiLU-and-mul GEMV only.
FP8_GEMV_X_TILE = False
FP8_SILU_MUL_X_TILE = True


def fp8_row_tiles(n: int, k: int) -> dict | None:
    """The FMA GEMV's fixed tiles for one row of an ``[n, k]`` FP8 weight, or None (autotuned)."""
    for limit, tiles in FP8_ROW_TILES:
        if n * k <= limit:
            return dict(tiles)
    return None


def fp8_linear_path(rows: int, n: int, k: int) -> str:
    """Which of an FP8 layer's paths runs ``rows`` rows: ``gemv`` (no tensor cores), ``gemv_dot`` (the
    ``tl.dot`` weight-only GEMV) or ``w8a8`` (``_scaled_mm``)."""
    if rows == 1:
        return "gemv"  # fixed tiles up to 28672 x 4096 (fp8_row_tiles), autotuned beyond
    if rows <= FP8_GEMV_MAX_ROWS:
        return "w8a8" if n >= FP8_WIDE_N else "gemv_dot"
    return "w8a8"


# --------------------------------------------------------------------------------------------------
# PyTorch's int4 decode GEMM (tinygemm, ``torch._weight_int4pack_mm``): the fastest of all at one row on
# an H200 (1.6-1.8x bf16's time at Llama-3-8B's shapes), and collapsing beyond a few rows, so it is one
# more candidate for decode rows, kept as a second layout made at load beside the K-packed one.
# --------------------------------------------------------------------------------------------------
TINYGEMM_GROUPS = (32, 64, 128, 256)


def tinygemm_pack(qweight: torch.Tensor, zeros: torch.Tensor, scales: torch.Tensor, group_size: int):
    """``(packed, scales_and_zeros)`` in tinygemm's layout from the K-packed 4-bit weight: its dequantization
    is ``(q - 8) * s + zf``, so ``zf = (8 - z) * s``; scales and zeros in bf16, as the kernel wants. None
    where the kernel does not take the shape (or this torch lacks it)."""
    from kvloom.kernels.quant_reference import unpack_int32

    k, n = qweight.shape[0] * 8, qweight.shape[1]
    if group_size not in TINYGEMM_GROUPS or k % 1024 or n % 8 or not qweight.is_cuda:
        return None
    try:
        w = unpack_int32(qweight, 4, 0).t().contiguous()  # [N, K], 0..15
        packed = torch._convert_weight_to_int4pack((w[:, ::2] << 4 | w[:, 1::2]).to(torch.uint8), 8)
        s = scales.float()
        sz = torch.stack([s, (8 - zeros.float()) * s], -1).to(torch.bfloat16).contiguous()  # [G, N, 2]
    except (RuntimeError, AttributeError, NotImplementedError):
        return None
    return packed, sz


def tinygemm_linear(x: torch.Tensor, packed: torch.Tensor, sz: torch.Tensor, group_size: int,
                    bias: torch.Tensor | None = None) -> torch.Tensor:
    shape = x.shape
    out = torch._weight_int4pack_mm(x.reshape(-1, shape[-1]).contiguous(), packed, group_size, sz)
    if bias is not None:
        out = out + bias
    return out.reshape(*shape[:-1], out.shape[-1])
