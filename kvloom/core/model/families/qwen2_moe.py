"""Qwen2-MoE (Qwen1.5-MoE, Qwen2-57B-A14B): q/k/v biases as the config's ``qkv_bias`` says, experts
``mlp.experts.N.{gate,up,down}_proj`` routed by ``mlp.gate`` (renormalised per ``norm_topk_prob``), a shared
expert on every sparse layer behind a sigmoid gate, dense MLPs on ``mlp_only_layers`` and off the
``decoder_sparse_step``, and Qwen2's sliding layers."""

from __future__ import annotations

from kvloom.core.model.families import register
from kvloom.core.model.families.moe_decoder import MoEDecoderLM


@register("Qwen2MoeForCausalLM")
class Qwen2MoeForCausalLM(MoEDecoderLM):
    @staticmethod
    def qkv_bias(config) -> bool:
        return bool(getattr(config, "qkv_bias", True))

    @staticmethod
    def o_proj_bias(config) -> bool:
        return False
