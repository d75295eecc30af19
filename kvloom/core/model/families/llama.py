"""Llama 2/3 (with Llama-3 rope scaling) and SmolLM2: the skeleton as it is, tied or untied embeddings."""

from __future__ import annotations

from kvloom.core.model.families import register
from kvloom.core.model.families.decoder import DecoderLM


@register("LlamaForCausalLM")
class LlamaForCausalLM(DecoderLM):
    pass
