"""PyTorch reference of the fused MoE: the CPU path and the Triton kernel's oracle.

Layout (one per projection, all experts stacked): ``w13`` ``[E, 2*I, H]`` holds each expert's gate rows then
its up rows (``gate_up = x @ w13[e].T``; checkpoints that interleave gate and up are de-interleaved at load),
``w2`` ``[E, H, I]`` (``out = act @ w2[e].T``), optional biases ``w13_bias`` ``[E, 2*I]`` and ``w2_bias``
``[E, H]``. ``topk_ids`` ``[T, K]`` (int) names each token's experts and ``topk_weights`` ``[T, K]`` their
weights (already normalised or not, as the router decided); a token's output is the weighted sum.
"""

from __future__ import annotations

from enum import Enum

import torch
import torch.nn.functional as F


class MoEActivation(str, Enum):
    SILU = "silu"  # SwiGLU: silu(gate) * up (Mixtral, Qwen MoE)
    SWIGLU_OAI = "swiglu_oai"  # gpt-oss: clamped, gate * sigmoid(alpha * gate) * (up + 1)


def apply_activation(gate_up: torch.Tensor, activation: MoEActivation, alpha: float = 1.702,
                     limit: float = 7.0) -> torch.Tensor:
    """The gated activation of ``gate_up`` ``[..., 2*I]`` (gate half first) -> ``[..., I]``."""
    gate, up = gate_up.chunk(2, dim=-1)
    if activation == MoEActivation.SILU:
        return F.silu(gate) * up
    if activation == MoEActivation.SWIGLU_OAI:
        gate = gate.clamp(max=limit)
        up = up.clamp(min=-limit, max=limit)
        return gate * torch.sigmoid(gate * alpha) * (up + 1)
    raise ValueError(f"unknown MoE activation {activation!r}")


def fused_experts_reference(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor,
                            topk_ids: torch.Tensor, *, activation: MoEActivation | str = MoEActivation.SILU,
                            w13_bias: torch.Tensor | None = None, w2_bias: torch.Tensor | None = None,
                            swiglu_alpha: float = 1.702, swiglu_limit: float = 7.0) -> torch.Tensor:
    """``[T, H]`` in ``x``'s dtype. Token rows are sorted by expert once, then each expert that got
    tokens runs one matmul per projection over its rows (no loop over tokens, none over idle experts)."""
    activation = MoEActivation(activation)
    num_tokens, top_k = topk_ids.shape
    flat_ids = topk_ids.reshape(-1)
    order = torch.argsort(flat_ids, stable=True)
    counts = torch.bincount(flat_ids, minlength=w13.shape[0]).tolist()
    token_of = order // top_k
    out = torch.zeros(num_tokens * top_k, w2.shape[1], dtype=torch.float32, device=x.device)
    start = 0
    for expert, count in enumerate(counts):
        if count == 0:
            continue
        rows = order[start:start + count]
        xs = x.index_select(0, token_of[start:start + count])
        gate_up = F.linear(xs, w13[expert], None if w13_bias is None else w13_bias[expert])
        act = apply_activation(gate_up, activation, swiglu_alpha, swiglu_limit)
        out[rows] = F.linear(act, w2[expert], None if w2_bias is None else w2_bias[expert]).float()
        start += count
    weighted = out.view(num_tokens, top_k, -1) * topk_weights.float().unsqueeze(-1)
    return weighted.sum(dim=1).to(x.dtype)
