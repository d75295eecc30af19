"""Qwen2/2.5: biases on q/k/v (not on o), and with ``use_sliding_window`` a window on the layers from
``max_window_layers`` on (the config's layer types)."""

from __future__ import annotations

from kvloom.core.model.families import register
from kvloom.core.model.families.decoder import DecoderLM


@register("Qwen2ForCausalLM")
class Qwen2ForCausalLM(DecoderLM):
    @staticmethod
    def qkv_bias(config) -> bool:
        return True

    @staticmethod
    def o_proj_bias(config) -> bool:
        return False
