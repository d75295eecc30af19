"""gpt-oss (``GptOssForCausalLM``): attention with biases and a learned sink per head, a 128-token sliding
window on alternate layers (the config's layer types), yarn rope scaling, RMSNorm scaled in float32, and an
MoE block on every layer: the router ``mlp.router`` (with a bias) takes the top-k logits and a softmax over
those k; the experts' clamped SwiGLU (``gate * sigmoid(alpha * gate) * (up + 1)``) with biases, from the
checkpoint's stacked ``gate_up_proj`` ``[E, H, 2*I]`` (gate and up in alternate columns) and ``down_proj``
``[E, I, H]``."""

from __future__ import annotations

import dataclasses

import torch

from kvloom.core.model.families import register
from kvloom.core.model.families.decoder import AttentionSpec, RMSNorm
from kvloom.core.model.families.moe_decoder import MoEDecoderLM
from kvloom.core.model.moe import TOPK_SOFTMAX
from kvloom.kernels import ops


class FloatScaleRMSNorm(RMSNorm):
    """gpt-oss keeps its norms in float32: the weight scales before the one rounding to the input's dtype."""

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None, fp8: bool = False):
        return ops.rms_norm(x, self.weight, self.eps, residual, self.kernels, scale_in_float32=True)


def deinterleave_gate_up(tensor: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """gpt-oss's ``gate_up_proj`` ``[E, H, 2*I]`` (``x @ W``; gate in even columns, up in odd ones) as
    ``(gate, up)`` each ``[E, I, H]`` (``[out, in]``); its bias ``[E, 2*I]`` as two ``[E, I]``."""
    gate, up = tensor[..., 0::2], tensor[..., 1::2]
    if tensor.dim() == 3:
        gate, up = gate.transpose(1, 2), up.transpose(1, 2)
    return gate, up


@register("GptOssForCausalLM")
class GptOssForCausalLM(MoEDecoderLM):
    norm_class = FloatScaleRMSNorm
    router_scoring = TOPK_SOFTMAX
    router_bias = True
    expert_activation = "swiglu_oai"
    expert_bias = True

    @classmethod
    def attention_spec(cls, config, layer_idx: int) -> AttentionSpec:
        return dataclasses.replace(super().attention_spec(config, layer_idx), sinks=True)

    def checkpoint_name(self, name: str) -> str | None:
        return name.replace(".mlp.router.", ".mlp.gate.")

    @classmethod
    def expert_tensors(cls, rest: str, tensor: torch.Tensor, name: str):
        if rest in ("gate_up_proj", "gate_up_proj_bias"):
            leaf = "w13_bias" if rest.endswith("_bias") else "w13_weight"
            gate, up = deinterleave_gate_up(tensor)
            return [(leaf, (None, "gate"), gate), (leaf, (None, "up"), up)]
        if rest == "down_proj":
            return [("w2_weight", (None, "down"), tensor.transpose(1, 2))]
        if rest == "down_proj_bias":
            return [("w2_bias", (None, "down"), tensor)]
        if rest in ("gate_up_proj_blocks", "gate_up_proj_scales"):  # MXFP4, gate and up rows interleaved
            leaf = "w13_" + rest.rsplit("_", 1)[1]
            return [(leaf, (None, "gate"), tensor), (leaf, (None, "up"), tensor)]
        if rest in ("down_proj_blocks", "down_proj_scales"):
            return [("w2_" + rest.rsplit("_", 1)[1], (None, "down"), tensor)]
        return super().expert_tensors(rest, tensor, name)
