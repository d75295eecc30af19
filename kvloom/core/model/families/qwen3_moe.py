"""Qwen3-MoE (Qwen3-30B-A3B, Qwen3-235B-A22B and their successors): Qwen3's per-head q/k norms, experts
``mlp.experts.N.{gate,up,down}_proj`` routed by ``mlp.gate`` (renormalised per ``norm_topk_prob``), no shared
expert, dense MLPs on ``mlp_only_layers`` and off the ``decoder_sparse_step``."""

from __future__ import annotations

from kvloom.core.model.families import register
from kvloom.core.model.families.moe_decoder import MoEDecoderLM


@register("Qwen3MoeForCausalLM")
class Qwen3MoeForCausalLM(MoEDecoderLM):
    qk_norm = True
