"""The shared decoder skeleton every family file builds on: embedding, pre-norm decoder layers (attention
over an ``AttentionBackend`` and a gated MLP), final norm and output projection, and the checkpoint loading.

A family subclasses ``DecoderLM`` and states only what differs: its norm (form and placement), activation,
embedding scale, attention scale, checkpoint-name mapping and, per layer, an ``AttentionSpec`` (full or
sliding window, sinks, soft-cap, rotary table, head size). Linear layers own their weights
(``kvloom.core.model.linear``): q/k/v and gate/up load into one fused matmul each, in any weight format a
quantization method makes. Under tensor parallelism (``tp``) each rank holds its heads, its share of the
MLP and of the vocabulary (column-parallel qkv/gate-up, row-parallel o/down followed by an all-reduce).
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Iterable

import torch
from torch import nn

from kvloom.core.model.attention.base import AttentionBackend, AttentionMetadata
from kvloom.core.model.distributed import TensorParallel
from kvloom.core.model.families.rope import rope_cos_sin_cache, rotary_dim
from kvloom.core.model.linear import (
    ColumnLinear,
    LinearBase,
    MergedColumnLinear,
    QKVLinear,
    ReplicatedLinear,
    RowLinear,
    UnquantizedLinearMethod,
)
from kvloom.kernels import ops
from kvloom.kernels.options import DEFAULT_KERNELS, KernelOptions
from kvloom.kernels.quant_reference import num_rows

if TYPE_CHECKING:
    from kvloom.core.model.quantization import QuantizationMethod

logger = logging.getLogger("kvloom")


def linear_method(quantization: "QuantizationMethod | None", prefix: str, checkpoint_names: list[str]):
    """The layer's weight format: the quantization method's, or dense."""
    if quantization is None:
        return UnquantizedLinearMethod()
    return quantization.linear_method(prefix, checkpoint_names)


# --- norms ----------------------------------------------------------------------------------------
class RMSNorm(nn.Module):
    """Llama's RMSNorm: normalized in float32, rounded to the input's dtype, then scaled by ``weight``."""

    def __init__(self, dim: int, eps: float, kernels: KernelOptions = DEFAULT_KERNELS) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps
        self.kernels = kernels

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None, fp8: bool = False):
        """``fp8``: the next layer takes FP8 rows (``LinearBase.takes_fp8_rows``), quantized here where a
        kernel does it."""
        out = ops.rms_norm_fp8(x, self.weight, self.eps, residual, self.kernels) if fp8 else None
        return ops.rms_norm(x, self.weight, self.eps, residual, self.kernels) if out is None else out


class GemmaRMSNorm(nn.Module):
    """Gemma's RMSNorm: the checkpoint holds ``w`` and the scale is ``1 + w``, applied in float32 before the
    one rounding to the input's dtype. ``scale`` (float32) is made once after loading."""

    def __init__(self, dim: int, eps: float, kernels: KernelOptions = DEFAULT_KERNELS) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(dim))
        self.eps = eps
        self.kernels = kernels
        self.register_buffer("scale", torch.empty(0), persistent=False)

    def process_weights_after_loading(self) -> None:
        self.scale = 1.0 + self.weight.detach().float()

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None, fp8: bool = False):
        return ops.rms_norm(x, self.scale, self.eps, residual, self.kernels, scale_in_float32=True)


# --- layers ---------------------------------------------------------------------------------------
@dataclass(frozen=True)
class AttentionSpec:
    """How one layer attends. Layers with the same ``kv_key`` keep the same KV cache (one block group)."""

    head_dim: int
    num_kv_heads: int  # the model's, before tensor parallelism splits them
    sliding_window: int | None = None  # a query at position i sees keys i - W < j <= i
    sinks: bool = False  # a learned per-head logit in the softmax denominator (``self_attn.sinks``)
    softcap: float | None = None  # scores become softcap * tanh(scores / softcap)
    rope: str | None = None  # which rotary table (a layer type of per-type rope parameters), None: the model's

    @property
    def kv_key(self) -> tuple:
        return (self.sliding_window, self.head_dim, self.num_kv_heads)


class VocabParallelEmbedding(nn.Module):
    """The embedding table, split by rows over the ranks: each looks up the ids in its share and the
    all-reduce sums the shares (every other rank contributes zeros for an id)."""

    def __init__(self, vocab_size: int, hidden_size: int, tp: TensorParallel) -> None:
        super().__init__()
        self.tp = tp
        self.rows = vocab_size // tp.size
        self.start = tp.rank * self.rows
        self.weight = nn.Parameter(torch.empty(self.rows, hidden_size), requires_grad=False)
        self.weight.weight_loader = self.weight_loader

    @torch.no_grad()
    def weight_loader(self, param: nn.Parameter, tensor: torch.Tensor, shard_id=None) -> None:
        if tensor.shape[0] != self.rows * self.tp.size or tensor.shape[1:] != param.shape[1:]:
            raise ValueError(f"embed_tokens.weight: checkpoint shape {tuple(tensor.shape)} != model shape "
                             f"({self.rows * self.tp.size}, {param.shape[1]})")
        param.copy_(tensor.narrow(0, self.start, self.rows))

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if self.tp.size == 1:
            return nn.functional.embedding(ids, self.weight)
        local = ids - self.start
        outside = (local < 0) | (local >= self.rows)
        h = nn.functional.embedding(local.masked_fill(outside, 0), self.weight)
        h = h.masked_fill(outside[:, None], 0.0)
        return self.tp.all_reduce(h)


def head_parallel_loader(tp: TensorParallel):
    """The weight loader of a per-head vector (attention sinks): this rank's heads of the checkpoint's."""

    @torch.no_grad()
    def load(param: nn.Parameter, tensor: torch.Tensor, shard_id=None) -> None:
        n = param.shape[0]
        if tuple(tensor.shape) != (n * tp.size,):
            raise ValueError(f"sinks: checkpoint shape {tuple(tensor.shape)} != model shape ({n * tp.size},)")
        param.copy_(tensor.narrow(0, tp.rank * n, n))

    return load


class Attention(nn.Module):
    def __init__(self, config, layer_idx: int, spec: AttentionSpec, family: type["DecoderLM"],
                 backend: AttentionBackend, quantization=None, tp: TensorParallel | None = None,
                 kernels: KernelOptions = DEFAULT_KERNELS) -> None:
        super().__init__()
        self.kernels = kernels
        tp = tp or TensorParallel()
        self.tp = tp
        self.spec = spec
        heads, kv_heads, self.head_dim = config.num_attention_heads, spec.num_kv_heads, spec.head_dim
        self.num_heads, self.num_kv_heads = heads // tp.size, kv_heads // tp.size  # this rank's heads
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        self.scale = family.attention_scale(config, self.head_dim)
        self.rotary_dim = rotary_dim(config, self.head_dim, spec.rope)
        prefix = f"model.layers.{layer_idx}.self_attn"
        ranks = dict(tp_rank=tp.rank, tp_size=tp.size)
        qkv_names = [f"{prefix}.{p}" for p in family.checkpoint_names("qkv_proj")]
        self.qkv_proj = QKVLinear(
            config.hidden_size, self.head_dim, heads, kv_heads, family.qkv_bias(config), prefix=f"{prefix}.qkv_proj",
            method=linear_method(quantization, f"{prefix}.qkv_proj", qkv_names), **ranks)
        self.o_proj = RowLinear(heads * self.head_dim, config.hidden_size, family.o_proj_bias(config),
                                prefix=f"{prefix}.o_proj",
                                method=linear_method(quantization, f"{prefix}.o_proj", [f"{prefix}.o_proj"]), **ranks)
        self.qk_norm = family.qk_norm
        if self.qk_norm:
            self.q_norm = family.norm_class(self.head_dim, config.rms_norm_eps, kernels)
            self.k_norm = family.norm_class(self.head_dim, config.rms_norm_eps, kernels)
        if spec.sinks:
            self.sinks = nn.Parameter(torch.empty(self.num_heads, dtype=torch.float32), requires_grad=False)
            self.sinks.weight_loader = head_parallel_loader(tp)
        else:
            self.sinks = None
        self.layer_idx = layer_idx
        self.backend = backend
        # Per-tensor scales of an fp8 KV cache (stored x / scale): 1.0, or the checkpoint's k_scale/v_scale
        # (kvloom.core.model.loader.KVCacheScales); other caches ignore them.
        self.k_scale = self.v_scale = 1.0
        # What the backend is told besides q/k/v: only what this layer uses, so backends without it still serve
        # the others.
        self.variant = {}
        if spec.sliding_window is not None:
            self.variant["window"] = spec.sliding_window
        if spec.softcap is not None:
            self.variant["softcap"] = float(spec.softcap)
        # The kernels that rotate q/k while writing the cache rotate whole heads of un-normalized q/k.
        self.fusable_rotary = not self.qk_norm and self.rotary_dim == self.head_dim

    def forward(self, rope, h, meta: AttentionMetadata, kv_cache) -> torch.Tensor:
        fp8_cache = kv_cache[0].dtype == torch.float8_e4m3fn
        qkv = None
        if (self.fusable_rotary and getattr(self.backend, "takes_written_kv", False)
                and meta.num_decodes == meta.num_seqs and isinstance(h, torch.Tensor)):
            # A decode step where the weight format rotates q/k and writes the cache in the qkv kernel.
            qkv = self.qkv_proj.forward_qkv_rope(h, rope, kv_cache, meta.slot_mapping, self.num_heads,
                                                 self.num_kv_heads, self.k_scale if fp8_cache else 1.0,
                                                 self.v_scale if fp8_cache else 1.0)
        written = qkv is not None
        if not written:
            qkv = self.qkv_proj(h)
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.reshape(-1, self.num_heads, self.head_dim)
        k = k.reshape(-1, self.num_kv_heads, self.head_dim)
        v = v.reshape(-1, self.num_kv_heads, self.head_dim)
        if self.qk_norm:
            q = self.q_norm(q)
            k = self.k_norm(k)
        fused = dict(self.variant)
        if self.sinks is not None:
            fused["sinks"] = self.sinks
        if written:  # rotated, and the cache written, by the qkv kernel
            fused["kv_written"] = True
        elif self.fusable_rotary and getattr(self.backend, "fuses_rotary", False):  # rotated where the cache is written
            fused["rope"] = rope
        elif self.rotary_dim == self.head_dim:
            q, k = ops.apply_rotary(rope, q, k, self.kernels)
        else:  # partial rotary: the leading dims rotate, the rest pass through
            d = self.rotary_dim
            q_rot, k_rot = ops.apply_rotary(rope, q[..., :d], k[..., :d], self.kernels)
            q = torch.cat([q_rot, q[..., d:]], dim=-1)
            k = torch.cat([k_rot, k[..., d:]], dim=-1)
        if fp8_cache and (self.k_scale, self.v_scale) != (1.0, 1.0):
            fused.update(k_scale=self.k_scale, v_scale=self.v_scale)
        out = self.backend.forward(q, k, v, kv_cache, meta, self.scale, **fused)
        return self.tp.all_reduce(self.o_proj(out.reshape(-1, self.q_size)))


class MLP(nn.Module):
    """The gated MLP: ``down(act(gate(x)) * up(x))`` with gate and up in one matmul. ``prefix``/``intermediate_size``
    /``reduce=False``: an MoE block's shared expert (its partial sums reduced with the experts')."""

    def __init__(self, config, layer_idx: int, family: type["DecoderLM"], quantization=None,
                 tp: TensorParallel | None = None, kernels: KernelOptions = DEFAULT_KERNELS, *,
                 prefix: str | None = None, intermediate_size: int | None = None, reduce: bool = True) -> None:
        super().__init__()
        self.kernels = kernels
        self.tp = tp = tp or TensorParallel()
        self.reduce = reduce
        prefix = prefix or f"model.layers.{layer_idx}.mlp"
        inter = intermediate_size or config.intermediate_size
        ranks = dict(tp_rank=tp.rank, tp_size=tp.size)
        gate_up_names = [f"{prefix}.{p}" for p in family.checkpoint_names("gate_up_proj")]
        self.gate_up_proj = MergedColumnLinear(
            config.hidden_size, [inter, inter], False, prefix=f"{prefix}.gate_up_proj",
            method=linear_method(quantization, f"{prefix}.gate_up_proj", gate_up_names), **ranks)
        self.down_proj = RowLinear(inter, config.hidden_size, False, prefix=f"{prefix}.down_proj",
                                   method=linear_method(quantization, f"{prefix}.down_proj", [f"{prefix}.down_proj"]),
                                   **ranks)
        self.activation = family.activation(config)

    def forward(self, h) -> torch.Tensor:
        if self.activation == "silu":
            act = self.gate_up_proj.forward_silu_and_mul(h, fp8=self.down_proj.takes_fp8_rows(num_rows(h)),
                                                         kernels=self.kernels)
        else:
            act = ops.gelu_tanh_and_mul(self.gate_up_proj(h))
        out = self.down_proj(act)
        return self.tp.all_reduce(out) if self.reduce else out

    def takes_fp8_rows(self, rows: int) -> bool:
        return self.gate_up_proj.takes_fp8_rows(rows)


ACTIVATIONS = {"silu": "silu", "swish": "silu", "gelu_pytorch_tanh": "gelu_tanh", "gelu_tanh": "gelu_tanh"}


class DecoderLayer(nn.Module):
    def __init__(self, config, layer_idx: int, spec: AttentionSpec, family: type["DecoderLM"],
                 backend: AttentionBackend, quantization=None, tp: TensorParallel | None = None,
                 kernels: KernelOptions = DEFAULT_KERNELS) -> None:
        super().__init__()
        norm, eps = family.norm_class, config.rms_norm_eps
        self.self_attn = Attention(config, layer_idx, spec, family, backend, quantization, tp, kernels)
        self.mlp = family.make_mlp(config, layer_idx, quantization, tp, kernels)
        self.input_layernorm = norm(config.hidden_size, eps, kernels)
        self.post_attention_layernorm = norm(config.hidden_size, eps, kernels)
        self.sandwich_norms = family.sandwich_norms
        if self.sandwich_norms:  # norms on both sides of the MLP too; the attention output is normed before the add
            self.pre_feedforward_layernorm = norm(config.hidden_size, eps, kernels)
            self.post_feedforward_layernorm = norm(config.hidden_size, eps, kernels)

    def forward(self, rope, h, residual, meta, kv_cache, keep=None):
        # Where the next layer runs W8A8 on these rows, the norm hands it FP8 rows (one kernel less).
        fp8 = self.self_attn.qkv_proj.takes_fp8_rows(h.shape[0])
        if residual is None:
            residual = h
            h = self.input_layernorm(h, fp8=fp8)
        else:
            h, residual = self.input_layernorm(h, residual, fp8=fp8)
        h = self.self_attn(rope, h, meta, kv_cache)
        if keep is not None:  # only these rows go on (their K/V for every row are cached by now)
            h, residual = h[keep], residual[keep]
            if h.shape[0] == 0:
                return h, residual
        fp8 = self.mlp.takes_fp8_rows(h.shape[0])
        if self.sandwich_norms:
            h = self.post_attention_layernorm(h)
            h, residual = self.pre_feedforward_layernorm(h, residual, fp8=fp8)
            return self.post_feedforward_layernorm(self.mlp(h)), residual
        h, residual = self.post_attention_layernorm(h, residual, fp8=fp8)
        return self.mlp(h), residual


# --- the model --------------------------------------------------------------------------------------
class DecoderLM(nn.Module):
    """A decoder-only causal LM over a paged KV cache. Subclasses (one per family) set what differs."""

    architectures: tuple[str, ...] = ()  # set by ``families.register``
    norm_class: type[nn.Module] = RMSNorm
    sandwich_norms = False  # Gemma 2/3: post-attention and pre/post-feedforward norms
    qk_norm = False  # per-head RMSNorm of q and k before the rotary embedding
    scale_embeddings = False  # embeddings times sqrt(hidden_size), rounded to the model dtype
    lora_context = None  # set when the engine serves LoRA adapters (kvloom.core.model.lora.LoRAPool)
    # checkpoint module name -> (fused layer name, shard id)
    stacked = {
        "q_proj": ("qkv_proj", "q"), "k_proj": ("qkv_proj", "k"), "v_proj": ("qkv_proj", "v"),
        "gate_proj": ("gate_up_proj", 0), "up_proj": ("gate_up_proj", 1),
    }
    # fused layers the checkpoint also holds fused (one tensor with every shard, split here by shard)
    fused_in_checkpoint: frozenset[str] = frozenset()

    # --- what a family may state ---------------------------------------------------------------------
    @classmethod
    def decoder_config(cls, config):
        """The config this decoder is built from (a multimodal checkpoint's text config)."""
        return config

    @classmethod
    def checkpoint_names(cls, fused: str) -> list[str]:
        """The checkpoint modules that make up fused layer ``fused`` (what a quantization config names)."""
        if fused in cls.fused_in_checkpoint:
            return [fused]
        return [name for name, (layer, _) in cls.stacked.items() if layer == fused]

    @classmethod
    def attention_spec(cls, config, layer_idx: int) -> AttentionSpec:
        """Full attention, or the config's sliding window where its layer types say so (all layers when it
        has no layer types)."""
        heads = config.num_attention_heads
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
        kv_heads = getattr(config, "num_key_value_heads", None) or heads
        return AttentionSpec(head_dim, kv_heads, sliding_window=cls.sliding_window(config, layer_idx))

    @staticmethod
    def sliding_window(config, layer_idx: int) -> int | None:
        window = getattr(config, "sliding_window", None)
        if not window:
            return None
        types = getattr(config, "layer_types", None)
        if types is not None:
            return int(window) if types[layer_idx] == "sliding_attention" else None
        return int(window)

    @staticmethod
    def attention_scale(config, head_dim: int) -> float:
        return head_dim**-0.5

    @staticmethod
    def qkv_bias(config) -> bool:
        return bool(getattr(config, "attention_bias", False))

    @staticmethod
    def o_proj_bias(config) -> bool:
        return bool(getattr(config, "attention_bias", False))

    @staticmethod
    def activation(config) -> str:
        name = getattr(config, "hidden_activation", None) or getattr(config, "hidden_act", "silu")
        if name not in ACTIVATIONS:
            raise ValueError(f"activation {name!r} is not supported; supported: {sorted(ACTIVATIONS)}")
        return ACTIVATIONS[name]

    @classmethod
    def make_mlp(cls, config, layer_idx: int, quantization, tp: TensorParallel, kernels: KernelOptions) -> nn.Module:
        """The layer's feed-forward block (an MoE family's sparse layers make theirs)."""
        return MLP(config, layer_idx, cls, quantization, tp, kernels)

    @staticmethod
    def final_logit_softcap(config) -> float | None:
        return getattr(config, "final_logit_softcapping", None)

    def checkpoint_name(self, name: str) -> str | None:
        """The Hugging Face name a checkpoint tensor has in this skeleton (``model.layers.N....``); None to
        skip the tensor."""
        return name

    # --- the skeleton --------------------------------------------------------------------------------
    def __init__(self, config, backend: AttentionBackend, quantization: "QuantizationMethod | None" = None,
                 tp: TensorParallel | None = None, kernels: KernelOptions = DEFAULT_KERNELS) -> None:
        """``kernels``: the CUDA kernels' options (the engine's ``kernel_options``)."""
        super().__init__()
        self.config = config
        self.tp = tp = tp or TensorParallel()
        self.specs = [type(self).attention_spec(config, i) for i in range(config.num_hidden_layers)]
        self.embed_tokens = VocabParallelEmbedding(config.vocab_size, config.hidden_size, tp)
        self.layers = nn.ModuleList(
            DecoderLayer(config, i, spec, type(self), backend, quantization, tp, kernels)
            for i, spec in enumerate(self.specs)
        )
        self.norm = type(self).norm_class(config.hidden_size, config.rms_norm_eps, kernels)
        self.tie_word_embeddings = bool(getattr(config, "tie_word_embeddings", False))
        # Tied: the embedding table is the output projection, unless a packed copy is set after loading.
        # The output projection stays dense, as in the usual AWQ/GPTQ/FP8 checkpoints.
        # Under tensor parallelism each rank projects onto its share of the vocabulary (the rows of its
        # embedding shard, when tied) and compute_logits gathers the shares.
        head = ReplicatedLinear if tp.size == 1 else ColumnLinear
        self.lm_head = None if self.tie_word_embeddings else head(
            config.hidden_size, config.vocab_size, False, prefix="lm_head", method=UnquantizedLinearMethod(),
            **({} if tp.size == 1 else dict(tp_rank=tp.rank, tp_size=tp.size)))
        shapes = {(s.num_kv_heads, s.head_dim) for s in self.specs}
        if len(shapes) != 1:
            raise ValueError(f"layers with different KV shapes (kv heads, head size) {sorted(shapes)} "
                             "are not supported")
        attn = self.layers[0].self_attn
        self.num_kv_heads, self.head_dim = attn.num_kv_heads, attn.head_dim
        self.softcap = type(self).final_logit_softcap(config)
        # rounded to the model dtype first, as transformers scales
        scale = torch.tensor(math.sqrt(config.hidden_size), device="cpu")
        self.embed_scale = float(scale.to(torch.get_default_dtype())) if self.scale_embeddings else None
        self.rope_keys = sorted({s.rope for s in self.specs}, key=str)
        self.register_buffer("cos_sin", torch.empty(0), persistent=False)
        self.rope_tables: dict[str | None, torch.Tensor] = {}
        # Each layer's group of a hybrid KV cache (set by the engine); forward then takes one metadata a group.
        self.kv_groups: list[int] | None = None

    def init_rope(self, max_positions: int) -> None:
        """(Re)build the rotary tables on the model's device; call after weights are materialized."""
        device = self.embed_tokens.weight.device
        self.rope_tables = {key: rope_cos_sin_cache(self.config, self.head_dim, max_positions, key).to(device)
                            for key in self.rope_keys}
        self.cos_sin = self.rope_tables[self.rope_keys[0]]

    def forward(self, input_ids, positions, meta: AttentionMetadata | list[AttentionMetadata], kv_caches,
                keep: torch.Tensor | None = None, lora=None) -> torch.Tensor:
        """Final hidden states ``[T, hidden]``; with ``keep`` (row indices), only those rows': the last layer
        still caches every row's K/V but runs its output projection and MLP on the kept rows alone (a
        prefill step needs logits for one row per prompt). ``meta``: one for every layer, or (a hybrid KV
        cache) a list of one per layer group, ``kv_groups`` saying which layer reads which. ``lora``: the
        step's tokens by adapter slot (``kvloom.core.model.lora.LoRABatch``), read by the layers' LoRA slots."""
        if self.lora_context is not None:
            self.lora_context.batch = lora
        h = self.embed_tokens(input_ids)
        if self.embed_scale is not None:
            h = h * self.embed_scale
        residual = None
        # once per step, for every layer
        ropes = {key: ops.rotary_tables(positions, table, h.dtype) for key, table in self.rope_tables.items()}
        last = len(self.layers) - 1
        groups = self.kv_groups if isinstance(meta, (list, tuple)) else None
        for i, (layer, kv) in enumerate(zip(self.layers, kv_caches)):
            m = meta if groups is None else meta[groups[i]]  # a hybrid cache: the layer's group's block tables
            h, residual = layer(ropes[self.specs[i].rope], h, residual, m, kv, keep if i == last else None)
        if h.shape[0] == 0:
            return h
        h, _ = self.norm(h, residual)
        return h

    def compute_logits(self, h: torch.Tensor) -> torch.Tensor:
        """Float32 logits over the whole vocabulary (every rank's shard gathered), soft-capped where the
        family caps them."""
        if self.lm_head is not None:
            logits = self.lm_head(h)
        else:
            logits = torch.nn.functional.linear(h, self.embed_tokens.weight)
        logits = self.tp.gather_last_dim(logits).float()
        if self.softcap:
            logits = torch.tanh(logits / self.softcap).mul_(self.softcap)
        return logits

    # ---------------------------------------------------------------------------------------------
    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[tuple[str, object]]:
        """Hand each checkpoint tensor (Hugging Face names) to the parameter's ``weight_loader``, with the
        shard it is of a fused layer. Returns the (parameter name, shard id) pairs that were set."""
        modules = dict(self.named_modules())
        loaded: set[tuple[str, object]] = set()
        for name, tensor in weights:
            name = self.checkpoint_name(name)
            if name is None or "rotary_emb" in name or (name.startswith("lm_head") and self.tie_word_embeddings):
                continue
            module_name, _, leaf = name.removeprefix("model.").rpartition(".")
            shard = None
            head, _, last = module_name.rpartition(".")
            if last in self.stacked:
                fused, shard = self.stacked[last]
                module_name = f"{head}.{fused}"
            module = modules.get(module_name)
            if last in self.fused_in_checkpoint and isinstance(module, LinearBase):
                param = module._parameters.get(leaf)
                if param is None:
                    if self._ignorable(module, leaf, tensor):
                        continue
                    raise ValueError(f"checkpoint tensor {name!r} has no matching parameter in {type(self).__name__}")
                for shard_id, piece in _split_fused(module, param, tensor, name):
                    param.weight_loader(param, piece, shard_id)
                    loaded.add((f"{module_name}.{leaf}", shard_id))
                continue
            param = module._parameters.get(leaf) if module is not None else None
            if param is None:
                if module is not None and self._ignorable(module, leaf, tensor):
                    continue
                raise ValueError(f"checkpoint tensor {name!r} has no matching parameter in {type(self).__name__}")
            loader = getattr(param, "weight_loader", None)
            if loader is not None:
                loader(param, tensor, shard)
            elif param.shape != tensor.shape:
                raise ValueError(f"{name}: checkpoint shape {tuple(tensor.shape)} != model shape {tuple(param.shape)}")
            else:
                with torch.no_grad():
                    param.copy_(tensor)
            loaded.add((f"{module_name}.{leaf}", shard))
        return loaded

    @staticmethod
    def _ignorable(module: nn.Module, leaf: str, tensor: torch.Tensor) -> bool:
        """Tensors a format saves that carry nothing here: the zero biases GPTQ writes for bias-free layers,
        and what the layer's method says it does not use (GPTQ's g_idx without desc_act)."""
        if not isinstance(module, LinearBase):
            return False
        if leaf == "bias" and module.bias is None:
            return not bool(tensor.any())
        return leaf in getattr(module.method, "ignored", ())

    def required_weights(self) -> list[tuple[str, object]]:
        """Every (parameter name, shard id) a complete checkpoint sets: each shard of a fused layer's
        parameters, whatever the layer's weight format declares."""
        needed = []
        for module_name, module in self.named_modules():
            for leaf, param in module.named_parameters(recurse=False):
                name = f"{module_name}.{leaf}" if module_name else leaf
                shards = module.shard_ids if isinstance(module, LinearBase) and module.shard_ids else [None]
                needed += [(name, s) for s in shards]
        return needed

    def linear_layers(self) -> list[LinearBase]:
        return [m for m in self.modules() if isinstance(m, LinearBase)]

    @torch.no_grad()
    def process_weights_after_loading(self) -> None:
        """What modules other than the linear layers derive from their loaded weights (Gemma's norm scales)."""
        for module in self.modules():
            if isinstance(module, GemmaRMSNorm):
                module.process_weights_after_loading()


def _split_fused(layer: LinearBase, param: nn.Parameter, tensor: torch.Tensor, name: str):
    """(shard id, slice) for each shard of a fused layer from one checkpoint tensor holding them all, cut
    along the parameter's output dim in proportion to the shards' sizes (packed formats included); a
    parameter without an output dim (a per-tensor scale) gives each shard the whole tensor."""
    dim = getattr(param, "output_dim", None)
    sizes, total = layer.output_sizes, layer.output_size
    if dim is None or tensor.dim() <= dim or tensor.numel() == 1:
        return [(shard_id, tensor) for shard_id in layer.shard_ids]
    full = tensor.shape[dim]
    if any((full * s) % total for s in sizes):
        raise ValueError(f"{name}: checkpoint shape {tuple(tensor.shape)} does not split into the shards "
                         f"{layer.shard_ids} of sizes {[s * layer.tp_size for s in sizes]} along dim {dim}")
    out, start = [], 0
    for shard_id, s in zip(layer.shard_ids, sizes):
        n = full * s // total
        out.append((shard_id, tensor.narrow(dim, start, n)))
        start += n
    return out
