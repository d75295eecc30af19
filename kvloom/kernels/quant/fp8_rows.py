"""Dynamic per-token FP8 activation quantization for W8A8 layers: alone (``fp8_quantize_rows``), or in the
kernel that produces the layer's input (RMSNorm, SiLU-and-mul)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kvloom.kernels.options import DEFAULT_KERNELS, KernelOptions
from kvloom.kernels.pdl import gdc_launch_dependents, gdc_wait, pdl_args
from kvloom.kernels.triton_attention import _round_to_e4m3
from kvloom.kernels.triton_fused import _rms_norm_row, _row_warps, _rows


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
# (``FP8LinearMethod.takes_fp8_rows``, ``KernelOptions.fp8_fused_quant``): RMSNorm before qkv and gate/up,
# SiLU-and-mul before down. Each keeps a whole row in registers (up to ``FP8_FUSED_MAX_COLS``), rounds its
# output to the activation's dtype as the unfused kernel does, then quantizes it as ``fp8_quantize_rows``
# would: the same bytes, one kernel and one bf16 round trip less per layer. Rows past M are the same zero
# padding with scale 1.
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
                 pad_to: int = 16, options: KernelOptions = DEFAULT_KERNELS, max_cols: int = FP8_FUSED_MAX_COLS):
    """``triton_fused.rms_norm`` with its output quantized per row as ``fp8_quantize_rows`` does:
    ``FP8Rows``, or ``(FP8Rows, x + residual)`` with ``residual``. None where a row is wider than ``max_cols``
    or ``options.fp8_fused_quant`` is off."""
    from kvloom.kernels.quant_reference import FP8Rows

    n = x.shape[-1]
    if not options.fp8_fused_quant or n > max_cols:
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
            BLOCK=block, min_scale=1e-12, num_warps=_row_warps(block), **pdl_args(x2, options.pdl))
    rows = FP8Rows(xq, scale, m, out_dtype)
    return rows if residual is None else (rows, new_res.view(residual.shape))


def silu_and_mul_fp8(x: torch.Tensor, pad_to: int = 16, options: KernelOptions = DEFAULT_KERNELS,
                     max_cols: int = FP8_FUSED_MAX_COLS):
    """``triton_fused.silu_and_mul`` with its output quantized per row as ``fp8_quantize_rows`` does
    (``FP8Rows``); None where a row is wider than ``max_cols`` or ``options.fp8_fused_quant`` is off."""
    from kvloom.kernels.quant_reference import FP8Rows

    n = x.shape[-1] // 2
    if not options.fp8_fused_quant or n > max_cols:
        return None
    x2 = _rows(x)
    m = x2.shape[0]
    xq, scale = _fp8_rows_out(m, n, x.device, pad_to)
    block = triton.next_power_of_2(n)
    if m > 0 and n > 0:
        _silu_and_mul_fp8_kernel[(xq.shape[0],)](x2, xq, scale, m, x2.stride(0), xq.stride(0), n, BLOCK=block,
                                                 min_scale=1e-12, num_warps=_row_warps(block),
                                                 **pdl_args(x2, options.pdl))
    return FP8Rows(xq, scale, m, x.dtype)
