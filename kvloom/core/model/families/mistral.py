"""Mistral: the Llama layout, with the config's sliding window on every layer where it sets one (v0.1)."""

from __future__ import annotations

from kvloom.core.model.families import register
from kvloom.core.model.families.decoder import DecoderLM


@register("MistralForCausalLM")
class MistralForCausalLM(DecoderLM):
    pass
