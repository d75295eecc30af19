"""The built-in quantization plugins ``fp8``, ``awq``, ``gptq`` and ``mxfp4``: one plugin object per weight format, each
handing the engine the format's method (``kvloom.core.model.quantization.make_method``)."""

from __future__ import annotations

from typing import Any

from kvloom.plugins import hookimpl
from kvloom.plugins.info import PluginInfo


class QuantizationPlugin:
    """The quantization plugin of the built-in weight format ``name``; ``description`` is its line in
    ``engine plugins``."""

    def __init__(self, name: str, description: str) -> None:
        self.name = name
        self.description = description

    @hookimpl
    def kvloom_plugin_info(self) -> PluginInfo:
        return PluginInfo(kind="quantization", description=self.description)

    @hookimpl
    def kvloom_quantization(self, hf_config: Any, config: Any):
        from kvloom.core.model.quantization import make_method

        # Dummy weights of a dense config are made in the format's usual settings (to benchmark real shapes).
        return make_method(self.name, hf_config, plan_defaults=config.load_format == "dummy", kernels=config.kernels())

    def __repr__(self) -> str:
        return f"<quantization plugin {self.name!r}>"


# FP8 (e4m3) checkpoints (``fp8`` and compressed-tensors), or a dense checkpoint quantized at load
# (``--quantization fp8``).
fp8 = QuantizationPlugin("fp8", "FP8 e4m3 linear layers: fp8 and compressed-tensors checkpoints, or a dense "
                                "checkpoint quantized at load; W8A8 on Ada/Hopper GPUs, weight-only elsewhere.")
# AutoAWQ GEMM checkpoints (4 bits, group size 32/64/128, zero points).
awq = QuantizationPlugin("awq", "AWQ int4 checkpoints (AutoAWQ GEMM layout); picked automatically from the "
                                "checkpoint's quantization_config.")
# GPTQ checkpoints (4 or 8 bits, any group size incl. -1, desc_act, sym or asym, v1 or gptq_v2 zero points).
gptq = QuantizationPlugin("gptq", "GPTQ int4/int8 checkpoints (desc_act, sym/asym, v1 and gptq_v2); picked "
                                  "automatically from the checkpoint's quantization_config.")
# gpt-oss's MXFP4 checkpoints (the MoE experts in e2m1 with e8m0 scales; other layers dense).
mxfp4 = QuantizationPlugin("mxfp4", "gpt-oss MXFP4 checkpoints: MoE experts in 4-bit e2m1 with e8m0 scales, kept "
                                    "4-bit on the GPU, dequantized at load on the CPU.")
