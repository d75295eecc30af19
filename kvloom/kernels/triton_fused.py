"""Triton kernels for the small fused ops around attention: RMSNorm (+ residual add), rotary embedding and
SiLU-and-mul.

Each reproduces the rounding of its reference in ``reference.py`` (float32 math, cast back where the
reference casts), so that CUDA results match the CPU path to the last bit or close to it. Inputs may be
strided views (e.g. q/k sliced from a fused qkv projection) as long as the last dimension is contiguous.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kvloom.kernels.pdl import gdc_launch_dependents, gdc_wait, pdl_args


def _rows(x: torch.Tensor) -> torch.Tensor:
    """``x`` as a 2-D ``[rows, last_dim]`` view (copying only if no such view exists) with a unit last stride."""
    x2 = x.reshape(-1, x.shape[-1])
    return x2 if x2.stride(-1) == 1 else x2.contiguous()


def _row_warps(block: int) -> int:
    return 4 if block <= 1024 else 8 if block <= 4096 else 16


# --------------------------------------------------------------------------------------------------
# RMSNorm
# --------------------------------------------------------------------------------------------------


@triton.jit
def _rms_norm_kernel(
    x_ptr, res_ptr, w_ptr, out_ptr, new_res_ptr,
    stride_x, stride_res, stride_out, stride_new_res,
    n_cols, eps,
    HAS_RESIDUAL: tl.constexpr, BLOCK: tl.constexpr, PDL: tl.constexpr, SCALE_IN_FLOAT32: tl.constexpr = False,
):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < n_cols
    w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)  # a weight: before the wait
    gdc_launch_dependents(PDL)  # the next kernel may start and wait
    gdc_wait(PDL)
    normed = _rms_norm_row(x_ptr, res_ptr, new_res_ptr, row, stride_x, stride_res, stride_new_res, cols, mask,
                           n_cols, eps, HAS_RESIDUAL, ROUND=not SCALE_IN_FLOAT32)
    tl.store(out_ptr + row * stride_out + cols, (w * normed).to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _rms_norm_row(x_ptr, res_ptr, new_res_ptr, row, stride_x, stride_res, stride_new_res, cols, mask, n_cols, eps,
                  HAS_RESIDUAL: tl.constexpr, ROUND: tl.constexpr = True):
    """One row's normalized values (float32) before the weight, storing ``x + residual`` first where given;
    ``row`` int64. Shared with the RMSNorm that quantizes its output (``quant.fp8_rows.rms_norm_fp8``)."""
    x = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0)
    if HAS_RESIDUAL:
        r = tl.load(res_ptr + row * stride_res + cols, mask=mask, other=0.0)
        # Round the sum to the stream dtype first, as ``x + residual`` does in the reference.
        x = (x.to(tl.float32) + r.to(tl.float32)).to(new_res_ptr.dtype.element_ty)
        tl.store(new_res_ptr + row * stride_new_res + cols, x, mask=mask)
    h = x.to(tl.float32)
    rstd = tl.rsqrt(tl.sum(h * h, 0) / n_cols + eps)
    if ROUND:  # ``weight * normed.to(x.dtype)``: the normalized value is rounded to x's dtype before scaling
        return (h * rstd).to(x.dtype).to(tl.float32)
    return h * rstd


def rms_norm(
    x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None, pdl: bool = True,
    scale_in_float32: bool = False,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """RMSNorm over the last dimension; with ``residual`` returns ``(norm(x + residual), x + residual)``.
    ``pdl``: launch with PDL where the GPU has it (kvloom/kernels/pdl.py). ``scale_in_float32``: scaled before
    the one rounding to the stream dtype (Gemma's form, float32 weight)."""
    shape = x.shape
    n_cols = shape[-1]
    x2 = _rows(x)
    stream_dtype = x.dtype if residual is None else torch.promote_types(x.dtype, residual.dtype)
    out_dtype = stream_dtype if scale_in_float32 else torch.promote_types(weight.dtype, stream_dtype)
    out = torch.empty(x2.shape, dtype=out_dtype, device=x.device)
    if residual is not None:
        res2 = _rows(residual)
        new_res = torch.empty(x2.shape, dtype=stream_dtype, device=x.device)
    else:
        res2 = new_res = x2  # unused by the kernel
    if x2.shape[0] > 0:
        block = triton.next_power_of_2(n_cols)
        _rms_norm_kernel[(x2.shape[0],)](
            x2, res2, weight.contiguous(), out, new_res,
            x2.stride(0), res2.stride(0), out.stride(0), new_res.stride(0),
            n_cols, eps,
            HAS_RESIDUAL=residual is not None, BLOCK=block, SCALE_IN_FLOAT32=scale_in_float32,
            num_warps=_row_warps(block), **pdl_args(x2, pdl),
        )
    out = out.view(shape)
    return (out, new_res.view(shape)) if residual is not None else out


# --------------------------------------------------------------------------------------------------
# Rotary embedding (neox style, in place)
# --------------------------------------------------------------------------------------------------


@triton.jit
def _rotary_cos_sin(pos_ptr, cos_sin_ptr, stride_cs, t, HALF: tl.constexpr, BLOCK_HALF: tl.constexpr):
    """Token ``t``'s ``[1, BLOCK_HALF]`` cos and sin (the cache row holds the HALF frequencies' cos, then
    their sin)."""
    pos = tl.load(pos_ptr + t).to(tl.int64)
    offs_d = tl.arange(0, BLOCK_HALF)
    d_mask = offs_d < HALF
    cos = tl.load(cos_sin_ptr + pos * stride_cs + offs_d, mask=d_mask, other=0.0)[None, :]
    sin = tl.load(cos_sin_ptr + pos * stride_cs + HALF + offs_d, mask=d_mask, other=0.0)[None, :]
    return cos, sin


@triton.jit
def _rotate(x1, x2, cos, sin):
    """The two halves of neox-style rotated heads, in float32."""
    x1 = x1.to(tl.float32)
    x2 = x2.to(tl.float32)
    return x1 * cos - x2 * sin, x2 * cos + x1 * sin


@triton.jit
def _rotate_heads(
    x_ptr, stride_t, stride_h, t, num_heads, cos, sin,
    BLOCK_H: tl.constexpr, HALF: tl.constexpr, BLOCK_HALF: tl.constexpr,
):
    offs_h = tl.arange(0, BLOCK_H)
    offs_d = tl.arange(0, BLOCK_HALF)
    ptr1 = x_ptr + t * stride_t + offs_h[:, None] * stride_h + offs_d[None, :]
    ptr2 = ptr1 + HALF
    mask = (offs_h[:, None] < num_heads) & (offs_d[None, :] < HALF)
    r1, r2 = _rotate(tl.load(ptr1, mask=mask, other=0.0), tl.load(ptr2, mask=mask, other=0.0), cos, sin)
    tl.store(ptr1, r1.to(x_ptr.dtype.element_ty), mask=mask)
    tl.store(ptr2, r2.to(x_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _rotary_kernel(
    pos_ptr, q_ptr, k_ptr, cos_sin_ptr,
    stride_qt, stride_qh, stride_kt, stride_kh, stride_cs,
    num_q_heads, num_kv_heads,
    HALF: tl.constexpr, BLOCK_HALF: tl.constexpr, BLOCK_HQ: tl.constexpr, BLOCK_HKV: tl.constexpr,
    PDL: tl.constexpr,
):
    t = tl.program_id(0).to(tl.int64)
    gdc_launch_dependents(PDL)  # the next kernel may start and wait
    gdc_wait(PDL)
    cos, sin = _rotary_cos_sin(pos_ptr, cos_sin_ptr, stride_cs, t, HALF, BLOCK_HALF)
    _rotate_heads(q_ptr, stride_qt, stride_qh, t, num_q_heads, cos, sin, BLOCK_HQ, HALF, BLOCK_HALF)
    _rotate_heads(k_ptr, stride_kt, stride_kh, t, num_kv_heads, cos, sin, BLOCK_HKV, HALF, BLOCK_HALF)


def rotary_embedding(
    positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, cos_sin_cache: torch.Tensor, pdl: bool = True
) -> tuple[torch.Tensor, torch.Tensor]:
    """Neox-style rotary embedding of ``q`` ``[T, Hq, D]`` and ``k`` ``[T, Hkv, D]``, **in place**; returns ``(q, k)``.

    ``q`` and ``k`` may be strided views (into a fused qkv buffer, say) with a contiguous last dimension.
    """
    num_tokens, num_q_heads, head_dim = q.shape
    num_kv_heads = k.shape[1]
    assert cos_sin_cache.shape[-1] == head_dim, "rotary dim must equal head_dim"
    assert head_dim % 2 == 0, "head_dim must be even"
    assert q.stride(-1) == 1 and k.stride(-1) == 1, "q/k head_dim must be contiguous"
    cos_sin_cache = cos_sin_cache.contiguous()
    if num_tokens > 0:
        _rotary_kernel[(num_tokens,)](
            positions, q, k, cos_sin_cache,
            q.stride(0), q.stride(1), k.stride(0), k.stride(1), cos_sin_cache.stride(0),
            num_q_heads, num_kv_heads,
            HALF=head_dim // 2, BLOCK_HALF=triton.next_power_of_2(head_dim // 2),
            BLOCK_HQ=triton.next_power_of_2(num_q_heads), BLOCK_HKV=triton.next_power_of_2(num_kv_heads),
            **pdl_args(q, pdl),
        )
    return q, k


# --------------------------------------------------------------------------------------------------
# SiLU and mul
# --------------------------------------------------------------------------------------------------


@triton.jit
def _silu_and_mul_kernel(x_ptr, out_ptr, stride_x, stride_out, n_cols, BLOCK: tl.constexpr, PDL: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    gdc_launch_dependents(PDL)  # the next kernel may start and wait
    gdc_wait(PDL)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < n_cols
    gate = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0)
    up = tl.load(x_ptr + row * stride_x + n_cols + cols, mask=mask, other=0.0)
    g = gate.to(tl.float32)
    # The reference rounds silu(gate) to the input dtype before the product.
    act = (g / (1.0 + tl.exp(-g))).to(gate.dtype).to(tl.float32)
    tl.store(out_ptr + row * stride_out + cols, (act * up.to(tl.float32)).to(out_ptr.dtype.element_ty), mask=mask)


def silu_and_mul(x: torch.Tensor, pdl: bool = True) -> torch.Tensor:
    """``silu(x[..., :I]) * x[..., I:]`` for ``x`` of ``[..., 2I]``."""
    n_cols = x.shape[-1] // 2
    x2 = _rows(x)
    out = torch.empty(x2.shape[0], n_cols, dtype=x.dtype, device=x.device)
    if x2.shape[0] > 0 and n_cols > 0:
        block = min(1024, triton.next_power_of_2(n_cols))
        _silu_and_mul_kernel[(x2.shape[0], triton.cdiv(n_cols, block))](
            x2, out, x2.stride(0), out.stride(0), n_cols, BLOCK=block, num_warps=4, **pdl_args(x2, pdl),
        )
    return out.view(*x.shape[:-1], n_cols)


# --------------------------------------------------------------------------------------------------
# Greedy argmax
# --------------------------------------------------------------------------------------------------


@triton.jit
def _argmax_chunks_kernel(x_ptr, max_ptr, idx_ptr, stride_x, n_cols, n_chunks, BLOCK: tl.constexpr):
    # One program per (row, chunk of BLOCK columns): the chunk's maximum and the first column holding it.
    # NaN counts as +inf (torch.argmax takes a NaN as the maximum).
    row = tl.program_id(0).to(tl.int64)
    chunk = tl.program_id(1)
    cols = chunk * BLOCK + tl.arange(0, BLOCK)
    x = tl.load(x_ptr + row * stride_x + cols, mask=cols < n_cols, other=float("-inf")).to(tl.float32)
    x = tl.where(x != x, float("inf"), x)
    best, at = tl.max(x, 0, return_indices=True, return_indices_tie_break_left=True)
    tl.store(max_ptr + row * n_chunks + chunk, best)
    tl.store(idx_ptr + row * n_chunks + chunk, chunk * BLOCK + at)


@triton.jit
def _argmax_reduce_kernel(max_ptr, idx_ptr, out_ptr, n_chunks, BLOCK: tl.constexpr):
    # One program per row: the first chunk holding the row's maximum gives its column, the first maximum.
    row = tl.program_id(0).to(tl.int64)
    c = tl.arange(0, BLOCK)
    ok = c < n_chunks
    best = tl.load(max_ptr + row * n_chunks + c, mask=ok, other=float("-inf"))
    _, at = tl.max(best, 0, return_indices=True, return_indices_tie_break_left=True)
    tl.store(out_ptr + row, tl.load(idx_ptr + row * n_chunks + at).to(tl.int64))


ARGMAX_CHUNK = 1024  # columns a first-stage program reduces: 126 programs for Llama-3's 128,256


def greedy_argmax(logits: torch.Tensor, chunk: int = ARGMAX_CHUNK) -> torch.Tensor:
    """``logits.argmax(-1)`` of ``[R, V]`` logits in two stages: the maximum of each chunk of
    ``chunk`` columns (a power of two), many programs at once, then the first chunk holding the row's maximum.
    PyTorch's one-row reduction over a large vocabulary is one slow program (docs/benchmarks.md). Ties go to
    the first column, as in torch.argmax; a NaN counts as the maximum (as +inf: a row with both NaN and +inf
    gives the first of either)."""
    x2 = _rows(logits)
    rows, n_cols = x2.shape
    n_chunks = triton.cdiv(n_cols, chunk)
    maxima = torch.empty((rows, n_chunks), device=x2.device, dtype=torch.float32)
    index = torch.empty((rows, n_chunks), device=x2.device, dtype=torch.int32)
    out = torch.empty(rows, device=x2.device, dtype=torch.int64)
    if rows == 0:
        return out.view(logits.shape[:-1])
    _argmax_chunks_kernel[(rows, n_chunks)](x2, maxima, index, x2.stride(0), n_cols, n_chunks,
                                            BLOCK=chunk, num_warps=4)
    _argmax_reduce_kernel[(rows,)](maxima, index, out, n_chunks, BLOCK=max(triton.next_power_of_2(n_chunks), 2),
                                   num_warps=1)
    return out.view(logits.shape[:-1])
