"""Phi-3 and Phi-4 (``Phi3ForCausalLM``): the Llama layout with q/k/v and gate/up fused in the checkpoint
too, longrope scaling, partial rotary where the config sets a factor (Phi-4-mini), and the config's
sliding window on every layer where it sets one (Phi-3-mini-4k)."""

from __future__ import annotations

from kvloom.core.model.families import register
from kvloom.core.model.families.decoder import DecoderLM


@register("Phi3ForCausalLM")
class Phi3ForCausalLM(DecoderLM):
    fused_in_checkpoint = frozenset({"qkv_proj", "gate_up_proj"})
