"""Which attention backend a device runs: Triton kernels on CUDA, the PyTorch path on the CPU."""

from __future__ import annotations

import torch

from kvloom.core.model.attention.base import TorchAttentionBackend
from kvloom.kernels.options import DEFAULT_KERNELS, KernelOptions


def get_attention_backend(device: torch.device, kernels: KernelOptions = DEFAULT_KERNELS):
    """Triton kernels on CUDA (launched as ``kernels`` says), the head-major CPU backend on the CPU, the
    PyTorch reference elsewhere."""
    if device.type == "cuda":
        try:
            from kvloom.core.model.attention.triton import TritonAttentionBackend
        except ImportError:  # Triton missing: the reference still runs on CUDA tensors
            return TorchAttentionBackend()
        return TritonAttentionBackend(pdl=kernels.pdl)
    if device.type == "cpu":
        from kvloom.core.model.attention.cpu import CPUAttentionBackend

        return CPUAttentionBackend()
    return TorchAttentionBackend()
