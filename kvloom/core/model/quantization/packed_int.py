"""The one run-time layout of AWQ and GPTQ layers on the GPU: int32 words packed along the inputs,
uint8 zero points, fp16 scales, dequantized inside the Triton W4A16/W8A16 GEMM
(``kvloom.kernels.triton_quant``). On the CPU the formats are dequantized at load instead, where dense
oneDNN matmuls are faster than unpacking nibbles on every call."""

from __future__ import annotations

import torch

from kvloom.core.model.linear import LinearBase


# The start-up log's kernel: what ``kvloom.kernels.triton_quant.int_linear`` picks from by row count.
INT_KERNELS = ("W{bits}A16 on CUDA: up to 4 rows a 4-bit GEMV on a second, row-major copy of the weight (Triton; "
               "PyTorch's int4 GEMM, tinygemm, for weights of 4096 x 4096 and less), up to 63 rows a Triton "
               "tensor-core GEMM dequantizing in the kernel, dequantize + cuBLAS beyond")


def keep_packed(device: torch.device, forced: bool | None) -> bool:
    """Run packed (the in-kernel dequantizing GEMM) or dequantize at load: packed on CUDA."""
    return forced if forced is not None else device.type == "cuda"


def set_packed_weight(layer: LinearBase, qweight: torch.Tensor, zeros: torch.Tensor, scales: torch.Tensor,
                      group_size: int, bits: int, perm: torch.Tensor | None = None) -> None:
    """Replace the checkpoint's tensors by the K-packed layout; ``perm`` reorders the inputs (desc_act)."""
    for name in list(layer._parameters):
        if name != "bias":
            delattr(layer, name)
    layer.add_param("qweight", qweight, input_dim=0, output_dim=1)
    layer.add_param("zeros", zeros, input_dim=0, output_dim=1)
    layer.add_param("scales", scales.contiguous(), input_dim=0, output_dim=1)
    if perm is not None:
        layer.register_buffer("perm", perm, persistent=False)
    else:
        layer.perm = None
    layer.tinygemm = layer.int4_row = None
    if bits == 4 and qweight.is_cuda:
        from kvloom.kernels import triton_quant as tq

        k, n = qweight.shape[0] * 8, qweight.shape[1]
        layout = tq.int4_decode_layout(n, k, group_size, layer.params_dtype)
        if layout == "row":  # a second copy of the weight (half a byte per value): the 1-4 row path
            layer.register_buffer("int4_row_weight", tq.int4_row_pack(qweight), persistent=False)
            layer.int4_row = (layer.int4_row_weight, tq.int4_row_tiles(n, k))
        elif layout == "tinygemm":
            pack = tq.tinygemm_pack(qweight, zeros, scales, group_size)
            if pack is not None:  # the same, in PyTorch's int4 layout with bf16 scales and zeros
                layer.register_buffer("tinygemm_weight", pack[0], persistent=False)
                layer.register_buffer("tinygemm_scales_zeros", pack[1], persistent=False)
                layer.tinygemm = (layer.tinygemm_weight, layer.tinygemm_scales_zeros)
    layer.method = PackedIntLinearMethod(group_size, bits)


class PackedIntLinearMethod:
    """W4A16/W8A16 through ``ops.int_matmul`` (Triton on CUDA, the PyTorch reference elsewhere)."""

    def __init__(self, group_size: int, bits: int) -> None:
        self.group_size, self.bits = group_size, bits
        self.name = f"int{bits} packed"

    def create_weights(self, layer: LinearBase) -> None:
        raise RuntimeError("a packed-int layer is made from a loaded AWQ or GPTQ one")

    def process_weights_after_loading(self, layer: LinearBase) -> None:
        pass

    def apply(self, layer: LinearBase, x: torch.Tensor) -> torch.Tensor:
        from kvloom.kernels import ops

        if layer.perm is not None:
            x = x.index_select(-1, layer.perm)
        return ops.int_matmul(x, layer.qweight, layer.zeros, layer.scales, self.group_size, self.bits, layer.bias,
                              layer.tinygemm, layer.int4_row)

    def held_bytes(self, layer: LinearBase, device_type: str) -> int:
        second = list(layer.tinygemm or ()) + ([layer.int4_row[0]] if layer.int4_row else [])
        return sum(p.numel() * p.element_size() for p in [*layer.parameters(recurse=False), *second])


def tinygemm_bytes(layer: LinearBase, bits: int, group_size: int, device_type: str) -> int:
    """What the second, decode layout of a 4-bit layer adds on CUDA (``engine plan``): the row GEMV's
    half a byte a weight, or tinygemm's half a byte a weight and a bf16 scale and zero per group."""
    if bits != 4 or device_type != "cuda":
        return 0
    from kvloom.kernels.triton_quant import int4_decode_layout

    k, n = layer.input_size, layer.output_size
    layout = int4_decode_layout(n, k, group_size, layer.params_dtype)
    if layout is None:
        return 0
    return k * n // 2 + (k // group_size * n * 4 if layout == "tinygemm" else 0)
