"""The shared skeleton of the mixture-of-experts families: the decoder with an MoE block
(``kvloom.core.model.moe``) in place of the MLP on its sparse layers, the checkpoints' expert tensors mapped
onto the stacked expert weights, and the counts ``engine plan`` and the start-up log report."""

from __future__ import annotations

import re
from typing import Iterable

import torch

from kvloom.core.model.distributed import TensorParallel
from kvloom.core.model.families.decoder import MLP, DecoderLM
from kvloom.core.model.moe import (
    SOFTMAX_TOPK,
    FusedMoE,
    RouterSpec,
    SparseMoeBlock,
    experts_method,
    kernel_name,
)
from kvloom.kernels.options import KernelOptions

_EXPERTS = re.compile(r"^model\.layers\.(\d+)\.mlp\.experts\.(.+)$")
# One expert's projection, as Mixtral (w1/w3/w2) and Qwen (gate/up/down_proj) checkpoints name them.
# The tensor kind after it: ``weight``, or a quantized format's (``qweight``, ``weight_scale_inv``, ...).
_PER_EXPERT = re.compile(r"^(\d+)\.(w1|w2|w3|gate_proj|up_proj|down_proj)\.(\w+)$")
_PROJECTION = {"w1": "gate", "gate_proj": "gate", "w3": "up", "up_proj": "up", "w2": "down", "down_proj": "down"}


class MoEDecoderLM(DecoderLM):
    """A decoder whose sparse layers route each token to ``top_k`` of ``num_experts`` experts. A family
    states its router (scoring, renormalising, bias), the experts' activation and biases, and where its
    checkpoint's expert tensors differ from the per-expert ``[out, in]`` form (``expert_tensors``)."""

    router_scoring = SOFTMAX_TOPK
    router_bias = False
    expert_activation = "silu"
    expert_bias = False

    # --- what a family may state ---------------------------------------------------------------------
    @staticmethod
    def num_experts(config) -> int:
        return int(getattr(config, "num_local_experts", None) or config.num_experts)

    @staticmethod
    def renormalize(config) -> bool:
        return bool(getattr(config, "norm_topk_prob", True))

    @staticmethod
    def expert_intermediate_size(config) -> int:
        return int(getattr(config, "moe_intermediate_size", None) or config.intermediate_size)

    @staticmethod
    def shared_expert_size(config) -> int | None:
        return getattr(config, "shared_expert_intermediate_size", None) or None

    @classmethod
    def is_sparse(cls, config, layer_idx: int) -> bool:
        """Qwen-MoE's rule (dense MLPs on ``mlp_only_layers`` and off the ``decoder_sparse_step``); every
        layer where the config names neither."""
        step = getattr(config, "decoder_sparse_step", None) or 1
        return (layer_idx not in (getattr(config, "mlp_only_layers", None) or [])
                and cls.num_experts(config) > 0 and (layer_idx + 1) % step == 0)

    @classmethod
    def router_spec(cls, config) -> RouterSpec:
        return RouterSpec(cls.num_experts(config), int(config.num_experts_per_tok), cls.router_scoring,
                          cls.renormalize(config), cls.router_bias)

    @classmethod
    def make_mlp(cls, config, layer_idx: int, quantization, tp: TensorParallel, kernels: KernelOptions):
        if not cls.is_sparse(config, layer_idx):
            return super().make_mlp(config, layer_idx, quantization, tp, kernels)
        tp = tp or TensorParallel()
        prefix = f"model.layers.{layer_idx}.mlp"
        experts = FusedMoE(
            cls.num_experts(config), config.hidden_size, cls.expert_intermediate_size(config),
            prefix=f"{prefix}.experts", activation=cls.expert_activation, bias=cls.expert_bias,
            swiglu_alpha=float(getattr(config, "swiglu_alpha", 1.702)),
            swiglu_limit=float(getattr(config, "swiglu_limit", 7.0)), tp=tp,
            method=experts_method(quantization, f"{prefix}.experts"))
        shared_size = cls.shared_expert_size(config)
        shared = None if not shared_size else MLP(
            config, layer_idx, cls, quantization, tp, kernels, prefix=f"{prefix}.shared_expert",
            intermediate_size=shared_size, reduce=False)
        return SparseMoeBlock(config.hidden_size, cls.router_spec(config), experts, tp, shared)

    @classmethod
    def expert_tensors(cls, rest: str, tensor: torch.Tensor, name: str):
        """``(parameter, (expert, projection), tensor)`` for checkpoint tensor ``mlp.experts.<rest>``, the
        tensor in ``[out, in]`` form (``expert`` None: all experts stacked). Per-expert tensors, and the
        stacked ``gate_up_proj`` ``[E, 2*I, H]`` (gate rows then up rows) / ``down_proj`` ``[E, H, I]`` that
        transformers 5 holds in its own state dict."""
        m = _PER_EXPERT.match(rest)
        if m is not None:
            projection = _PROJECTION[m.group(2)]
            leaf = ("w2_" if projection == "down" else "w13_") + m.group(3)
            return [(leaf, (int(m.group(1)), projection), tensor)]
        if rest == "gate_up_proj":
            gate, up = tensor.chunk(2, dim=1)
            return [("w13_weight", (None, "gate"), gate), ("w13_weight", (None, "up"), up)]
        if rest == "down_proj":
            return [("w2_weight", (None, "down"), tensor)]
        raise ValueError(f"checkpoint tensor {name!r} has no matching parameter in {cls.__name__}")

    # --- the skeleton's extensions ---------------------------------------------------------------------
    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[tuple[str, object]]:
        """The experts' tensors go to their stacked parameters; every other tensor as the skeleton loads it."""
        loaded: set[tuple[str, object]] = set()

        def others():
            for name, tensor in weights:
                mapped = self.checkpoint_name(name)
                m = _EXPERTS.match(mapped) if mapped is not None else None
                if m is None:
                    yield name, tensor
                    continue
                layer = int(m.group(1))
                experts = getattr(self.layers[layer].mlp, "experts", None) if layer < len(self.layers) else None
                if not isinstance(experts, FusedMoE):
                    raise ValueError(f"checkpoint tensor {name!r}: layer {layer} of {type(self).__name__} has no "
                                     "experts (a dense MLP layer, or past the config's layers)")
                for leaf, (expert, projection), piece in self.expert_tensors(m.group(2), tensor, name):
                    if leaf in getattr(experts.method, "ignored", ()):
                        continue  # a tensor the format does not need (GPTQ's plain g_idx, static FP8 input scales)
                    param = experts._parameters.get(leaf)
                    if param is None:
                        raise ValueError(f"checkpoint tensor {name!r} has no matching parameter {leaf!r} in "
                                         f"{experts.prefix} ({experts.method.name} experts)")
                    param.weight_loader(param, piece, (expert, projection))
                    done = range(experts.num_experts) if expert is None else [expert]
                    loaded.update((f"layers.{layer}.mlp.experts.{leaf}", (e, projection)) for e in done)

        loaded |= super().load_weights(others())
        return loaded

    def required_weights(self) -> list[tuple[str, object]]:
        modules = dict(self.named_modules())
        needed = []
        for name, shard in super().required_weights():
            module_name, _, leaf = name.rpartition(".")
            module = modules.get(module_name)
            shards = module.required_shards(leaf) if isinstance(module, FusedMoE) else [shard]
            needed += [(name, s) for s in shards]
        return needed

    @torch.no_grad()
    def process_weights_after_loading(self) -> None:
        super().process_weights_after_loading()
        for module in self.modules():
            if isinstance(module, FusedMoE):
                module.process_weights_after_loading()

    def moe_blocks(self) -> list[SparseMoeBlock]:
        return [layer.mlp for layer in self.layers if isinstance(layer.mlp, SparseMoeBlock)]

    def parameter_counts(self) -> tuple[int, int]:
        """(parameters this rank holds, of which one token uses): all but the experts it is not routed to."""
        total = sum(p.numel() for p in self.parameters())
        inactive = sum(held - used for held, used in (b.parameter_counts() for b in self.moe_blocks()))
        return total, total - inactive

    def cuda_graphs_refusal(self) -> str | None:
        """Why decode steps cannot be captured in CUDA graphs (None when they can)."""
        blocks = self.moe_blocks()
        if blocks and "reference" in kernel_name(blocks[0].experts.device):
            return "the MoE experts run on the PyTorch reference, which reads each expert's row count on the host"
        return None

    def describe_moe(self) -> str:
        """The start-up log line: experts, top-k and routing, sparse layers, sizes and the kernel."""
        blocks = self.moe_blocks()
        if not blocks:
            return "MoE: no sparse layers in this config (every layer a dense MLP)"
        experts = blocks[0].experts
        size = f"expert intermediate size {experts.intermediate_size}"
        if self.tp.size > 1:
            size += f" ({experts.local_intermediate} per rank of {self.tp.size})"
        shared = blocks[0].shared_expert
        if shared is not None:
            size += f", a shared expert of {shared.down_proj.input_size * self.tp.size} behind a sigmoid gate"
        device = experts.device
        return (f"MoE: {blocks[0].gate.spec.describe()} on {len(blocks)} of {len(self.layers)} layers; {size}; "
                f"activation {experts.activation}; experts {experts.method.name}; kernel {kernel_name(device)}")
