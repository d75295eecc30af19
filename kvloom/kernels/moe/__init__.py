"""Mixture-of-experts kernels: ``fused_experts`` runs a step's tokens through their top-k experts.

``reference`` is the PyTorch path (the CPU path and the oracle of the Triton kernel).
"""

from kvloom.kernels.moe.reference import MoEActivation, fused_experts_reference

__all__ = ["MoEActivation", "fused_experts", "fused_experts_reference"]


def fused_experts(x, w13, w2, topk_weights, topk_ids, **kwargs):
    """The experts' output ``[T, H]`` of ``x`` ``[T, H]``; see ``reference.fused_experts_reference``."""
    return fused_experts_reference(x, w13, w2, topk_weights, topk_ids, **kwargs)
