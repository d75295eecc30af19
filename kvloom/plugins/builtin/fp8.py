"""Quantization plugin ``fp8``: FP8 (e4m3) checkpoints (``fp8`` and compressed-tensors), or a dense
checkpoint quantized at load (``--quantization fp8``)."""

from __future__ import annotations

from typing import Any

from kvloom.plugins import hookimpl
from kvloom.plugins.info import PluginInfo


@hookimpl
def kvloom_plugin_info() -> PluginInfo:
    return PluginInfo(kind="quantization", description="FP8 e4m3 linear layers: fp8 and compressed-tensors "
                                                       "checkpoints, or a dense checkpoint quantized at load; "
                                                       "W8A8 on Ada/Hopper GPUs, weight-only elsewhere.")


@hookimpl
def kvloom_quantization(hf_config: Any, config: Any):
    from kvloom.core.model.quantization import make_method

    # Dummy weights of a dense config are made in the format's usual settings (to benchmark real shapes).
    return make_method("fp8", hf_config, plan_defaults=config.load_format == "dummy", kernels=config.kernels())
