"""gpt-oss's MXFP4 checkpoints (``quant_method: "mxfp4"``): the MoE experts' weights in e2m1 with an e8m0
scale per 32 inputs (``*_blocks``/``*_scales``); every other layer (attention, router, embeddings) dense."""

from __future__ import annotations

from kvloom.core.config import ConfigError
from kvloom.core.model.linear import UnquantizedLinearMethod
from kvloom.core.model.quantization.base import QuantizationMethod


class MXFP4Method(QuantizationMethod):
    name = "mxfp4"
    bits = 4

    @classmethod
    def from_config(cls, qc: dict) -> "MXFP4Method":
        if qc.get("quant_method", "mxfp4") != "mxfp4":
            raise ConfigError(f"quantization_config.quant_method={qc.get('quant_method')!r} is not mxfp4")
        return cls(qc.get("modules_to_not_convert") or ())

    def linear_method(self, prefix, checkpoint_prefixes):
        return UnquantizedLinearMethod()  # only the experts are MXFP4 in these checkpoints

    def describe(self) -> str:
        return (f"Quantization: mxfp4 (gpt-oss checkpoint), 4-bit e2m1 experts with an e8m0 scale per 32 inputs, "
                f"other layers dense; kernel: {self.kernel}")
