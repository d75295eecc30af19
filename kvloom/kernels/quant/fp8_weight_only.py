"""FP8 weight-only GEMVs for decode-sized batches (bf16/fp16 x, FP8 weight converted in registers): the
``tl.dot`` one for a few rows, and the FMA one without tensor cores for one row, with SiLU-and-mul, or
rotary and the KV-cache write of a qkv projection, in its epilogue."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kvloom.kernels.options import DEFAULT_KERNELS, KernelOptions
from kvloom.kernels.pdl import gdc_launch_dependents, gdc_wait, pdl_args
from kvloom.kernels.quant.common import (_autotuned, _cfg, _combine_split_k, _finish, _grid, _out_buffer,
                                         _row_bucket, _rows_2d, _silu_mul_epilogue, _split_outputs)
from kvloom.kernels.triton_attention import _dot_precision, _round_to_e4m3
from kvloom.kernels.triton_fused import _rotate


# --------------------------------------------------------------------------------------------------
# FP8 weight-only GEMV for decode-sized batches
# --------------------------------------------------------------------------------------------------


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


_FP8_SMALL = [_cfg(16, bn, bk, sp, w, st) for bn, bk, sp, w, st in (
    (64, 256, 1, 4, 4), (64, 256, 4, 4, 4), (32, 256, 4, 4, 4), (128, 128, 4, 4, 4), (64, 512, 2, 4, 3),
    (128, 256, 2, 8, 3), (32, 512, 2, 4, 3), (16, 256, 1, 4, 4), (64, 128, 8, 4, 4))]


_TUNED: dict[str, object] = {}


def _tuned(name: str):
    if name not in _TUNED:
        kernel, configs, prune, restore = {
            "fp8_small": (_fp8_weight_only_kernel, _FP8_SMALL, None, ("out_ptr",)),
        }[name]
        _TUNED[name] = _autotuned(kernel, configs, prune, restore)
    return _TUNED[name]


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
# GEMVs without tensor cores for a handful of rows, and the dequantize-then-cuBLAS path for big batches
# --------------------------------------------------------------------------------------------------
# ``tl.dot`` needs a 16-row tile and the dequantized weight in its operand layout (a shuffle through
# shared memory per tile); a decode row only needs each weight value once, multiplied and summed along K.
# These kernels keep the loaded tile in the layout it arrives in (128-bit loads along the contiguous dim)
# and reduce with plain FMAs. Row programs are the fastest grid axis, so the rows that share a weight
# tile run together and all but the first read it from L2. (The int4 GEMV is int4_row.py's.)


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
    # weight instead of per input; KernelOptions.fp8_gemv_x_tile). Under PDL the first
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
             bias: torch.Tensor | None = None, config: dict | None = None, silu_mul: bool = False,
             options: KernelOptions = DEFAULT_KERNELS) -> torch.Tensor:
    """``fp8_weight_only_linear`` for a few rows without tensor cores (``_fp8_gemv_kernel``). With
    ``silu_mul`` (one row, no bias; ``weight`` a merged [gate; up]): ``silu(gate) * up`` of the output.
    ``options``: its tiles, how it reads x, split-K's combining and PDL."""
    x2 = _rows_2d(x)
    m, k = x2.shape
    n = weight.shape[0]
    if silu_mul:
        if bias is not None or m != 1 or n % 2:
            raise ValueError("fp8_gemv(silu_mul=True) takes one row of x and an even weight without bias")
        n //= 2
        config = fp8_silu_mul_tiles(n, k, options)
    if config is None and x2.is_cuda and m == 1:
        config = fp8_row_tiles(n, k, options)
    if config is None and x2.is_cuda:
        out = _out_buffer(m, n, 2, x)  # the autotuned configs may split K: zeroed float32
        if "fp8_gemv" not in _TUNED:
            _TUNED["fp8_gemv"] = _autotuned(_fp8_gemv_kernel, _FP8_GEMV, None, ("out_ptr",))
        _TUNED["fp8_gemv"][lambda meta: (m, triton.cdiv(n, meta["BLOCK_N"]), meta["SPLIT_K"])](
            x2, weight, weight_scale.reshape(-1), out, m, n, k, _row_bucket(m), x2.stride(0), weight.stride(0),
            out.stride(0))  # without PDL: the autotuner's benchmark launches must not wait on each other
    else:
        cfg = dict(config or dict(BLOCK_N=16, BLOCK_K=256, SPLIT_K=1, num_warps=4))
        cfg.setdefault("X_TILE", options.fp8_gemv_x_tile)
        tiles = triton.cdiv(n, cfg["BLOCK_N"])
        part, arrivals, out = _split_outputs(x2, m, n, m * tiles, cfg["SPLIT_K"], options.split_combine)
        _fp8_gemv_kernel[(m, tiles, cfg["SPLIT_K"])](
            x2, weight, weight_scale.reshape(-1), out, m, n, k, _row_bucket(m), x2.stride(0), weight.stride(0),
            out.stride(0), part_ptr=part, arrivals_ptr=arrivals, **cfg, **pdl_args(x2, options.pdl), SILU_MUL=silu_mul,
            SPLIT_COMBINE=arrivals is not None)
    return _finish(out, x, bias)


def fp8_qkv_rope_gemv(x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor, bias: torch.Tensor | None,
                      positions: torch.Tensor, cos_sin_cache: torch.Tensor, k_cache: torch.Tensor,
                      v_cache: torch.Tensor, slot_mapping: torch.Tensor, num_q_heads: int, num_kv_heads: int,
                      k_scale: float = 1.0, v_scale: float = 1.0, config: dict | None = None,
                      options: KernelOptions = DEFAULT_KERNELS) -> torch.Tensor:
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
    cfg = dict(config or fp8_qkv_rope_tiles(n, k, options) or {})
    if (m != 1 or not cfg or cfg.get("SPLIT_K", 1) != 1 or n != (num_q_heads + 2 * num_kv_heads) * head_dim
            or head_dim % 2 or (head_dim // 2) % cfg["BLOCK_N"] or cos_sin_cache.shape[-1] != head_dim
            or k_cache.shape[2] != num_kv_heads):
        raise ValueError(f"fp8_qkv_rope_gemv takes one row, fixed tiles without split-K and a qkv weight of "
                         f"(Hq + 2 Hkv) x head_dim rows; got {m} rows, an [{n}, {k}] weight, {num_q_heads} + "
                         f"2 x {num_kv_heads} heads of {head_dim}, tiles {cfg}")
    cfg.setdefault("X_TILE", options.fp8_gemv_x_tile)
    cos_sin_cache = cos_sin_cache.contiguous()
    out = torch.empty((1, n), device=x.device, dtype=x.dtype)
    _fp8_gemv_kernel[(1, n // (2 * cfg["BLOCK_N"]), 1)](
        x2, weight, weight_scale.reshape(-1), out, m, n, k, 1, x2.stride(0), weight.stride(0), out.stride(0),
        bias, positions, cos_sin_cache, k_cache, v_cache, slot_mapping,
        cos_sin_cache.stride(0), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), k_cache.shape[1],
        num_q_heads, num_kv_heads, 1.0 / k_scale, 1.0 / v_scale,
        **cfg, **pdl_args(x2, options.pdl), ROPE=True, HEAD_DIM=head_dim, KV_FP8=k_cache.dtype == torch.float8_e4m3fn)
    return out.reshape(*x.shape[:-1], n)


# The fused qkv + rotary GEMV's K tile at least this (up to K's power of two): faster in the decode step than
# the plain qkv GEMV's 512 (docs/benchmarks.md).
FP8_QKV_ROPE_MIN_BLOCK_K = 1024


def fp8_qkv_rope_tiles(n: int, k: int, options: KernelOptions = DEFAULT_KERNELS) -> dict | None:
    """The fused qkv + rotary GEMV's tiles: the one-row tiles with a K tile of at least
    ``FP8_QKV_ROPE_MIN_BLOCK_K``, each program's rows split between the two halves of a head (so
    ``BLOCK_N`` halves), or None where there are no fixed ones."""
    tiles = fp8_row_tiles(n, k, options)
    if tiles is None or tiles.get("SPLIT_K", 1) != 1:
        return None
    block_k = max(tiles["BLOCK_K"], min(FP8_QKV_ROPE_MIN_BLOCK_K, triton.next_power_of_2(k)))
    return dict(tiles, BLOCK_N=max(tiles["BLOCK_N"] // 2, 1), BLOCK_K=block_k)


# One row of FP8 weights: fixed tiles of the FMA GEMV by weight size up to Llama-3-8B's gate_up_proj, the
# fastest of a CUDA-graph sweep and of the decode-step profile (benchmarks/gemv_sweep_gpu.py,
# benchmarks/decode_profile_gpu.py; docs/benchmarks.md); larger weights keep the autotuner.
FP8_ROW_TILES = (
    (4096 * 4096, dict(BLOCK_N=8, BLOCK_K=1024, SPLIT_K=1, num_warps=4, num_stages=2)),
    (6144 * 4096, dict(BLOCK_N=8, BLOCK_K=512, SPLIT_K=1, num_warps=4, num_stages=2)),
    (4096 * 14336, dict(BLOCK_N=8, BLOCK_K=1024, SPLIT_K=2, num_warps=4, num_stages=2)),
    (28672 * 4096, dict(BLOCK_N=8, BLOCK_K=512, SPLIT_K=1, num_warps=4, num_stages=2)),
)


def fp8_silu_mul_tiles(n: int, k: int, options: KernelOptions = DEFAULT_KERNELS) -> dict:
    """The FMA GEMV's tiles for one row of a merged [gate; up] FP8 weight of ``2 n`` rows with SiLU-and-mul
    fused: ``options.fp8_silu_mul_tiles``, else the one-row tiles of the whole weight, each program taking half
    its rows from either half."""
    if options.fp8_silu_mul_tiles is not None:
        return dict(options.fp8_silu_mul_tiles)
    tiles = fp8_row_tiles(2 * n, k, options) or dict(BLOCK_N=8, BLOCK_K=512, SPLIT_K=1, num_warps=4, num_stages=2)
    return dict(tiles, BLOCK_N=max(tiles["BLOCK_N"] // 2, 2), SPLIT_K=1, X_TILE=options.fp8_silu_mul_x_tile)


def fp8_row_tiles(n: int, k: int, options: KernelOptions = DEFAULT_KERNELS) -> dict | None:
    """The FMA GEMV's fixed tiles for one row of an ``[n, k]`` FP8 weight (``options.fp8_row_tiles``, else
    ``FP8_ROW_TILES``), or None (autotuned)."""
    table = FP8_ROW_TILES if options.fp8_row_tiles is None else options.fp8_row_tiles
    for limit, tiles in table:
        if n * k <= limit:
            return dict(tiles)
    return None
