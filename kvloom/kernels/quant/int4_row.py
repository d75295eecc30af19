"""4-bit kernels on the row layout (``int4_row_pack``; the one-row GEMV and the dequantize pass also on the
Gluon GEMM's MMA row layout): the one-row GEMV, the tensor-core GEMMs for 5-16 and 17-256 rows, and the
dequantize pass for dequantize + cuBLAS."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kvloom.kernels.options import DEFAULT_KERNELS, KernelOptions
from kvloom.kernels.pdl import gdc_launch_dependents, gdc_wait, pdl_args
from kvloom.kernels.quant.common import (_combine_split_k, _finish, _out_buffer, _rows_2d, _silu_mul_epilogue,
                                         _split_outputs)


# --------------------------------------------------------------------------------------------------
# 4-bit GEMV for one row, on the row-major layout of the weight. The K-packed kernels (int_kpacked.py) convert each
# value with an integer-to-float instruction (a quarter-rate conversion on Hopper) after a shift, a mask
# and a sign fix: about six instructions per weight, too many to stream the packed bytes at HBM's rate
# (docs/benchmarks.md). Here a value costs about four: its nibble is shifted into float32 mantissa
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
    # With MMA_LAYOUT the words are in the Gluon GEMM's layout (gluon_int4.int4_mma_pack): the same words
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


# Tiles from benchmarks/int4_gemv_sweep_gpu.py --kernel mma (docs/benchmarks.md): 64 outputs and K in four up to
# 16 rows; 128 outputs a program beyond, and for wide weights (K whole).
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
                        out: torch.Tensor, mma_layout: bool = False,
                        options: KernelOptions = DEFAULT_KERNELS) -> torch.Tensor:
    """The row layout's weight (or with ``mma_layout`` the MMA row layout's) as a dense ``[N, K]`` matrix
    written into ``out`` (its dtype), as the reference dequantizes it: ``(q - z) * s`` in float32, rounded
    once (``options.int4_dequant_fma``: by the bit-pattern FMA, the same bits)."""
    n, kw = packed.shape
    w = out[: n * kw * 8].view(n, kw * 8)
    fma = options.int4_dequant_fma and scales.dtype in (torch.float16, torch.bfloat16)  # exact only for 16-bit scales
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


SM_PROGRAMS = 264  # about two programs an SM on an H100/H200: split-K until a layer has that many


def _gemm_tile(bm, bn, bk, split, swap, warps):
    return dict(BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, GROUP_M=8, SPLIT_K=split, SWAP=swap, num_warps=warps, num_stages=3)


# Tiles read off benchmarks/int4_gemm_sweep_gpu.py at Llama-3-8B's (and Mistral-7B's) shapes, group 128
# (docs/benchmarks.md), by weight shape: {(n, k): ((max_rows, tile or None), ...)}, the first bucket holding
# the row count wins, None where dequantize + cuBLAS was faster. Other shapes take int4_gemm_tiles' rule.
INT4_GEMM_TILES: dict = {
    (6144, 4096): ((64, _gemm_tile(64, 64, 128, 4, True, 4)), (128, _gemm_tile(64, 64, 128, 2, True, 4)),
                   (256, None)),
    (4096, 4096): ((64, _gemm_tile(64, 64, 128, 4, True, 4)), (256, None)),
    (28672, 4096): ((32, _gemm_tile(32, 64, 128, 1, True, 4)), (64, _gemm_tile(64, 128, 128, 1, False, 4)),
                    (256, _gemm_tile(128, 128, 64, 1, False, 8))),
    (4096, 14336): ((64, _gemm_tile(64, 64, 128, 4, True, 4)), (128, _gemm_tile(128, 64, 128, 4, True, 4)),
                    (256, _gemm_tile(128, 128, 64, 4, False, 8))),
}


def int4_gemm_tiles(rows: int, n: int, k: int, options: KernelOptions = DEFAULT_KERNELS) -> dict | None:
    """``int4_row_gemm``'s tiles for ``rows`` rows of an ``[n, k]`` weight, or None where dequantize +
    cuBLAS is faster: the measured table (``options.int4_gemm_tiles``, else ``INT4_GEMM_TILES``), else a rule
    read off it. Up to 64 rows, output-major 64 x 64
    tiles; more rows, 128 x 128 tiles with the weight as the MMA's second operand. Split-K until the layer
    has ``SM_PROGRAMS`` programs (each split keeping four K tiles or more); dequantize + cuBLAS beyond 128
    rows for weights neither wide (16,384 outputs) nor long (8,192 inputs), where the kernel lost."""
    table = INT4_GEMM_TILES if options.int4_gemm_tiles is None else options.int4_gemm_tiles
    for max_rows, tile in table.get((n, k), ()):
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


INT4_ROW_TILE = dict(BLOCK_N=16, BLOCK_K=1024, SPLIT_K=1, num_warps=4, num_stages=3)


def int4_row_gemv(x: torch.Tensor, packed: torch.Tensor, zeros: torch.Tensor, scales: torch.Tensor,
                  group_size: int, bias: torch.Tensor | None = None, config: dict | None = None,
                  silu_mul: bool = False, mma_layout: bool = False,
                  options: KernelOptions = DEFAULT_KERNELS) -> torch.Tensor:
    """``x [.., K] @ W.T`` of a 4-bit weight in ``int4_row_pack``'s layout (or with ``mma_layout``
    ``gluon_int4.int4_mma_pack``'s; ``zeros``/``scales`` ``[G, N]`` as ``int_matmul`` takes them), one program
    per row of x (the engine runs it at one row). With
    ``silu_mul`` (no bias, no split-K; ``packed`` a merged [gate; up]): ``silu(gate) * up`` of the output.
    ``options``: split-K's combining and PDL."""
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
    part, arrivals, out = _split_outputs(x2, m, n, m * tiles, cfg["SPLIT_K"], options.split_combine)
    _int4_row_gemv_kernel[(m, tiles, cfg["SPLIT_K"])](
        x2, packed, zeros, scales, out, m, n, k, x2.stride(0), packed.stride(0), out.stride(0), 0x000F0000,
        part, arrivals, GROUP=group_size, **cfg, **pdl_args(x2, options.pdl), SILU_MUL=silu_mul,
        SPLIT_COMBINE=arrivals is not None,
        MMA_LAYOUT=mma_layout)
    return _finish(out, x, bias)


# Row GEMV tiles: split-K for long, narrow weights (down_proj: 64 outputs a program, K in four).
INT4_ROW_LONG_K = dict(BLOCK_N=64, BLOCK_K=1024, SPLIT_K=4, num_warps=8, num_stages=2)


def int4_row_tiles(n: int, k: int) -> dict:
    """The row GEMV's tiles for an ``[n, k]`` weight."""
    return dict(INT4_ROW_LONG_K if k >= 8192 and n <= 8192 else INT4_ROW_TILE)
