"""Quantization plugin ``awq``: AutoAWQ GEMM checkpoints (4 bits, group size 32/64/128, zero points)."""

from __future__ import annotations

from typing import Any

from kvloom.plugins import hookimpl
from kvloom.plugins.info import PluginInfo


@hookimpl
def kvloom_plugin_info() -> PluginInfo:
    return PluginInfo(kind="quantization", description="AWQ int4 checkpoints (AutoAWQ GEMM layout); picked "
                                                       "automatically from the checkpoint's quantization_config.")


@hookimpl
def kvloom_quantization(hf_config: Any, config: Any):
    from kvloom.core.model.quantization import make_method

    # Dummy weights of a dense config are made in the format's usual settings (to benchmark real shapes).
    return make_method("awq", hf_config, plan_defaults=config.load_format == "dummy", kernels=config.kernels())
