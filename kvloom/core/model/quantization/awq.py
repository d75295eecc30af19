"""AWQ checkpoints (AutoAWQ's GEMM layout, ``quant_method: "awq"``): 4-bit weights with a zero point
per group of 32, 64 or 128 inputs, ``qweight``/``qzeros`` packed in AWQ's interleaved order, fp16 scales.
Layout details: ``kvloom.kernels.quant_reference``."""

from __future__ import annotations

import torch

from kvloom.core.config import ConfigError
from kvloom.core.model.linear import LinearBase
from kvloom.core.model.quantization.base import QuantizationMethod, check_choice, dense_bytes, param_bytes
from kvloom.core.model.quantization.packed_int import (INT_KERNELS, cpu_int4_bytes, cpu_int4_refusal, keep_packed,
                                                      set_cpu_weights, set_packed_weight, tinygemm_bytes)
from kvloom.kernels.quant_reference import awq_codes, dequantize_awq, repack_awq

AWQ_GROUP_SIZES = (32, 64, 128)
PACK = 8  # 4-bit values per int32


class AWQMethod(QuantizationMethod):
    name = "awq"
    bits = 4

    def __init__(self, group_size: int, zero_point: bool = True, modules_to_not_convert=()) -> None:
        super().__init__(modules_to_not_convert)
        self.group_size, self.zero_point = group_size, zero_point
        self.keep_packed: bool | None = None  # None: packed on CUDA, dequantized at load on the CPU
        self.cpu_int4 = True  # on the CPU in bfloat16 also a 4-bit copy for decode steps (the gguf_int4 option)
        self.cpu_tally: dict = {"int4": 0, "int4_bytes": 0, "dense": {}}

    @classmethod
    def from_config(cls, qc: dict) -> "AWQMethod":
        """Checked ``quantization_config`` keys (AutoAWQ writes ``w_bit``/``q_group_size`` in quant_config.json,
        transformers ``bits``/``group_size``)."""
        check_choice(qc, "w_bit" if "w_bit" in qc else "bits", (4,), "awq", default=4)
        group_key = "q_group_size" if "q_group_size" in qc and "group_size" not in qc else "group_size"
        group = check_choice(qc, group_key, AWQ_GROUP_SIZES, "awq")
        check_choice(qc, "zero_point", (True,), "awq", default=True)
        version = str(qc.get("version", "gemm")).lower()
        if version != "gemm":
            raise ConfigError(f"quantization_config.version={qc.get('version')!r} is not supported by awq; supported: "
                              "['gemm'] (AutoAWQ's GEMM layout)")
        return cls(group, True, qc.get("modules_to_not_convert") or ())

    def quantized_linear_method(self, prefix: str) -> "AWQLinearMethod":
        return AWQLinearMethod(self)

    def describe(self) -> str:
        return (f"Quantization: awq (AutoAWQ GEMM), {self.bits} bits, group size {self.group_size}, zero point; "
                f"kernel: {self.kernel}")


class AWQLinearMethod:
    name = "awq"

    def __init__(self, method: AWQMethod) -> None:
        self.method = method

    def create_weights(self, layer: LinearBase) -> None:
        g = self.method.group_size
        if layer.input_size % g:
            raise ConfigError(f"{layer.prefix}: {layer.input_size} inputs do not split into AWQ groups of "
                              f"quantization_config.group_size={g}")
        if any(s % PACK for s in layer.output_sizes):
            raise ConfigError(f"{layer.prefix}: output sizes {layer.output_sizes} are not multiples of {PACK}, "
                              "as AWQ's packing needs")
        out, groups = layer.output_size, layer.input_size // g
        layer.add_param("qweight", torch.empty(layer.input_size, out // PACK, dtype=torch.int32), output_dim=1, input_dim=0)
        layer.add_param("qzeros", torch.empty(groups, out // PACK, dtype=torch.int32), output_dim=1, input_dim=0)
        layer.add_param("scales", torch.empty(groups, out, dtype=torch.float16), output_dim=1, input_dim=0)

    def process_weights_after_loading(self, layer: LinearBase) -> None:
        m = self.method
        if not keep_packed(layer.qweight.device, m.keep_packed):  # the CPU: dense matmuls beat unpacking
            refusal = cpu_int4_refusal(layer, m.group_size, m.cpu_int4 and m.keep_packed is None)
            codes = None
            if refusal is None:
                from kvloom.kernels.cpu_int4 import zero_point_codes

                codes = zero_point_codes(*awq_codes(layer.qweight.data, layer.qzeros.data), layer.scales.data,
                                         m.group_size)
            weight = dequantize_awq(layer.qweight.data, layer.qzeros.data, layer.scales.data, m.group_size)
            set_cpu_weights(layer, m, weight, codes, m.group_size, refusal)
            return
        qweight, zeros = repack_awq(layer.qweight.data, layer.qzeros.data)
        set_packed_weight(layer, qweight, zeros, layer.scales.data, m.group_size, 4, kernels=m.kernels)
        m.kernel = INT_KERNELS[4, layer.method.layout] + " (AWQ repacked at load)"

    def apply(self, layer: LinearBase, x: torch.Tensor) -> torch.Tensor:
        raise RuntimeError(f"{layer.prefix}: AWQ weights are used before process_weights_after_loading")

    def held_bytes(self, layer: LinearBase, device_type: str) -> int:
        if device_type == "cpu":
            g = self.method.group_size
            keeps = cpu_int4_refusal(layer, g, self.method.cpu_int4 and self.method.keep_packed is None) is None
            return dense_bytes(layer) + (cpu_int4_bytes(layer, g) if keeps else 0)
        zeros = layer.qzeros.numel() * 8  # unpacked to a uint8 each
        return (param_bytes(layer) - layer.qzeros.numel() * 4 + zeros
                + tinygemm_bytes(layer, 4, self.method.group_size, device_type, self.method.kernels))

    @torch.no_grad()
    def init_dummy(self, layer: LinearBase, gen: torch.Generator) -> None:
        """Random nibbles and zero points, scales that give weights of about N(0, 0.02)."""
        for p in (layer.qweight, layer.qzeros):
            p.copy_(torch.randint(-2**31, 2**31 - 1, p.shape, generator=gen, device=p.device, dtype=torch.int64))
        layer.scales.uniform_(0.002, 0.006, generator=gen)
