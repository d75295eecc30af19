"""``engine plan``: the memory arithmetic of a deployment (weights, KV bytes per token, KV capacity and
maximum concurrency, per tensor-parallel size) from the functions the engine itself logs at start-up."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from kvloom.cli.text_table import format_table
from kvloom.core.config import ConfigError, EngineConfig
from kvloom.core.engine import capacity
from kvloom.core.model.loader import weight_bytes

GiB = capacity.GiB
CUDA_CONTEXT_GIB = 0.5  # memory a CUDA process holds outside PyTorch's allocator (context, cuBLAS workspaces)
DEFAULT_TP_SIZES = (1, 2, 4, 8)


@dataclass
class ParameterCount:
    """Parameters of the model the engine builds, split into the linear layers a quantization method
    replaces and everything else (embeddings, norms, lm_head, biases)."""

    linear_weights: int = 0
    linear_out_features: int = 0
    other: int = 0  # the MoE experts' weights included
    expert_weights: int = 0  # MoE: every expert's stacked weights and biases
    active: int | None = None  # MoE: the parameters one token uses (the top-k experts of each sparse layer)

    @property
    def total(self) -> int:
        return self.linear_weights + self.other


def count_parameters(hf_config) -> ParameterCount:
    """Build the engine's own model on the meta device (no memory) and count what it holds."""
    from kvloom.core.model.attention.base import TorchAttentionBackend
    from kvloom.core.model.loader import make_model

    model = make_model(hf_config, TorchAttentionBackend(), torch.float32)
    count = ParameterCount()
    for layer in model.linear_layers():
        if layer.prefix != "lm_head":  # the projections a quantization method replaces
            count.linear_weights += layer.input_size * layer.output_size
            count.linear_out_features += layer.output_size
    count.other = sum(p.numel() for p in model.parameters()) - count.linear_weights
    if hasattr(model, "parameter_counts"):
        from kvloom.core.model.moe import FusedMoE

        count.expert_weights = sum(p.numel() for m in model.modules() if isinstance(m, FusedMoE)
                                   for p in m.parameters())
        count.active = model.parameter_counts()[1]
    return count


def quantization_method(hf_config, quantization: str | None):
    """The method the engine would load this checkpoint with: the checkpoint's own (checked against
    ``quantization``), else ``quantization`` with its usual settings (to size a checkpoint not made yet)."""
    from kvloom.core.model.quantization import (QUANTIZATIONS, checkpoint_quantization_config, make_method,
                                                resolve_quantization)

    if checkpoint_quantization_config(hf_config) is not None:
        quantization = resolve_quantization(quantization, hf_config)
    elif quantization is not None and quantization not in QUANTIZATIONS:
        raise ConfigError(f"quantization={quantization!r} is not one of {list(QUANTIZATIONS)}")
    return None if quantization is None else make_method(quantization, hf_config, plan_defaults=True)


def activation_bytes(hf_config, config: EngineConfig, dtype: torch.dtype, max_model_len: int,
                     sample_rows: int | None = None) -> int:
    """An estimate of what the engine's start-up profile measures besides the weights: one step of
    ``max_num_batched_tokens`` (hidden states, fused qkv, attention output, gate/up and activation),
    float32 logits and probabilities for ``sample_rows`` rows (default ``max_num_seqs``; a verify step
    samples a row per draft), and the profile's own KV blocks (which the engine no longer counts: kept
    here as headroom, so the estimate errs on the safe side)."""
    n = min(config.max_num_batched_tokens, max_model_len)
    layers, kv_heads, head_dim = capacity.model_dims(hf_config)
    hidden, inter = hf_config.hidden_size, _mlp_width(hf_config)
    q = hf_config.num_attention_heads * head_dim
    per_token = (2 * hidden + 2 * q + 2 * kv_heads * head_dim + 3 * inter) * capacity.dtype_size(dtype)
    logits = 2 * min(sample_rows or config.max_num_seqs, n) * hf_config.vocab_size * 4
    profile_kv = -(-n // config.block_size) * config.block_size * capacity.kv_bytes_per_token(
        hf_config, capacity.kv_cache_dtype(config, dtype))
    return n * per_token + logits + profile_kv


def _mlp_width(hf_config) -> int:
    """The widest feed-forward intermediate one token makes: the dense MLP's, or an MoE layer's top-k experts'
    and shared expert's."""
    inter = hf_config.intermediate_size
    k = getattr(hf_config, "num_experts_per_tok", None)
    if k:
        experts = getattr(hf_config, "moe_intermediate_size", None) or inter
        inter = max(inter, k * experts + (getattr(hf_config, "shared_expert_intermediate_size", None) or 0))
    return inter


def moe_dims(hf_config) -> dict[str, Any]:
    """The MoE sizes ``engine plan`` shows (empty for a dense model)."""
    from kvloom.core.model.families import model_class

    family = model_class(hf_config)
    if not hasattr(family, "router_spec"):
        return {}
    spec = family.router_spec(hf_config)
    return dict(experts=spec.num_experts, experts_per_token=spec.top_k,
                expert_intermediate_size=family.expert_intermediate_size(hf_config),
                shared_expert_intermediate_size=family.shared_expert_size(hf_config),
                sparse_layers=sum(family.is_sparse(hf_config, i) for i in range(hf_config.num_hidden_layers)))


@dataclass
class DraftPlan:
    """The spec_decode draft model (method=draft) as the engine loads it beside the target: dense weights
    in its dtype, and its own K and V per token in blocks of the same ids as the target's."""

    model: str
    dtype: str
    weight_bytes: int
    kv_bytes_per_token: int
    activation_bytes: int  # its largest forward (the engine profiles it after the target's)


def spec_proposer(config: EngineConfig, hf_config):
    """The proposer the engine would make for ``--plugins spec_decode`` (its options checked, a draft
    model's config read and its vocabulary checked), else None."""
    from kvloom.plugins.manager import PluginManager

    plugins = PluginManager.from_config(config.replace(quantization=None))
    return plugins.make_spec_proposer(hf_config, config) if "spec_decode" in plugins.enabled else None


def draft_plan(proposer, config: EngineConfig, hf_config, dtype: torch.dtype, device: torch.device) -> DraftPlan | None:
    """The draft model's share when spec_decode runs with method=draft, else None (ngram drafts need no
    memory of their own)."""
    if getattr(proposer, "draft_model", None) is None:
        return None
    from kvloom.core.engine.core import resolve_dtype

    draft_dtype = dtype if proposer.draft_dtype == "auto" else resolve_dtype(proposer.draft_dtype, device)
    max_len = capacity.resolve_max_model_len(hf_config, config.max_model_len)
    return DraftPlan(proposer.draft_model, str(draft_dtype).removeprefix("torch."),
                     weight_bytes(proposer.hf_config, draft_dtype, None, device.type),
                     capacity.kv_bytes_per_token(proposer.hf_config, draft_dtype),
                     activation_bytes(proposer.hf_config, config, draft_dtype, max_len))


def valid_tp_sizes(hf_config, sizes) -> list[int]:
    """Sizes that split the attention heads evenly (KV heads split or replicated evenly)."""
    _, kv_heads, _ = capacity.model_dims(hf_config)
    heads = hf_config.num_attention_heads
    return [tp for tp in sizes if heads % tp == 0 and (kv_heads % tp == 0 or tp % kv_heads == 0)]


def gguf_int4_bytes(hf_config, config: EngineConfig, dtype: torch.dtype, device: torch.device, method) -> int:
    """Bytes of the 4-bit copies the engine keeps of a GGUF file's Q4_0/Q4_1/Q4_K linear layers (0: none)."""
    from kvloom.kernels.cpu_int4 import int4_held_bytes

    types = getattr(hf_config, "gguf_tensor_types", None)
    if not types or not _gguf_copies(config, dtype, device, method):
        return 0
    return int4_held_bytes(types, dtype)


def gguf_q8_output_bytes(hf_config, config: EngineConfig, dtype: torch.dtype, device: torch.device, method) -> int:
    """Bytes of the 8-bit codes the engine keeps of a GGUF file's Q8_0 output projection (0: none)."""
    from kvloom.kernels.cpu_int4_amx import q8_copy_bytes

    output = getattr(hf_config, "gguf_output_type", None)
    if output is None or output[0] != "Q8_0" or not _gguf_copies(config, dtype, device, method):
        return 0
    return q8_copy_bytes(output[1], output[2], dtype)


def _gguf_copies(config: EngineConfig, dtype: torch.dtype, device: torch.device, method) -> bool:
    from kvloom.core.model.loader import uses_gguf_int4

    return config.tensor_parallel_size == 1 and uses_gguf_int4(device, dtype, method, None, config.gguf_int4)


def rank_weight_bytes(hf_config, dtype: torch.dtype, method, device_type: str, tp: int) -> tuple[int, str | None]:
    """(bytes of weights one rank holds, None), or (0, why the engine refuses to split ``tp`` ways)."""
    from kvloom.core.model.distributed import TensorParallel, tp_refusal

    refusal = tp_refusal(hf_config, tp)
    if refusal is not None:
        return 0, refusal
    try:
        return weight_bytes(hf_config, dtype, method, device_type, TensorParallel(0, tp) if tp > 1 else None), None
    except ValueError as e:  # a quantized format whose groups do not split (ConfigError is a ValueError)
        return 0, str(e)


@dataclass
class PlanRow:
    tensor_parallel: int
    weight_bytes_per_gpu: int
    activation_bytes: int | None
    kv_budget_bytes: int | None
    kv: capacity.KVCapacity

    def to_dict(self) -> dict[str, Any]:
        d = {k: v for k, v in dataclasses.asdict(self).items() if k != "kv"}
        d.update(kv_bytes_per_token=self.kv.bytes_per_token, kv_blocks=self.kv.num_blocks,
                 kv_tokens=self.kv.num_tokens, kv_bytes=self.kv.bytes,
                 max_concurrency=round(self.kv.max_concurrency, 4), kv_cache_line=self.kv.describe())
        return d


@dataclass
class ReplicaRow:
    """``data_parallel`` replicas of one tensor-parallel group: each a whole engine with its own weights
    and KV cache, so capacity adds up and so does memory."""

    data_parallel: int
    tensor_parallel: int
    devices: int  # GPUs (TP x DP), or engine processes on the CPU
    weight_bytes: int  # all replicas together
    kv_bytes: int
    kv_tokens: int
    max_concurrency: float

    def to_dict(self) -> dict[str, Any]:
        return dict(dataclasses.asdict(self), max_concurrency=round(self.max_concurrency, 4))


def replica_rows(rows: list[PlanRow], weights: int, dp_sizes) -> list[ReplicaRow]:
    """One row per (data-parallel size, tensor-parallel row) for sizes above 1."""
    return [ReplicaRow(dp, r.tensor_parallel, dp * r.tensor_parallel, dp * weights, dp * r.kv.bytes,
                       dp * r.kv.num_tokens, dp * r.kv.max_concurrency)
            for dp in dp_sizes if dp > 1 for r in rows]


@dataclass
class Plan:
    model: str
    architecture: str
    device: str
    dtype: str
    quantization: str | None
    max_model_len: int
    block_size: int
    gpu_memory_gib: float | None
    gpu_memory_utilization: float
    parameters: ParameterCount
    weight_bytes: int
    rows: list[PlanRow]
    dims: dict[str, Any]
    notes: list[str]
    replicas: list[ReplicaRow] = dataclasses.field(default_factory=list)
    draft: DraftPlan | None = None

    def to_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        d["parameters"] = dict(d["parameters"], total=self.parameters.total)
        d["rows"] = [r.to_dict() for r in self.rows]
        d["replicas"] = [r.to_dict() for r in self.replicas]
        return d


def make_plan(config: EngineConfig, hf_config, model_name: str, *, gpu_memory_gib: float | None = None,
              quantization: str | None = None, tp_sizes=DEFAULT_TP_SIZES, dp_sizes=(1,)) -> Plan:
    from kvloom.core.engine.core import resolve_dtype

    method = quantization_method(hf_config, quantization)
    quantization = method.name if method is not None else None
    on_gpu = config.device == "cuda" or (config.device == "auto" and (gpu_memory_gib is not None
                                                                      or torch.cuda.is_available()))
    if config.device == "cpu" and gpu_memory_gib is not None:
        raise ConfigError("--gpu-memory is for GPU plans; drop it or --device cpu")
    if on_gpu and gpu_memory_gib is None:
        if not torch.cuda.is_available():
            raise ConfigError("a GPU plan needs --gpu-memory GiB (no CUDA device here to ask)")
        gpu_memory_gib = torch.cuda.mem_get_info()[1] / GiB
    device = torch.device("cuda" if on_gpu else "cpu")
    config = config.for_device(device.type)
    dtype = resolve_dtype(config.dtype, device, hf_config)
    max_len = capacity.resolve_max_model_len(hf_config, config.max_model_len)
    params = count_parameters(hf_config)
    if hasattr(method, "cpu_int4"):  # AWQ/GPTQ's 4-bit copies on the CPU follow the engine's option
        method.cpu_int4 = config.gguf_int4
    weights = weight_bytes(hf_config, dtype, method, device.type)
    layers, kv_heads, head_dim = capacity.model_dims(hf_config)
    notes = []
    if method is not None:
        held = ("dequantized at load to dense weights on the CPU" if device.type == "cpu" else
                "held in the format on the GPU")
        if device.type == "cpu" and getattr(method, "cpu_int4", False):
            method.cpu_int4 = False
            copies = weights - weight_bytes(hf_config, dtype, method, device.type)
            method.cpu_int4 = True
            if copies:
                held += (f", and its 4-bit layers also kept packed at 4 bits ({_gib(copies)}, counted in weights) "
                         "for decode steps of few rows (--no-gguf-int4: the dense copy alone)")
        notes.append(f"{method.describe().split('; kernel')[0].removeprefix('Quantization: ')}; {held}; "
                     f"embeddings, norms and lm_head in {str(dtype).removeprefix('torch.')}")
    int4 = gguf_int4_bytes(hf_config, config, dtype, device, method)
    q8 = gguf_q8_output_bytes(hf_config, config, dtype, device, method)
    if int4 or q8:
        weights += int4 + q8
        output = f", and its Q8_0 output projection at 8 bits ({_gib(q8)})" if q8 else ""
        notes.append(f"weights as the engine holds them: the GGUF file's 4-bit linear weights ({_gib(int4)}{output}; "
                     f"counted in weights) stay packed for decode steps of few rows, beside their "
                     f"{str(dtype).removeprefix('torch.')} copy for bigger steps (--no-gguf-int4: the copy alone)")
    elif getattr(hf_config, "gguf_file_bytes", None):
        notes.append(f"weights as the engine holds them: the GGUF file ({_gib(hf_config.gguf_file_bytes)} on disk) "
                     f"is dequantized to {str(dtype).removeprefix('torch.')} at load")
    proposer = spec_proposer(config, hf_config)
    draft = draft_plan(proposer, config, hf_config, dtype, device)
    draft_kv = draft.kv_bytes_per_token if draft is not None else 0
    if draft is not None:
        notes.append("spec_decode draft model: its weights are held beside the target's, and its KV cache has "
                     "the same blocks, so each block costs both models' bytes per token")
    layout = capacity.kv_layout(config, hf_config, draft_model=draft is not None)
    if layout.hybrid:
        notes.append(f"hybrid KV cache: {len(layout.groups)} layer groups of {layout.slots} layers "
                     f"({layout.describe()}); a block holds one group's layers, and sliding layers keep only the "
                     "blocks their window reads, so a block costs fewer bytes and a sequence fewer blocks")
    rows = []
    if not on_gpu:
        tp = config.tensor_parallel_size
        share, refusal = rank_weight_bytes(hf_config, dtype, method, device.type, tp)
        if refusal:
            raise ConfigError(refusal)
        share += int4 + q8
        kv = capacity.kv_capacity(config, hf_config, dtype, max_len, None, tp, draft_kv, layout)
        rows.append(PlanRow(tp, share, None, None, kv))
        if tp > 1:
            notes.append(f"tensor parallel {tp} on the CPU (gloo): weights/KV are per rank; each rank holds its "
                         "heads' share of every token")
        notes.append("CPU: the KV cache is sized by --kv-cache-memory-gib (default "
                     f"{capacity.DEFAULT_CPU_KV_GIB:g} GiB) or --num-kv-blocks, exactly as the engine sizes it; "
                     "that is address space: its pages become resident only as requests first write its blocks")
        from kvloom.kernels.cpu_linear import packing_supported

        if getattr(hf_config, "tie_word_embeddings", False) and packing_supported(dtype):
            table = hf_config.vocab_size * hf_config.hidden_size * torch.empty(0, dtype=dtype).element_size()
            notes.append(f"CPU: the tied embedding table is also held packed for oneDNN as the output projection "
                         f"(+{_gib(table)})")
    else:
        tps = valid_tp_sizes(hf_config, tp_sizes)
        if not tps:
            raise ConfigError(f"none of the tensor-parallel sizes {list(tp_sizes)} divides "
                              f"num_attention_heads={hf_config.num_attention_heads} and the {kv_heads} KV heads")
        k = 0
        if proposer is not None:  # the engine refuses spec_decode with tensor parallelism
            tps, k = [1], proposer.num_speculative_tokens
            notes.append(f"spec_decode: tensor parallel 1 only; a verify step samples up to max_num_seqs x {k + 1} "
                         "rows of logits")
        act = activation_bytes(hf_config, config, dtype, max_len, config.max_num_seqs * (k + 1))
        if draft is not None:  # the profile runs the draft's forward after the target's: the larger peak counts
            act = max(act, draft.activation_bytes)
        for tp in tps:
            share, refusal = rank_weight_bytes(hf_config, dtype, method, device.type, tp)
            if refusal:
                share = weights // tp
                notes.append(f"TP={tp}: an even split of the weights; the engine refuses this size: {refusal}")
            if draft is not None:
                share += draft.weight_bytes
            budget = int(config.gpu_memory_utilization * gpu_memory_gib * GiB) - share - act \
                - int(CUDA_CONTEXT_GIB * GiB)
            try:
                kv = capacity.kv_capacity(config, hf_config, dtype, max_len, lambda: max(0, budget), tp, draft_kv,
                                          layout)
            except ConfigError:
                kv = capacity.KVCapacity(0, config.block_size, capacity.kv_bytes_per_token(
                    hf_config, capacity.kv_cache_dtype(config, dtype), tp, layout.slots if layout.hybrid else None),
                    max_len, layout=layout if layout.hybrid else None)
            rows.append(PlanRow(tp, share, act, budget, kv))
        notes.append(f"GPU: an estimate. The engine measures weights + activations at start-up; here the "
                     f"activations are estimated and {CUDA_CONTEXT_GIB:g} GiB is set aside for the CUDA context")
        if tps != [1]:
            notes.append("tensor parallel > 1: each GPU holds its heads, its share of the MLP (of every expert, in "
                         "an MoE) and vocabulary and the replicated norms, and its heads' share of every token, so KV "
                         "tokens is the whole group's capacity (--tensor-parallel-size N runs it)")
        for r in rows:
            if r.kv.num_blocks == 0:
                notes.append(f"TP={r.tensor_parallel}: the weights and activations leave no room for a KV cache")
    dims = dict(layers=layers, hidden_size=hf_config.hidden_size, heads=hf_config.num_attention_heads,
                kv_heads=kv_heads, head_dim=head_dim, intermediate_size=hf_config.intermediate_size,
                vocab_size=hf_config.vocab_size,
                tied_embeddings=bool(getattr(hf_config, "tie_word_embeddings", False)),
                max_position_embeddings=getattr(hf_config, "max_position_embeddings", None), **moe_dims(hf_config))
    replicas = replica_rows(rows, weights, dp_sizes)
    if replicas:
        notes.append("data parallel: each replica is a whole engine (--data-parallel-size N) with its own weights "
                     "and KV cache" + (", one per GPU group" if on_gpu else ", all in this host's memory")
                     + "; the router spreads requests over them, so KV tokens and concurrency add up")
    return Plan(model_name, hf_config.architectures[0], device.type, str(dtype).removeprefix("torch."),
                quantization, max_len, config.block_size, gpu_memory_gib, config.gpu_memory_utilization,
                params, weights, rows, dims, notes, replicas, draft)


def load_plan_config(config: EngineConfig, config_json: str | None):
    """(hf_config, model name) from ``--config-json FILE`` or the engine's ``--model``."""
    from kvloom.core.model.files import resolve_model
    from kvloom.core.model.loader import is_gguf, load_hf_config

    if config_json:
        path = Path(config_json)
        if not path.is_file():
            raise FileNotFoundError(f"--config-json {config_json!r}: no such file")
        return load_hf_config(path, config.hf_overrides), path.parent.name if path.name == "config.json" else path.stem
    path = resolve_model(config.model)
    hf_config = load_hf_config(path, config.hf_overrides)
    if is_gguf(path):
        hf_config.gguf_file_bytes = path.stat().st_size
    return hf_config, config.model


def _gib(n: int | None) -> str:
    return "-" if n is None else f"{n / GiB:.2f} GiB"


def format_plan(plan: Plan) -> str:
    d = plan.dims
    first = plan.rows[0]
    kv_heads = max(1, d["kv_heads"] // first.tensor_parallel)  # per rank
    block_layers = first.kv.layout.slots if first.kv.hybrid else d["layers"]  # the layers one block spans
    size = first.kv.bytes_per_token // (2 * block_layers * kv_heads * d["head_dim"])
    lines = [
        f"Model: {plan.model} ({plan.architecture}): {d['layers']} layers, hidden {d['hidden_size']}, "
        f"{d['heads']} heads, {d['kv_heads']} KV heads x {d['head_dim']}, vocab {d['vocab_size']}"
        f"{', tied embeddings' if d['tied_embeddings'] else ''}"
        + (f"; MoE: {d['experts']} experts, top-{d['experts_per_token']}, expert intermediate "
           f"{d['expert_intermediate_size']}, on {d['sparse_layers']} layers" if "experts" in d else ""),
        f"Device: {plan.device}, dtype {plan.dtype}, block size {plan.block_size}, max_model_len {plan.max_model_len}"
        + (f", {plan.gpu_memory_gib:g} GiB x {plan.gpu_memory_utilization:g} per GPU" if plan.gpu_memory_gib else ""),
        f"Parameters: {plan.parameters.total:,} ({plan.parameters.linear_weights:,} in linear layers"
        + (f", {plan.parameters.expert_weights:,} in MoE experts; {plan.parameters.active:,} active per token)"
           if plan.parameters.active is not None else ")"),
        f"Weights: {_gib(plan.weight_bytes)}" + (f" ({plan.quantization})" if plan.quantization else ""),
        f"KV bytes per token{' per rank' if first.tensor_parallel > 1 else ''}"
        f"{' of a block (one layer group)' if first.kv.hybrid else ''}: {first.kv.bytes_per_token:,} = "
        f"2 (K, V) x {block_layers} layers x {kv_heads} KV heads x {d['head_dim']} x {size} bytes"
        + (f" ({first.kv.dtype})" if first.kv.dtype else ""),
    ]
    if plan.draft is not None:
        lines.append(f"Draft model (spec_decode): {plan.draft.model} ({plan.draft.dtype}): weights "
                     f"{_gib(plan.draft.weight_bytes)}, KV bytes per token {plan.draft.kv_bytes_per_token:,}")
    if plan.device == "cpu" and first.tensor_parallel > 1:
        lines.append(f"Weights per rank ({first.tensor_parallel} ranks): {_gib(first.weight_bytes_per_gpu)} "
                     f"({first.weight_bytes_per_gpu:,} bytes)")
    if plan.device == "cpu":
        lines.append(plan.rows[0].kv.describe())
    else:
        header = ("TP", "weights/GPU", "activations", "KV budget/GPU", "KV bytes/token/GPU", "KV tokens",
                  f"max concurrency @ {plan.max_model_len}")
        body = [(str(r.tensor_parallel), _gib(r.weight_bytes_per_gpu), _gib(r.activation_bytes),
                 _gib(r.kv_budget_bytes), f"{r.kv.bytes_per_token:,}", f"{r.kv.num_tokens:,}",
                 f"{r.kv.max_concurrency:.2f}x") for r in plan.rows]
        lines += ["", format_table(header, body), ""]
        lines += [f"TP={r.tensor_parallel}: {r.kv.describe()}" for r in plan.rows]
    if plan.replicas:
        unit = "GPUs" if plan.device != "cpu" else "engines"
        header = ("DP", "TP", unit, "weights (all)", "KV cache (all)", "KV tokens (all)",
                  f"max concurrency @ {plan.max_model_len}")
        body = [(str(r.data_parallel), str(r.tensor_parallel), str(r.devices), _gib(r.weight_bytes), _gib(r.kv_bytes),
                 f"{r.kv_tokens:,}", f"{r.max_concurrency:.2f}x") for r in plan.replicas]
        lines += ["", format_table(header, body), ""]
    lines += [f"Note: {n}" for n in plan.notes]
    return "\n".join(lines)


def run_plan(args, config: EngineConfig) -> int:
    """``engine plan``: print the plan (text or JSON); 2 and a message for a bad value."""
    import json
    import sys

    try:
        tps = [int(x) for x in args.tensor_parallel_sizes.split(",") if x.strip()]
        if not tps or min(tps) < 1:
            raise ConfigError(f"--tensor-parallel-sizes={args.tensor_parallel_sizes!r}: give sizes >= 1")
        dps = [int(x) for x in args.data_parallel_sizes.split(",") if x.strip()]
        if not dps or min(dps) < 1:
            raise ConfigError(f"--data-parallel-sizes={args.data_parallel_sizes!r}: give sizes >= 1")
        hf_config, name = load_plan_config(config, args.config_json)
        plan = make_plan(config, hf_config, name, gpu_memory_gib=args.gpu_memory, quantization=config.quantization,
                         tp_sizes=tps, dp_sizes=dps)
    except (ConfigError, ValueError, OSError) as e:
        print(f"engine plan: error: {e}", file=sys.stderr)
        return 2
    print(json.dumps(plan.to_dict(), indent=2) if args.json else format_plan(plan))
    return 0
