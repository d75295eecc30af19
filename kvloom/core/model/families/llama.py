"""Llama-family decoders in plain PyTorch: Llama 2/3 (with Llama-3 rope scaling), SmolLM2, Mistral,
Qwen2/2.5 (qkv bias) and Qwen3 (per-head q/k RMSNorm), with tied or untied embeddings.

The model takes one flat batch of tokens (any mix of prefill chunks and decodes) and attends through
an ``AttentionBackend`` over the paged KV cache. Its linear layers own their weights
(``kvloom.core.model.linear``): the model only maps Hugging Face checkpoint names to (layer, shard),
so q/k/v and gate/up load into one fused matmul each, in any weight format a quantization method makes.
Under tensor parallelism (``tp``) each rank holds its heads, its share of the MLP and of the vocabulary
(Megatron-style: column-parallel qkv/gate-up, row-parallel o/down followed by an all-reduce).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Iterable

import torch
from torch import nn

from kvloom.core.model.attention.base import AttentionBackend, AttentionMetadata
from kvloom.core.model.distributed import TensorParallel
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


def linear_method(quantization: "QuantizationMethod | None", prefix: str, checkpoint_names: list[str]):
    """The layer's weight format: the quantization method's, or dense."""
    if quantization is None:
        return UnquantizedLinearMethod()
    return quantization.linear_method(prefix, checkpoint_names)


class RMSNorm(nn.Module):
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


def rope_cos_sin_cache(config, head_dim: int, max_positions: int) -> torch.Tensor:
    """``[max_positions, head_dim]`` float32: cos of each frequency, then sin, with the rope type's
    scaling (inverse frequencies come from transformers so they match it exactly)."""
    params = dict(getattr(config, "rope_parameters", None) or {})
    if not params:  # transformers 4.x layout
        params = dict(getattr(config, "rope_scaling", None) or {})
        params.setdefault("rope_theta", getattr(config, "rope_theta", 10000.0))
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type == "default":
        theta = float(params["rope_theta"])
        inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
        scaling = 1.0
    elif rope_type in ("linear", "llama3", "yarn", "longrope"):
        from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

        inv_freq, scaling = ROPE_INIT_FUNCTIONS[rope_type](config, torch.device("cpu"))
    else:
        raise ValueError(f"rope type {rope_type!r} is not supported; supported: default, linear, llama3, yarn, longrope")
    freqs = torch.arange(max_positions, dtype=torch.float32)[:, None] * inv_freq.float()[None, :]
    return torch.cat([freqs.cos() * scaling, freqs.sin() * scaling], dim=-1)


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


class Attention(nn.Module):
    def __init__(self, config, layer_idx: int, backend: AttentionBackend, quantization=None,
                 tp: TensorParallel | None = None, kernels: KernelOptions = DEFAULT_KERNELS) -> None:
        super().__init__()
        self.kernels = kernels
        tp = tp or TensorParallel()
        self.tp = tp
        heads = config.num_attention_heads
        kv_heads = getattr(config, "num_key_value_heads", None) or heads
        self.head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
        self.num_heads, self.num_kv_heads = heads // tp.size, kv_heads // tp.size  # this rank's heads
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        self.scale = self.head_dim**-0.5
        bias = bool(getattr(config, "attention_bias", False)) or config.model_type == "qwen2"
        prefix = f"model.layers.{layer_idx}.self_attn"
        ranks = dict(tp_rank=tp.rank, tp_size=tp.size)
        self.qkv_proj = QKVLinear(
            config.hidden_size, self.head_dim, heads, kv_heads, bias, prefix=f"{prefix}.qkv_proj",
            method=linear_method(quantization, f"{prefix}.qkv_proj", [f"{prefix}.{p}_proj" for p in "qkv"]), **ranks)
        self.o_proj = RowLinear(heads * self.head_dim, config.hidden_size, False, prefix=f"{prefix}.o_proj",
                                method=linear_method(quantization, f"{prefix}.o_proj", [f"{prefix}.o_proj"]), **ranks)
        self.qk_norm = config.model_type == "qwen3"
        if self.qk_norm:
            self.q_norm = RMSNorm(self.head_dim, config.rms_norm_eps, kernels)
            self.k_norm = RMSNorm(self.head_dim, config.rms_norm_eps, kernels)
        self.layer_idx = layer_idx
        self.backend = backend
        # Per-tensor scales of an fp8 KV cache (stored x / scale): 1.0, or the checkpoint's k_scale/v_scale
        # (kvloom.core.model.loader.KVCacheScales); other caches ignore them.
        self.k_scale = self.v_scale = 1.0

    def forward(self, rope, h, meta: AttentionMetadata, kv_cache) -> torch.Tensor:
        fp8_cache = kv_cache[0].dtype == torch.float8_e4m3fn
        qkv = None
        if (not self.qk_norm and getattr(self.backend, "takes_written_kv", False) and meta.num_decodes == meta.num_seqs
                and isinstance(h, torch.Tensor)):
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
        fused = {}
        if written:  # rotated, and the cache written, by the qkv kernel
            fused["kv_written"] = True
        elif getattr(self.backend, "fuses_rotary", False):  # rotated where the backend writes the cache
            fused["rope"] = rope
        else:
            q, k = ops.apply_rotary(rope, q, k, self.kernels)
        if fp8_cache and (self.k_scale, self.v_scale) != (1.0, 1.0):
            fused.update(k_scale=self.k_scale, v_scale=self.v_scale)
        out = self.backend.forward(q, k, v, kv_cache, meta, self.scale, **fused)
        return self.tp.all_reduce(self.o_proj(out.reshape(-1, self.q_size)))


class MLP(nn.Module):
    def __init__(self, config, layer_idx: int, quantization=None, tp: TensorParallel | None = None,
                 kernels: KernelOptions = DEFAULT_KERNELS) -> None:
        super().__init__()
        self.kernels = kernels
        self.tp = tp = tp or TensorParallel()
        prefix = f"model.layers.{layer_idx}.mlp"
        inter = config.intermediate_size
        ranks = dict(tp_rank=tp.rank, tp_size=tp.size)
        self.gate_up_proj = MergedColumnLinear(
            config.hidden_size, [inter, inter], False, prefix=f"{prefix}.gate_up_proj",
            method=linear_method(quantization, f"{prefix}.gate_up_proj", [f"{prefix}.gate_proj", f"{prefix}.up_proj"]),
            **ranks)
        self.down_proj = RowLinear(inter, config.hidden_size, False, prefix=f"{prefix}.down_proj",
                                   method=linear_method(quantization, f"{prefix}.down_proj", [f"{prefix}.down_proj"]),
                                   **ranks)
        act = getattr(config, "hidden_act", "silu")
        if act != "silu":
            raise ValueError(f"hidden_act={act!r} is not supported; supported: silu")

    def forward(self, h) -> torch.Tensor:
        act = self.gate_up_proj.forward_silu_and_mul(h, fp8=self.down_proj.takes_fp8_rows(num_rows(h)),
                                                     kernels=self.kernels)
        return self.tp.all_reduce(self.down_proj(act))


class DecoderLayer(nn.Module):
    def __init__(self, config, layer_idx: int, backend: AttentionBackend, quantization=None,
                 tp: TensorParallel | None = None, kernels: KernelOptions = DEFAULT_KERNELS) -> None:
        super().__init__()
        self.self_attn = Attention(config, layer_idx, backend, quantization, tp, kernels)
        self.mlp = MLP(config, layer_idx, quantization, tp, kernels)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, kernels)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, kernels)

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
        h, residual = self.post_attention_layernorm(h, residual, fp8=self.mlp.gate_up_proj.takes_fp8_rows(h.shape[0]))
        return self.mlp(h), residual


class DecoderLM(nn.Module):
    """A Llama-family causal LM over a paged KV cache."""

    # checkpoint module name -> (fused layer name, shard id)
    stacked = {
        "q_proj": ("qkv_proj", "q"), "k_proj": ("qkv_proj", "k"), "v_proj": ("qkv_proj", "v"),
        "gate_proj": ("gate_up_proj", 0), "up_proj": ("gate_up_proj", 1),
    }

    def __init__(self, config, backend: AttentionBackend, quantization: "QuantizationMethod | None" = None,
                 tp: TensorParallel | None = None, kernels: KernelOptions = DEFAULT_KERNELS) -> None:
        """``kernels``: the CUDA kernels' options (the engine's ``kernel_options``)."""
        super().__init__()
        self.config = config
        self.tp = tp = tp or TensorParallel()
        self.embed_tokens = VocabParallelEmbedding(config.vocab_size, config.hidden_size, tp)
        self.layers = nn.ModuleList(
            DecoderLayer(config, i, backend, quantization, tp, kernels) for i in range(config.num_hidden_layers)
        )
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps, kernels)
        self.tie_word_embeddings = bool(getattr(config, "tie_word_embeddings", False))
        # Tied: the embedding table is the output projection, unless a packed copy is set after loading.
        # The output projection stays dense, as in the usual AWQ/GPTQ/FP8 checkpoints.
        # Under tensor parallelism each rank projects onto its share of the vocabulary (the rows of its
        # embedding shard, when tied) and compute_logits gathers the shares.
        head = ReplicatedLinear if tp.size == 1 else ColumnLinear
        self.lm_head = None if self.tie_word_embeddings else head(
            config.hidden_size, config.vocab_size, False, prefix="lm_head", method=UnquantizedLinearMethod(),
            **({} if tp.size == 1 else dict(tp_rank=tp.rank, tp_size=tp.size)))
        attn = self.layers[0].self_attn
        self.num_kv_heads, self.head_dim = attn.num_kv_heads, attn.head_dim
        self.register_buffer("cos_sin", torch.empty(0), persistent=False)
    def init_rope(self, max_positions: int) -> None:
        """(Re)build the rotary table on the model's device; call after weights are materialized."""
        device = self.embed_tokens.weight.device
        self.cos_sin = rope_cos_sin_cache(self.config, self.head_dim, max_positions).to(device)

    def forward(self, input_ids, positions, meta: AttentionMetadata, kv_caches,
                keep: torch.Tensor | None = None) -> torch.Tensor:
        """Final hidden states ``[T, hidden]``; with ``keep`` (row indices), only those rows': the last layer
        still caches every row's K/V but runs its output projection and MLP on the kept rows alone (a
        prefill step needs logits for one row per prompt)."""
        h = self.embed_tokens(input_ids)
        residual = None
        rope = ops.rotary_tables(positions, self.cos_sin, h.dtype)  # once per step, for every layer
        last = len(self.layers) - 1
        for i, (layer, kv) in enumerate(zip(self.layers, kv_caches)):
            h, residual = layer(rope, h, residual, meta, kv, keep if i == last else None)
        if h.shape[0] == 0:
            return h
        h, _ = self.norm(h, residual)
        return h

    def compute_logits(self, h: torch.Tensor) -> torch.Tensor:
        """Float32 logits over the whole vocabulary (every rank's shard gathered)."""
        if self.lm_head is not None:
            logits = self.lm_head(h)
        else:
            logits = torch.nn.functional.linear(h, self.embed_tokens.weight)
        return self.tp.gather_last_dim(logits).float()

    # ---------------------------------------------------------------------------------------------
    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[tuple[str, object]]:
        """Hand each checkpoint tensor (Hugging Face names) to the parameter's ``weight_loader``, with the
        shard it is of a fused layer. Returns the (parameter name, shard id) pairs that were set."""
        modules = dict(self.named_modules())
        loaded: set[tuple[str, object]] = set()
        for name, tensor in weights:
            if "rotary_emb" in name or (name.startswith("lm_head") and self.tie_word_embeddings):
                continue
            module_name, _, leaf = name.removeprefix("model.").rpartition(".")
            shard = None
            head, _, last = module_name.rpartition(".")
            if last in self.stacked:
                fused, shard = self.stacked[last]
                module_name = f"{head}.{fused}"
            module = modules.get(module_name)
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


SUPPORTED_ARCHITECTURES = {
    "LlamaForCausalLM": DecoderLM,
    "MistralForCausalLM": DecoderLM,
    "Qwen2ForCausalLM": DecoderLM,
    "Qwen3ForCausalLM": DecoderLM,
}
