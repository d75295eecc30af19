"""Kernel dispatch for the model's dense ops: Triton kernels for CUDA tensors, the PyTorch references
elsewhere. Model code calls these functions only; it never picks an implementation itself.

Attention is not dispatched here: the engine picks an attention backend per device
(``kvloom.core.model.attention.selector.get_attention_backend``), which owns its KV-cache layout and kernels.
``kernels`` (``KernelOptions``, the engine's ``kernel_options``) reaches the CUDA kernels.
"""

from __future__ import annotations

import torch

from kvloom.kernels import reference as ref
from kvloom.kernels.options import DEFAULT_KERNELS, KernelOptions


def use_triton(x: torch.Tensor) -> bool:
    """Whether the Triton kernels run for ``x`` (CUDA tensors with Triton importable)."""
    return x.is_cuda and _triton_available()


_TRITON: bool | None = None


def _triton_available() -> bool:
    global _TRITON
    if _TRITON is None:
        try:
            import triton  # noqa: F401

            _TRITON = True
        except ImportError:
            _TRITON = False
    return _TRITON


# The Triton modules are imported inside the CUDA branches only, so CPU users never import triton.


def rms_norm(x, weight, eps, residual=None, kernels: KernelOptions = DEFAULT_KERNELS, scale_in_float32=False):
    """``scale_in_float32``: Gemma's form, the weight applied before the rounding to ``x``'s dtype."""
    if use_triton(x):
        from kvloom.kernels import triton_fused

        return triton_fused.rms_norm(x, weight, eps, residual, pdl=kernels.pdl, scale_in_float32=scale_in_float32)
    return ref.rms_norm(x, weight, eps, residual, scale_in_float32)


def rms_norm_fp8(x, weight, eps, residual=None, kernels: KernelOptions = DEFAULT_KERNELS):
    """``rms_norm`` quantized per row for a W8A8 layer (``quant_reference.FP8Rows``, with the new residual
    like ``rms_norm``); None where no kernel does it (not CUDA, or a row too wide)."""
    if not (use_triton(x) and x.is_cuda):
        return None
    from kvloom.kernels.quant import dispatch

    return dispatch.rms_norm_fp8(x, weight, eps, residual, options=kernels)


def rotary_embedding(positions, q, k, cos_sin_cache, kernels: KernelOptions = DEFAULT_KERNELS):
    """Returns the rotated ``(q, k)``; on CUDA they are rotated in place, so always use the returned tensors."""
    if use_triton(q):
        from kvloom.kernels import triton_fused

        return triton_fused.rotary_embedding(positions, q, k, cos_sin_cache, pdl=kernels.pdl)
    return ref.rotary_embedding(positions, q, k, cos_sin_cache)


def rotary_tables(positions, cos_sin_cache, dtype):
    """One step's rotary inputs, shared by every layer (``apply_rotary`` consumes them)."""
    if use_triton(positions):
        return positions, cos_sin_cache
    return ref.rotary_tables(positions, cos_sin_cache, dtype)


def apply_rotary(tables, q, k, kernels: KernelOptions = DEFAULT_KERNELS):
    """``rotary_embedding`` on ``rotary_tables``' output; on CUDA ``q``/``k`` are rotated in place."""
    if use_triton(q):
        from kvloom.kernels import triton_fused

        return triton_fused.rotary_embedding(tables[0], q, k, tables[1], pdl=kernels.pdl)
    return ref.apply_rotary(tables, q, k)


TRITON_ARGMAX_MIN_VOCAB = 4096  # smaller vocabularies keep PyTorch's argmax (timed only at 128,256)


def greedy_argmax(logits):
    """``logits.argmax(-1)``: on CUDA a two-stage Triton reduction (``triton_fused.greedy_argmax``); on the CPU
    float32 rows one pass each (``cpu_argmax``: 0.11 ms for 32 x 49152 on a 2-core Zen 5), else ``max``'s indices
    (0.4 ms; argmax's 1.3), the same first maximum (NaN first too)."""
    if use_triton(logits) and logits.shape[-1] >= TRITON_ARGMAX_MIN_VOCAB:
        from kvloom.kernels import triton_fused

        return triton_fused.greedy_argmax(logits)
    if logits.device.type == "cpu" and logits.dim() > 0 and logits.shape[-1] > 0:
        from kvloom.kernels import cpu_argmax

        if cpu_argmax.serves(logits):
            return cpu_argmax.argmax_rows(logits)
        return logits.max(dim=-1).indices
    return logits.argmax(dim=-1)


def silu_and_mul(x, kernels: KernelOptions = DEFAULT_KERNELS):
    if use_triton(x):
        from kvloom.kernels import triton_fused

        return triton_fused.silu_and_mul(x, pdl=kernels.pdl)
    return ref.silu_and_mul(x)


def gelu_tanh_and_mul(x):
    """GeGLU's activation (PyTorch's own kernels on every device: one elementwise op outside the hot loop)."""
    return ref.gelu_tanh_and_mul(x)


def silu_and_mul_fp8(x, kernels: KernelOptions = DEFAULT_KERNELS):
    """``silu_and_mul`` quantized per row for a W8A8 layer (``FP8Rows``); None where no kernel does it."""
    if not (use_triton(x) and x.is_cuda):
        return None
    from kvloom.kernels.quant import dispatch

    return dispatch.silu_and_mul_fp8(x, options=kernels)


def int_matmul(x, qweight, zeros, scales, group_size, bits, bias=None, tinygemm=None):
    """``x @ W.T`` of a K-packed int4/int8 weight, dequantized inside the matmul (``quant_reference``).
    ``tinygemm``: the same 4-bit weight in PyTorch's int4 layout (CUDA), one more decode path."""
    if use_triton(x):
        from kvloom.kernels.quant import dispatch

        return dispatch.int_linear(x, qweight, zeros, scales, group_size, bits, bias, tinygemm)
    from kvloom.kernels import quant_reference

    return quant_reference.int_matmul(x, qweight, zeros, scales, group_size, bits, bias)


def int4_row_matmul(x, packed, zeros, scales, group_size, bias=None, tinygemm=None, mma_layout=False,
                    kernels: KernelOptions = DEFAULT_KERNELS):
    """``x @ W.T`` of a 4-bit weight in the row layout (``quant.int4_row.int4_row_pack``), or with ``mma_layout``
    the Gluon GEMM's (``quant.gluon_int4.int4_mma_pack``, Hopper); CUDA only, other devices hold the formats
    dequantized. ``tinygemm``: PyTorch's int4 copy of it, a decode path."""
    from kvloom.kernels.quant import dispatch

    return dispatch.int4_linear(x, packed, zeros, scales, group_size, bias, tinygemm, mma_layout, options=kernels)


def lora_add(y, x, a, b, scale, slices, batch):
    """``y`` plus each token's LoRA term of its adapter slot (``kvloom.kernels.lora_reference``), in place;
    ``batch`` is the step's ``LoRABatch`` (its tokens grouped by slot)."""
    if use_triton(x):
        from kvloom.kernels import triton_lora

        buf = triton_lora.lora_shrink(x, a, batch.sorted_tokens, batch.seg_start, batch.seg_slot)
        return triton_lora.lora_expand(y, buf, b, scale, slices, batch.sorted_tokens, batch.seg_start, batch.seg_slot)
    from kvloom.kernels import lora_reference

    return lora_reference.lora_add(y, x, a, b, scale, slices, batch.groups)
