"""Mixtral: the Llama layout with a sparse MoE block on every layer (``block_sparse_moe``: experts
``w1``/``w3``/``w2`` and the router ``gate``), top-k of a softmax always renormalised, and the config's
sliding window on every layer where it sets one."""

from __future__ import annotations

from kvloom.core.model.families import register
from kvloom.core.model.families.moe_decoder import MoEDecoderLM


@register("MixtralForCausalLM")
class MixtralForCausalLM(MoEDecoderLM):
    @staticmethod
    def renormalize(config) -> bool:
        return True

    def checkpoint_name(self, name: str) -> str | None:
        return name.replace(".block_sparse_moe.", ".mlp.")
