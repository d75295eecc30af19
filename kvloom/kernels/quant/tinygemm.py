"""PyTorch's int4 decode GEMM (tinygemm, ``torch._weight_int4pack_mm``) on its own copy of a 4-bit weight."""

from __future__ import annotations

import torch


# --------------------------------------------------------------------------------------------------
# PyTorch's int4 decode GEMM (tinygemm, ``torch._weight_int4pack_mm``): among the fastest at one row and slow
# beyond a few rows, so one more candidate for decode rows, in a second layout made at load.
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
