"""Plain-PyTorch references of the quantized formats: unpacking AWQ/GPTQ int32 words, dequantizing them,
and FP8 (e4m3) quantization of weights and activations. They are the CPU path (formats are dequantized
at load there) and the oracle of the Triton kernels.

Layouts (as the formats document them; each int32 word holds ``32 // bits`` values, lowest bits first):
* AWQ (AutoAWQ GEMM): ``qweight [in, out // 8]`` and ``qzeros [in // group, out // 8]`` packed along the
  outputs in AWQ's interleaved order (word nibble ``i`` holds column ``AWQ_ORDER[i]`` of its 8),
  ``scales [in // group, out]`` fp16; ``W[i, o] = (q - z) * s`` of input ``i``'s group.
* GPTQ: ``qweight [in * bits // 32, out]`` packed along the inputs, ``qzeros [groups, out * bits // 32]``
  packed along the outputs (both in plain order), ``scales [groups, out]``, ``g_idx [in]`` (each input's
  group; permuted under ``desc_act``). The v1 format stores each zero point minus one; gptq_v2 as is.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)
# The nibble holding each of a word's 8 columns: the inverse permutation of AWQ_ORDER.
AWQ_COLUMN_NIBBLE = tuple(AWQ_ORDER.index(c) for c in range(8))

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = float(torch.finfo(FP8_DTYPE).max)  # 448


def unpack_int32(packed: torch.Tensor, bits: int, dim: int, order: tuple[int, ...] | None = None) -> torch.Tensor:
    """The ``bits``-bit unsigned values of int32 words, spread along ``dim`` (``32 // bits`` per word).
    ``order[c]`` is the slot (lowest bits first) of the word's ``c``-th value; plain order by default."""
    per_word = 32 // bits
    slots = torch.tensor(order if order is not None else range(per_word), dtype=torch.int32, device=packed.device)
    shifts = slots * bits
    words = packed.to(torch.int32).unsqueeze(-1)  # [..., per_word] along a new last dim
    values = (words >> shifts) & ((1 << bits) - 1)
    values = values.movedim(-1, dim + 1 if dim >= 0 else dim)  # next to dim, then merged into it
    shape = list(packed.shape)
    shape[dim] *= per_word
    return values.reshape(shape)


def pack_int32(values: torch.Tensor, bits: int, dim: int, order: tuple[int, ...] | None = None) -> torch.Tensor:
    """The inverse of ``unpack_int32``: ``bits``-bit values (0 .. 2**bits - 1) packed into int32 words along ``dim``."""
    per_word = 32 // bits
    values = values.to(torch.int64).movedim(dim, -1)
    if values.shape[-1] % per_word:
        raise ValueError(f"{values.shape[-1]} values do not pack into words of {per_word}")
    values = values.reshape(*values.shape[:-1], -1, per_word)
    slots = torch.tensor(order if order is not None else range(per_word), dtype=torch.int64, device=values.device)
    words = (values << (slots * bits)).sum(-1)
    words = torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)  # two's complement
    return words.movedim(-1, dim).contiguous()


def dequantize_awq(qweight: torch.Tensor, qzeros: torch.Tensor, scales: torch.Tensor, group_size: int,
                   dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The ``[out, in]`` weight of an AWQ GEMM layer (computed in float32, then cast to ``dtype``)."""
    q, z = awq_codes(qweight, qzeros)
    return _dequantize(q, z, scales, group_size, None, dtype)


def awq_codes(qweight: torch.Tensor, qzeros: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """AWQ's codes ``q [in, out]`` and zero points ``z [groups, out]`` (int32, 0..15): ``W[o, i] = (q - z) * s``."""
    return unpack_int32(qweight, 4, 1, AWQ_COLUMN_NIBBLE), unpack_int32(qzeros, 4, 1, AWQ_COLUMN_NIBBLE)


def gptq_codes(qweight: torch.Tensor, qzeros: torch.Tensor, bits: int,
               v1_zero_offset: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """GPTQ's codes ``q [in, out]`` and effective zero points ``z [groups, out]`` (v1's stored ones plus one,
    without wrap-around, as GPTQ's own kernels do: a stored ``2**bits - 1`` means ``2**bits``)."""
    return unpack_int32(qweight, bits, 0), unpack_int32(qzeros, bits, 1) + int(v1_zero_offset)


def dequantize_gptq(qweight: torch.Tensor, qzeros: torch.Tensor, scales: torch.Tensor, g_idx: torch.Tensor | None,
                    bits: int, group_size: int, v1_zero_offset: bool = True,
                    dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The ``[out, in]`` weight of a GPTQ layer; ``g_idx`` None means input ``i`` is in group ``i // group_size``
    (``group_size`` -1: one group)."""
    q, z = gptq_codes(qweight, qzeros, bits, v1_zero_offset)
    return _dequantize(q, z, scales, group_size, g_idx, dtype)


def _dequantize(q, z, scales, group_size, g_idx, dtype):
    inputs = q.shape[0]
    if g_idx is None:
        g_idx = torch.arange(inputs, device=q.device) // (group_size if group_size > 0 else inputs)
    g_idx = g_idx.long()
    w = (q - z[g_idx]).float() * scales[g_idx].float()  # [in, out]
    return w.t().contiguous().to(dtype)


# --- FP8 -------------------------------------------------------------------------------------------
def fp8_quantize(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """``x / scale`` saturated to e4m3's range and rounded to FP8 (``scale`` broadcasts)."""
    return (x.float() / scale.float()).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)


class FP8Rows(NamedTuple):
    """Activations already quantized per token for a W8A8 layer, by the kernel that produced them (RMSNorm
    or SiLU-and-mul): ``data`` FP8 ``[padded, K]`` and ``scale`` float32 ``[padded, 1]``, rows past ``rows``
    zeros with scale 1 (cuBLASLt's padding); ``dtype``: the activation's own dtype, the layer's output's."""

    data: torch.Tensor
    scale: torch.Tensor
    rows: int
    dtype: torch.dtype


def num_rows(x) -> int:
    """The token rows of a layer input: a tensor's (all but its last dim) or ``FP8Rows``'."""
    return x.rows if isinstance(x, FP8Rows) else x.numel() // x.shape[-1]


def fp8_scale_per_row(x: torch.Tensor, min_scale: float = 1e-12) -> torch.Tensor:
    """One float32 scale per row (a weight's output channel, or an activation's token): ``amax / 448``."""
    return (x.float().abs().amax(dim=-1, keepdim=True) / FP8_MAX).clamp(min=min_scale)


def fp8_scale_per_tensor(x: torch.Tensor, min_scale: float = 1e-12) -> torch.Tensor:
    return (x.float().abs().amax() / FP8_MAX).clamp(min=min_scale).reshape(1)


def fp8_dequantize_blocks(weight: torch.Tensor, scale_inv: torch.Tensor, block: tuple[int, int]) -> torch.Tensor:
    """A block-quantized ``[out, in]`` FP8 weight times its ``[ceil(out/bo), ceil(in/bi)]`` scales, in float32."""
    bo, bi = block
    s = scale_inv.float().repeat_interleave(bo, 0).repeat_interleave(bi, 1)[: weight.shape[0], : weight.shape[1]]
    return weight.float() * s


def fp8_linear_reference(x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor,
                         input_scale: torch.Tensor | None, bias: torch.Tensor | None,
                         out_dtype: torch.dtype) -> torch.Tensor:
    """W8A8: activations quantized to FP8 (per token, or with the static ``input_scale``), then
    ``(xq * sx) @ (wq * sw).T`` accumulated in float32. ``weight_scale`` is ``[out, 1]`` or ``[1]``."""
    sx = fp8_scale_per_row(x) if input_scale is None else input_scale.float()
    xq = fp8_quantize(x, sx)
    out = (xq.float() * sx) @ (weight.float() * weight_scale.float().reshape(-1, 1)).t()
    if bias is not None:
        out = out + bias.float()
    return out.to(out_dtype)


# --- the one K-packed layout the GPU kernel reads -------------------------------------------------
# ``qweight [K * bits // 32, N]`` int32 packed along the inputs in plain order (GPTQ's own qweight),
# ``zeros [G, N]`` uint8 (the effective zero point), ``scales [G, N]``; input ``k`` is in group
# ``k // group_size``. AWQ checkpoints, and GPTQ ones (desc_act after sorting the inputs by group),
# are repacked into it once at load.
def int_matmul(x: torch.Tensor, qweight: torch.Tensor, zeros: torch.Tensor, scales: torch.Tensor,
               group_size: int, bits: int, bias: torch.Tensor | None = None) -> torch.Tensor:
    """The reference of ``quant.int_kpacked.int_matmul``: dequantize in float32, round to x's dtype, matmul."""
    q = unpack_int32(qweight, bits, 0)
    g = torch.arange(q.shape[0], device=q.device) // group_size
    w = ((q - zeros.long()[g]).float() * scales.float()[g]).to(x.dtype)  # [K, N]
    out = x @ w
    return out if bias is None else out + bias


def repack_awq(qweight: torch.Tensor, qzeros: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """AWQ's ``qweight [K, N // 8]``/``qzeros`` -> the K-packed ``qweight [K // 8, N]`` and uint8 zeros."""
    q, z = awq_codes(qweight, qzeros)
    return pack_int32(q, 4, 0).contiguous(), z.to(torch.uint8).contiguous()


def repack_gptq(qweight: torch.Tensor, qzeros: torch.Tensor, bits: int, v1_zero_offset: bool,
                perm: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """GPTQ -> the K-packed layout: zero points unpacked (plus GPTQ v1's one), inputs reordered by ``perm``."""
    z = unpack_int32(qzeros, bits, 1) + int(v1_zero_offset)
    if perm is not None:
        qweight = pack_int32(unpack_int32(qweight, bits, 0)[perm], bits, 0)
    return qweight.contiguous(), z.to(torch.uint8).contiguous()
