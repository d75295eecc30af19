"""Which kernel a quantized layer runs on CUDA, by row count and shape, and which layout it holds: the one
module that imports the kernel families, and the entry points the rest of kvloom calls."""

from __future__ import annotations

import torch

from kvloom.kernels.options import DEFAULT_KERNELS, KernelOptions
from kvloom.kernels.quant import gluon_int4 as gq
from kvloom.kernels.quant.common import _finish, _rows_2d, _scratch
from kvloom.kernels.quant.int4_row import (INT4_MMA_MAX_ROWS, int4_gemm_tiles, int4_mma_gemm, int4_mma_tiles,
                                           int4_row_dequantize, int4_row_gemm, int4_row_gemv, int4_row_tiles)
from kvloom.kernels.quant.int_kpacked import int_matmul, int_matmul_dequantized
from kvloom.kernels.quant.tinygemm import tinygemm_linear

# The kernels kvloom's layers call directly, beside the routing functions below.
from kvloom.kernels.quant.fp8_rows import fp8_quantize_rows, rms_norm_fp8, silu_and_mul_fp8  # noqa: F401
from kvloom.kernels.quant.fp8_weight_only import (fp8_gemv, fp8_qkv_rope_gemv, fp8_qkv_rope_tiles,  # noqa: F401
                                                  fp8_weight_only_linear)
from kvloom.kernels.quant.gluon_int4 import int4_mma_pack_qweight  # noqa: F401
from kvloom.kernels.quant.int4_row import int4_row_pack  # noqa: F401
from kvloom.kernels.quant.tinygemm import tinygemm_pack  # noqa: F401


# Up to this many rows an FP8 layer runs weight-only here (bf16 activations, FP8 weight converted in
# registers): a decode step is bound by reading the weight, which is half of bf16's bytes, while the
# W8A8 path pays an activation quantization pass and cuBLASLt's padded 16-row tile.
FP8_GEMV_MAX_ROWS = 16


# The 5-16-row tensor-core kernel compiles a variant per row count: beyond 16 rows (eager mixed steps)
# int4_row_gemm, one compiled kernel a tile, was faster end to end (docs/benchmarks.md).
INT4_MMA_ROWS = 16


# Rows up to which 4-bit layers may run int4_row_gemm (from INT4_MMA_ROWS + 1); beyond, dequantize + cuBLAS.
INT4_GEMM_MAX_ROWS = 256
# Rows up to which a layer on the MMA row layout (Hopper) takes the Gluon GEMM, the fastest path there up to 256
# rows (docs/benchmarks.md); beyond, dequantize + cuBLAS.
INT4_MMA_GLUON_MAX_ROWS = 256


def int4_row_matmul_dequantized(x: torch.Tensor, packed: torch.Tensor, zeros: torch.Tensor, scales: torch.Tensor,
                                group_size: int, bias: torch.Tensor | None = None,
                                mma_layout: bool = False, options: KernelOptions = DEFAULT_KERNELS) -> torch.Tensor:
    """``int_matmul_dequantized`` on the row layout (or the MMA row layout): the dense ``[N, K]`` weight in the
    shared scratch buffer, then cuBLAS. Capturing without the buffer: slices of rows through the tensor-core
    kernels instead (the Gluon GEMM's 256 on the MMA layout, the Triton one's 64 on the row layout)."""
    n, k = packed.shape[0], packed.shape[1] * 8
    buf = _scratch(x, n * k)
    if buf is None:
        x2 = _rows_2d(x)
        if mma_layout:
            step = INT4_MMA_GLUON_MAX_ROWS
            parts = [gq.int4_mma_gemm(x2[i:i + step], packed, zeros, scales, group_size, options=options)
                     for i in range(0, x2.shape[0], step)]
        else:
            step = INT4_MMA_MAX_ROWS
            parts = [int4_mma_gemm(x2[i:i + step], packed, zeros, scales, group_size)
                     for i in range(0, x2.shape[0], step)]
        return _finish(torch.cat(parts), x, bias)
    w = int4_row_dequantize(packed, zeros, scales, group_size, buf, mma_layout, options)
    return torch.nn.functional.linear(x, w, bias)


# --------------------------------------------------------------------------------------------------
# Which path a quantized layer takes, by row count and shape: a fixed rule read off CUDA-graph timings
# (benchmarks/quant_kernels_gpu.py, docs/benchmarks.md), because timing eager calls at start-up measures
# their Python launch, not the kernel a CUDA graph replays.
# --------------------------------------------------------------------------------------------------
TINYGEMM_MAX_ROWS = 4  # tinygemm is the fastest at a few rows and collapses by 16
INT_DEQUANTIZE_MIN_ROWS = 64  # from here dequantize + cuBLAS beats the in-kernel dequantizing GEMM
FP8_WIDE_N = 16384  # at 2-16 rows W8A8 beats the weight-only GEMV on outputs this wide


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
# shape, tinygemm's copy of the weight. By rows, the fastest path at each (docs/benchmarks.md):
# * one row: the row GEMV, except on weights of 4096 x 4096 and less, where tinygemm is faster;
# * 2-4 rows: tinygemm, the tensor-core kernel where it is missing;
# * 5-16 rows: the output-major tensor-core kernel on the row layout;
# * 17-256 rows: the many-row GEMM dequantizing tiles in registers into wgmma (``int4_row_gemm``, tiles by
#   shape and rows from ``int4_gemm_tiles``), except where dequantize + cuBLAS is faster (``INT4_GEMM_TILES``);
# * more rows: dequantize into the scratch buffer, then cuBLAS.
# (The weight size from which one row takes the row GEMV over tinygemm: ``KernelOptions.int4_row_min_weight``.)
# Groups the row-layout kernels take: a tile of theirs spans whole groups (the tensor-core kernel's K tile
# is one group), so a group of all K inputs (GPTQ group_size -1) keeps the K-packed layout and kernels.
INT4_ROW_GROUPS = (32, 64, 128)


def int4_row_layout_ok(k: int, group_size: int) -> bool:
    """Whether a 4-bit layer of ``k`` inputs in groups of ``group_size`` runs on the row layout."""
    return group_size in INT4_ROW_GROUPS and k % group_size == 0


def int4_one_row_path(n: int, k: int, dtype: torch.dtype, tinygemm, options: KernelOptions = DEFAULT_KERNELS) -> str:
    """What runs one row of an ``[n, k]`` 4-bit layer: ``row`` (the row GEMV) or ``tinygemm``."""
    if tinygemm is None or n * k >= options.int4_row_min_weight or dtype != torch.bfloat16:
        return "row"
    return "tinygemm"


def int4_linear(x: torch.Tensor, packed: torch.Tensor, zeros: torch.Tensor, scales: torch.Tensor,
                group_size: int, bias: torch.Tensor | None = None, tinygemm=None,
                mma_layout: bool = False, options: KernelOptions = DEFAULT_KERNELS) -> torch.Tensor:
    """A 4-bit layer on CUDA by rows, on the row layout, or with ``mma_layout`` on the Gluon GEMM's MMA row
    layout (Hopper), and tinygemm's copy where there is one. On the MMA layout one row also takes the Gluon
    GEMM (x padded to 8 rows), as fast as the row GEMV on the row layout, where the GEMV on the MMA layout
    reads x at scattered inputs and is slower (docs/benchmarks.md)."""
    rows = x.numel() // x.shape[-1]
    n, k = packed.shape[0], packed.shape[1] * 8
    one_row = rows == 1 and int4_one_row_path(n, k, x.dtype, tinygemm, options) == "row"
    if one_row and not mma_layout:
        return int4_row_gemv(x, packed, zeros, scales, group_size, bias, config=int4_row_tiles(n, k), options=options)
    if tinygemm is not None and rows <= TINYGEMM_MAX_ROWS and x.dtype == torch.bfloat16:
        return tinygemm_linear(x, *tinygemm, group_size, bias)
    if mma_layout:
        if rows <= INT4_MMA_GLUON_MAX_ROWS:
            tile = gq.int4_mma_tiles(rows, n, k)
            if gq.int4_mma_gemm_ok(n, k, group_size, x.dtype, tile):
                return gq.int4_mma_gemm(x, packed, zeros, scales, group_size, bias, config=tile, options=options)
        if one_row:  # a shape the Gluon GEMM does not take
            return int4_row_gemv(x, packed, zeros, scales, group_size, bias, config=int4_row_tiles(n, k),
                                 mma_layout=True, options=options)
        return int4_row_matmul_dequantized(x, packed, zeros, scales, group_size, bias, mma_layout=True, options=options)
    if rows <= INT4_MMA_ROWS and x.dtype in (torch.bfloat16, torch.float16):
        return int4_mma_gemm(x, packed, zeros, scales, group_size, bias, config=int4_mma_tiles(rows, n))
    tile = int4_gemm_tiles(rows, n, k, options) if rows <= INT4_GEMM_MAX_ROWS else None
    if tile is not None and x.dtype in (torch.bfloat16, torch.float16):
        return int4_row_gemm(x, packed, zeros, scales, group_size, bias, config=tile)
    return int4_row_matmul_dequantized(x, packed, zeros, scales, group_size, bias, options=options)


def fp8_linear_path(rows: int, n: int, k: int) -> str:
    """Which of an FP8 layer's paths runs ``rows`` rows: ``gemv`` (no tensor cores), ``gemv_dot`` (the
    ``tl.dot`` weight-only GEMV) or ``w8a8`` (``_scaled_mm``)."""
    if rows == 1:
        return "gemv"  # fixed tiles up to 28672 x 4096 (fp8_row_tiles), autotuned beyond
    if rows <= FP8_GEMV_MAX_ROWS:
        return "w8a8" if n >= FP8_WIDE_N else "gemv_dot"
    return "w8a8"


def mma_layout_wanted(device: torch.device, k: int, group_size: int, dtype: torch.dtype,
                      options: KernelOptions = DEFAULT_KERNELS) -> bool:
    """Whether a 4-bit layer on ``device`` holds the MMA row layout (``options.int4_mma_layout``, Hopper, this
    Gluon, and inputs and groups its tiles take: K tiles of 64 and 128 within a group)."""
    if not (options.int4_mma_layout and gq.AVAILABLE and device.type == "cuda" and dtype in (torch.bfloat16, torch.float16)):
        return False
    if torch.cuda.get_device_capability(device) != (9, 0):
        return False
    return group_size % 128 == 0 and k % group_size == 0 and k % 256 == 0
