"""Mixture-of-experts kernels: ``fused_experts`` runs a step's tokens through their top-k experts.

``reference`` is the PyTorch path (the CPU path and the oracle of the Triton kernel), ``triton`` the fused
kernel on CUDA, ``weights`` the quantized expert formats (FP8, MXFP4, AWQ/GPTQ int4) either path takes.
"""

from __future__ import annotations

import torch

from kvloom.kernels.moe.reference import MoEActivation, fused_experts_reference
from kvloom.kernels.moe.weights import ExpertWeights, FP8Experts, IntExperts, MXFP4Experts
from kvloom.kernels.options import DEFAULT_KERNELS, KernelOptions

__all__ = ["ExpertWeights", "FP8Experts", "IntExperts", "MXFP4Experts", "MoEActivation", "fused_experts",
           "fused_experts_reference", "kernel_name"]


def kernel_name(device: torch.device) -> str:
    """The experts' kernel on ``device``, for the start-up log."""
    from kvloom.kernels.ops import use_triton

    if use_triton(torch.empty(0, device=device)):
        return ("Triton fused MoE (rows sorted by expert, one grouped GEMM a projection, the gated activation and "
                "top-k weights in their epilogues; quantized experts dequantized in registers)")
    return "PyTorch reference (rows sorted by expert, one matmul a projection for each expert with tokens)"


def fused_experts(x: torch.Tensor, w13: torch.Tensor | ExpertWeights, w2: torch.Tensor | ExpertWeights,
                  topk_weights: torch.Tensor, topk_ids: torch.Tensor, *, options: KernelOptions = DEFAULT_KERNELS,
                  **kwargs) -> torch.Tensor:
    """The experts' output ``[T, H]`` of ``x`` ``[T, H]`` (``reference.fused_experts_reference``'s arguments):
    the Triton kernel on CUDA tensors, the reference elsewhere, where quantized experts are dequantized first
    (on every call: a CPU layer dequantizes once at load instead)."""
    from kvloom.kernels.ops import use_triton

    if use_triton(x):
        from kvloom.kernels.moe.triton import fused_experts_triton

        return fused_experts_triton(x, w13, w2, topk_weights, topk_ids, options=options, **kwargs)
    kwargs.pop("tiles", None)  # the Triton kernel's
    w13, w2 = (w.dequantize(x.dtype) if isinstance(w, ExpertWeights) else w for w in (w13, w2))
    return fused_experts_reference(x, w13, w2, topk_weights, topk_ids, **kwargs)
