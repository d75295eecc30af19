"""Gemma 2: (1 + w) RMSNorm on both sides of attention and of the MLP, embeddings scaled by sqrt(hidden),
GeGLU (tanh GELU), scores scaled by ``query_pre_attn_scalar``, soft-capped attention scores and final
logits, and a sliding window on alternate layers (the config's layer types)."""

from __future__ import annotations

import dataclasses

from kvloom.core.model.families import register
from kvloom.core.model.families.decoder import AttentionSpec, DecoderLM, GemmaRMSNorm


@register("Gemma2ForCausalLM")
class Gemma2ForCausalLM(DecoderLM):
    norm_class = GemmaRMSNorm
    sandwich_norms = True
    scale_embeddings = True

    @classmethod
    def attention_spec(cls, config, layer_idx: int) -> AttentionSpec:
        spec = super().attention_spec(config, layer_idx)
        return dataclasses.replace(spec, softcap=getattr(config, "attn_logit_softcapping", None))

    @staticmethod
    def attention_scale(config, head_dim: int) -> float:
        return config.query_pre_attn_scalar**-0.5
