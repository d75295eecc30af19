"""The mixture-of-experts layer beside the linear layers: a router that picks each token's top-k experts,
the experts held as one stacked weight per projection (filled per expert by ``weight_loader``) and run by
``kvloom.kernels.moe.fused_experts``, and an optional shared expert behind a sigmoid gate (Qwen2-MoE).

Layout (the kernel's): ``w13_weight`` ``[E, 2*I, H]`` holds each expert's gate rows then its up rows,
``w2_weight`` ``[E, H, I]``; optional ``w13_bias`` ``[E, 2*I]`` and ``w2_bias`` ``[E, H]``. Under tensor
parallelism each rank holds its slice of every expert's intermediate dim (``I / tp``), the router whole,
and the block's output is all-reduced once (experts and shared expert together), as the dense MLP's is.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from kvloom.core.config import ConfigError
from kvloom.core.model.distributed import TensorParallel
from kvloom.kernels import moe as moe_kernels

# How router logits become (weights, expert ids).
SOFTMAX_TOPK = "softmax_topk"  # softmax over all experts in float32, then the top k (Mixtral, Qwen MoE)
TOPK_SOFTMAX = "topk_softmax"  # the top k logits, then a softmax over those k (gpt-oss)
PROJECTIONS = ("gate", "up", "down")


@dataclass(frozen=True)
class RouterSpec:
    num_experts: int
    top_k: int
    scoring: str = SOFTMAX_TOPK
    renormalize: bool = True  # SOFTMAX_TOPK only: the k weights divided by their sum (``norm_topk_prob``)
    bias: bool = False  # gpt-oss: a learned bias on the logits

    def describe(self) -> str:
        how = ("softmax over the top-k logits" if self.scoring == TOPK_SOFTMAX else
               "softmax, top-k " + ("renormalised" if self.renormalize else "not renormalised"))
        return f"{self.num_experts} experts, top-{self.top_k} ({how})"


def route(logits: torch.Tensor, spec: RouterSpec) -> tuple[torch.Tensor, torch.Tensor]:
    """``(topk_weights, topk_ids)`` ``[T, k]`` from router logits ``[T, E]``, as transformers routes."""
    if spec.scoring == TOPK_SOFTMAX:
        values, ids = torch.topk(logits, spec.top_k, dim=-1)
        return torch.softmax(values, dim=-1, dtype=values.dtype), ids
    if spec.scoring != SOFTMAX_TOPK:
        raise ValueError(f"unknown router scoring {spec.scoring!r}; supported: {SOFTMAX_TOPK}, {TOPK_SOFTMAX}")
    probs = torch.softmax(logits, dim=-1, dtype=torch.float32)
    weights, ids = torch.topk(probs, spec.top_k, dim=-1)
    if spec.renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights, ids


class Router(nn.Module):
    """The gate: ``[E, H]`` logits weight (and bias), replicated on every rank; always dense."""

    def __init__(self, hidden_size: int, spec: RouterSpec) -> None:
        super().__init__()
        self.spec = spec
        self.weight = nn.Parameter(torch.empty(spec.num_experts, hidden_size), requires_grad=False)
        self.bias = nn.Parameter(torch.empty(spec.num_experts), requires_grad=False) if spec.bias else None

    def forward(self, h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return route(F.linear(h, self.weight, self.bias), self.spec)


class UnquantizedMoEMethod:
    """Dense expert weights in the model dtype. A quantized expert format is another such method (made by the
    quantization's ``moe_method``): it declares the parameters, loads and repacks them, and runs the experts."""

    name = "dense"

    def create_weights(self, layer: "FusedMoE") -> None:
        e, i, h = layer.num_experts, layer.local_intermediate, layer.hidden_size
        layer.add_param("w13_weight", torch.empty(e, 2 * i, h, dtype=layer.params_dtype))
        layer.add_param("w2_weight", torch.empty(e, h, i, dtype=layer.params_dtype))
        if layer.has_bias:
            layer.add_param("w13_bias", torch.empty(e, 2 * i, dtype=layer.params_dtype))
            layer.add_param("w2_bias", torch.empty(e, h, dtype=layer.params_dtype))

    def apply(self, layer: "FusedMoE", x: torch.Tensor, topk_weights: torch.Tensor,
              topk_ids: torch.Tensor) -> torch.Tensor:
        return moe_kernels.fused_experts(
            x, layer.w13_weight, layer.w2_weight, topk_weights, topk_ids, activation=layer.activation,
            w13_bias=getattr(layer, "w13_bias", None), w2_bias=getattr(layer, "w2_bias", None),
            swiglu_alpha=layer.swiglu_alpha, swiglu_limit=layer.swiglu_limit)

    def process_weights_after_loading(self, layer: "FusedMoE") -> None:
        pass

    def held_bytes(self, layer: "FusedMoE", device_type: str) -> int:
        return sum(p.numel() * p.element_size() for p in layer.parameters(recurse=False))


def kernel_name(device: torch.device) -> str:
    """The experts' kernel on ``device``, for the start-up log (the kernels package names its own)."""
    return moe_kernels.kernel_name(device)


class FusedMoE(nn.Module):
    """Every expert of one layer: stacked weights and the fused kernel over a step's routed tokens.

    ``weight_loader(param, tensor, shard_id)`` takes ``shard_id = (expert, projection)``, projection one of
    ``gate``, ``up``, ``down``, and a tensor in ``[out, in]`` orientation (``[out]`` for a bias) of that
    expert; ``expert=None`` fills every expert from a stacked ``[E, out, in]`` (``[E, out]``) tensor."""

    def __init__(self, num_experts: int, hidden_size: int, intermediate_size: int, *, prefix: str,
                 activation: str = "silu", bias: bool = False, swiglu_alpha: float = 1.702,
                 swiglu_limit: float = 7.0, tp: TensorParallel | None = None, method=None,
                 params_dtype: torch.dtype | None = None) -> None:
        super().__init__()
        self.tp = tp = tp or TensorParallel()
        if intermediate_size % tp.size:
            raise ValueError(f"{prefix}: expert intermediate size {intermediate_size} does not split into "
                             f"tensor_parallel_size={tp.size} parts")
        self.prefix = prefix
        self.num_experts, self.hidden_size, self.intermediate_size = num_experts, hidden_size, intermediate_size
        self.local_intermediate = intermediate_size // tp.size
        self.activation = moe_kernels.MoEActivation(activation).value
        self.has_bias = bias
        self.swiglu_alpha, self.swiglu_limit = swiglu_alpha, swiglu_limit
        self.params_dtype = params_dtype or torch.get_default_dtype()
        self.method = method or UnquantizedMoEMethod()
        self.method.create_weights(self)

    def add_param(self, name: str, data: torch.Tensor) -> nn.Parameter:
        param = nn.Parameter(data, requires_grad=False)
        param.weight_loader = self.weight_loader
        self.register_parameter(name, param)
        return param

    def required_shards(self, leaf: str) -> list[tuple[int, str]]:
        """Every (expert, projection) a complete checkpoint sets for parameter ``leaf``."""
        projections = ("gate", "up") if leaf.startswith("w13") else ("down",)
        return [(e, p) for e in range(self.num_experts) for p in projections]

    def _name_of(self, param: nn.Parameter) -> str:
        return next((f"{self.prefix}.{n}" for n, p in self._parameters.items() if p is param), self.prefix)

    @torch.no_grad()
    def weight_loader(self, param: nn.Parameter, tensor: torch.Tensor, shard_id) -> None:
        expert, projection = shard_id
        if projection not in PROJECTIONS:
            raise ValueError(f"{self._name_of(param)}: no projection {projection!r}; supported: {PROJECTIONS}")
        dst = param.data if expert is None else param.data[expert]
        is_bias = param.dim() == 2  # [E, out]: a bias; weights are [E, out, in]
        n, rank = self.local_intermediate, self.tp.rank
        if projection == "down" and is_bias:
            src = tensor if rank == 0 else torch.zeros_like(tensor)  # the all-reduce sums ranks: added once
        elif projection == "down":  # [.., H, I]: this rank's inputs
            src = self._narrow(param, tensor, tensor.dim() - 1, shard_id)
        else:  # gate or up: this rank's outputs, into the gate half or the up half
            dim = dst.dim() - (1 if is_bias else 2)
            src = self._narrow(param, tensor, dim, shard_id)
            dst = dst.narrow(dim, 0 if projection == "gate" else n, n)
        if tuple(src.shape) != tuple(dst.shape):
            raise ValueError(f"{self._name_of(param)} shard {shard_id!r}: checkpoint shape {tuple(tensor.shape)} "
                             f"does not fit model shape {tuple(dst.shape)} (tensor_parallel_size={self.tp.size})")
        dst.copy_(src)

    def _narrow(self, param: nn.Parameter, tensor: torch.Tensor, dim: int, shard_id) -> torch.Tensor:
        if dim < 0 or dim >= tensor.dim() or tensor.shape[dim] != self.intermediate_size:
            raise ValueError(f"{self._name_of(param)} shard {shard_id!r}: checkpoint shape {tuple(tensor.shape)} has "
                             f"no intermediate dim of {self.intermediate_size} where expected (dim {dim})")
        n = self.local_intermediate
        return tensor.narrow(dim, self.tp.rank * n, n)

    def process_weights_after_loading(self) -> None:
        self.method.process_weights_after_loading(self)

    @property
    def device(self) -> torch.device:
        """Where the experts are (a quantized format's packed tensors are buffers once loaded on CUDA)."""
        return next(t for t in (*self.parameters(recurse=False), *self.buffers(recurse=False))).device

    def forward(self, x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor) -> torch.Tensor:
        """This rank's partial sum of the experts' output (the caller all-reduces)."""
        return self.method.apply(self, x, topk_weights, topk_ids)

    def extra_repr(self) -> str:
        return (f"experts={self.num_experts}, hidden={self.hidden_size}, intermediate={self.local_intermediate}"
                f"{'/' + str(self.intermediate_size) if self.tp.size > 1 else ''}, activation={self.activation}, "
                f"bias={self.has_bias}, method={self.method.name}")


def experts_method(quantization, prefix: str):
    """The experts' weight format: dense, or the quantization's own MoE method (``moe_method(prefix)``);
    a format without one is refused at start-up rather than leaving the experts silently dense."""
    if quantization is None:
        return UnquantizedMoEMethod()
    make = getattr(quantization, "moe_method", None)
    if make is None:
        raise ConfigError(f"quantization {getattr(quantization, 'name', quantization)!r} does not support MoE "
                          f"experts yet ({prefix}); serve an unquantized checkpoint")
    return make(prefix)


class SparseMoeBlock(nn.Module):
    """One layer's MoE in place of its MLP: ``gate`` (the router), ``experts`` and, where the family has one,
    ``shared_expert`` (a dense gated MLP) scaled by ``sigmoid(shared_expert_gate(x))``."""

    def __init__(self, hidden_size: int, router: RouterSpec, experts: FusedMoE, tp: TensorParallel,
                 shared_expert: nn.Module | None = None) -> None:
        super().__init__()
        self.tp = tp
        self.gate = Router(hidden_size, router)
        self.experts = experts
        self.shared_expert = shared_expert
        if shared_expert is not None:
            self.shared_expert_gate = nn.Linear(hidden_size, 1, bias=False).requires_grad_(False)

    def takes_fp8_rows(self, rows: int) -> bool:
        return False  # the router and the experts read the same rows in the model dtype

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        weights, ids = self.gate(h)
        out = self.experts(h, weights, ids)
        if self.shared_expert is not None:
            out = out + torch.sigmoid(self.shared_expert_gate(h)) * self.shared_expert(h)
        return self.tp.all_reduce(out)

    def parameter_counts(self) -> tuple[int, int]:
        """(parameters held, of which used by one token): the router and shared expert always, the experts
        ``top_k / num_experts`` of theirs (counted on the meta device too)."""
        total = sum(p.numel() for p in self.parameters())
        experts = sum(p.numel() for p in self.experts.parameters())
        spec = self.gate.spec
        return total, total - experts + experts * spec.top_k // spec.num_experts
