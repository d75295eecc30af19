"""Quantization plugin ``gptq``: GPTQ checkpoints (4 or 8 bits, any group size incl. -1, desc_act, sym or
asym, v1 or gptq_v2 zero points)."""

from __future__ import annotations

from typing import Any

from kvloom.plugins import hookimpl
from kvloom.plugins.info import PluginInfo


@hookimpl
def kvloom_plugin_info() -> PluginInfo:
    return PluginInfo(kind="quantization", description="GPTQ int4/int8 checkpoints (desc_act, sym/asym, v1 and "
                                                       "gptq_v2); picked automatically from the checkpoint's "
                                                       "quantization_config.")


@hookimpl
def kvloom_quantization(hf_config: Any, config: Any):
    from kvloom.core.model.quantization import make_method

    # Dummy weights of a dense config are made in the format's usual settings (to benchmark real shapes).
    return make_method("gptq", hf_config, plan_defaults=config.load_format == "dummy", kernels=config.kernels())
