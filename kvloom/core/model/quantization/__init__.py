"""Quantized weight formats: which one a checkpoint is in (its ``quantization_config``), checked against
``--quantization``, and the base of the methods that make the model's linear layers in that format.
The formats themselves are ``awq``, ``gptq``, ``fp8`` and ``mxfp4`` (gpt-oss's experts) beside this file; the built-in plugins of the
same names hand them to the engine."""

from __future__ import annotations

from typing import Any

from kvloom.core.config import ConfigError
from kvloom.core.model.quantization.base import (QuantizationMethod, check_choice, dense_bytes,  # noqa: F401
                                                 dequantized_kernel, param_bytes)

QUANTIZATIONS = ("fp8", "awq", "gptq", "mxfp4")
# quantization_config.quant_method -> the method that loads it
CHECKPOINT_METHODS = {"awq": "awq", "gptq": "gptq", "fp8": "fp8", "compressed-tensors": "fp8", "mxfp4": "mxfp4"}


def checkpoint_quantization_config(hf_config) -> dict[str, Any] | None:
    """The checkpoint's ``quantization_config`` (config.json, or quantize_config.json beside it) as a dict."""
    qc = getattr(hf_config, "quantization_config", None)
    if qc is None:
        return None
    return dict(qc) if isinstance(qc, dict) else qc.to_dict()


def resolve_quantization(forced: str | None, hf_config, dummy: bool = False) -> str | None:
    """The method that loads this checkpoint: its ``quantization_config``'s, which ``forced`` (the
    ``quantization`` option) must match; ``fp8`` also quantizes an unquantized checkpoint at load, and
    ``dummy`` weights may be made in any format. Raises ConfigError naming the key and the supported values."""
    if forced is not None and forced not in QUANTIZATIONS:
        raise ConfigError(f"quantization={forced!r} is not one of {list(QUANTIZATIONS)}")
    qc = checkpoint_quantization_config(hf_config)
    if qc is None:
        if forced in (None, "fp8") or dummy:
            return forced
        raise ConfigError(f"quantization={forced!r} needs a checkpoint quantized with {forced} (a quantization_config "
                          f"in config.json or a quantize_config.json); this checkpoint has none. Only "
                          f"quantization='fp8' quantizes an unquantized checkpoint at load")
    method = qc.get("quant_method")
    if method not in CHECKPOINT_METHODS:
        raise ConfigError(f"quantization_config.quant_method={method!r} is not supported; supported: "
                          f"{sorted(CHECKPOINT_METHODS)}")
    name = CHECKPOINT_METHODS[method]
    if forced is not None and forced != name:
        raise ConfigError(f"quantization={forced!r} does not match the checkpoint's quantization_config.quant_method="
                          f"{method!r}; use quantization={name!r} or leave quantization unset")
    return name


# What ``engine plan --quantization X`` sizes when the checkpoint itself is not quantized.
PLAN_DEFAULTS = {
    "awq": {"quant_method": "awq", "bits": 4, "group_size": 128, "zero_point": True, "version": "gemm"},
    "gptq": {"quant_method": "gptq", "bits": 4, "group_size": 128, "desc_act": False, "sym": True},
}


def make_method(name: str, hf_config, *, plan_defaults: bool = False, kernels=None) -> "QuantizationMethod":
    """The method ``name`` for this checkpoint, from its ``quantization_config`` (checked key by key).
    ``plan_defaults``: size an unquantized checkpoint as if quantized with the usual settings; ``kernels``
    (``KernelOptions``): what its CUDA kernels run with (default: the engine's defaults)."""
    qc = checkpoint_quantization_config(hf_config)
    if qc is None and plan_defaults and name in PLAN_DEFAULTS:
        qc = dict(PLAN_DEFAULTS[name])
    if name == "awq":
        from kvloom.core.model.quantization.awq import AWQMethod

        method = AWQMethod.from_config(qc or {})
    elif name == "gptq":
        from kvloom.core.model.quantization.gptq import GPTQMethod

        method = GPTQMethod.from_config(qc or {})
    elif name == "fp8":
        from kvloom.core.model.quantization.fp8 import FP8Method

        method = FP8Method.from_config(qc)
    elif name == "mxfp4":
        from kvloom.core.model.quantization.mxfp4 import MXFP4Method

        method = MXFP4Method.from_config(qc or {})
    else:
        raise ConfigError(f"quantization={name!r} is not one of {list(QUANTIZATIONS)}")
    if kernels is not None:
        method.kernels = kernels
    return method
