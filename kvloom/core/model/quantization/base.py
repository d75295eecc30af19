"""The base of every weight format's method, and the helpers the formats share (sizes, config checks)."""

from __future__ import annotations

from typing import Any, Sequence

import torch

from kvloom.core.config import ConfigError
from kvloom.core.model.linear import LinearMethod, UnquantizedLinearMethod
from kvloom.kernels.options import DEFAULT_KERNELS, KernelOptions


def param_bytes(layer) -> int:
    return sum(p.numel() * p.element_size() for p in layer.parameters(recurse=False))


def dense_bytes(layer) -> int:
    size = torch.empty(0, dtype=layer.params_dtype).element_size()
    return (layer.output_size * layer.input_size + (layer.output_size if layer.bias is not None else 0)) * size


def check_choice(qc: dict, key: str, supported: Sequence, method: str, default: Any = None) -> Any:
    """``qc[key]`` if it is one of ``supported``, else a ConfigError naming the key and the supported values."""
    value = qc.get(key, default)
    if value not in supported or isinstance(value, bool) != isinstance(supported[0], bool):  # True == 1
        raise ConfigError(f"quantization_config.{key}={value!r} is not supported by {method}; supported: "
                          f"{list(supported)}")
    return value


class QuantizationMethod:
    """A weight format: makes each linear layer's ``LinearMethod`` (which declares its parameters, loads
    and repacks them, and runs the matmul). Layers named in ``modules_to_not_convert`` stay dense.
    ``kernels``: the options its CUDA kernels run with (the engine's ``kernel_options``)."""

    name = "?"
    kernels: KernelOptions = DEFAULT_KERNELS

    def __init__(self, modules_to_not_convert: Sequence[str] = ()) -> None:
        self.modules_to_not_convert = tuple(modules_to_not_convert or ())
        self.kernel = "not loaded yet"  # set by the layers once they know their device

    def linear_method(self, prefix: str, checkpoint_prefixes: Sequence[str]) -> LinearMethod:
        """The method of the layer at ``prefix``, which loads the checkpoint modules ``checkpoint_prefixes``
        (``q_proj``, ``k_proj`` and ``v_proj`` for a fused ``qkv_proj``)."""
        skipped = [p for p in checkpoint_prefixes if self._not_converted(p)]
        if skipped:
            if len(skipped) != len(checkpoint_prefixes):
                raise ConfigError(f"modules_to_not_convert leaves {skipped} dense but not the rest of "
                                  f"{list(checkpoint_prefixes)}, which kvloom runs as one fused layer {prefix!r}")
            return UnquantizedLinearMethod()
        return self.quantized_linear_method(prefix)

    def _not_converted(self, prefix: str) -> bool:
        # Substrings of the module name, as AutoAWQ and vLLM match them ("lm_head", "layers.0.mlp").
        return any(m and m in prefix for m in self.modules_to_not_convert)

    def quantized_linear_method(self, prefix: str) -> LinearMethod:
        raise NotImplementedError

    def moe_method(self, prefix: str):
        """The method of the MoE experts at ``prefix`` (``kvloom.core.model.quantization.moe_experts``)."""
        from kvloom.core.model.quantization.moe_experts import moe_method

        return moe_method(self, prefix)

    def describe(self) -> str:
        """The start-up log line: format, bits, group size and kernel."""
        raise NotImplementedError


def dequantized_kernel(device: torch.device, dtype: torch.dtype) -> str:
    return f"dequantized at load to {str(dtype).removeprefix('torch.')} ({device.type}: dense matmuls)"
