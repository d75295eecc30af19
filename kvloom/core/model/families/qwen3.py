"""Qwen3 (dense): per-head RMSNorm of q and k before the rotary embedding, a head size that need not be
hidden / heads, and sliding layers as Qwen2 has them."""

from __future__ import annotations

from kvloom.core.model.families import register
from kvloom.core.model.families.decoder import DecoderLM


@register("Qwen3ForCausalLM")
class Qwen3ForCausalLM(DecoderLM):
    qk_norm = True
