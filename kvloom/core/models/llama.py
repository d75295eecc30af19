"""Llama-family decoders in plain PyTorch: Llama 2/3 (with Llama-3 rope scaling), SmolLM2, Mistral,
Qwen2/2.5 (qkv bias) and Qwen3 (per-head q/k RMSNorm), with tied or untied embeddings.

The model takes one flat batch of tokens (any mix of prefill chunks and decodes) and attends through
an ``AttentionBackend`` over the paged KV cache. Weights use Hugging Face names; q/k/v and gate/up
are fused into one matmul each at load time.
"""

from __future__ import annotations

from typing import Callable, Iterable

import torch
from torch import nn

from kvloom.core.attention import AttentionBackend, AttentionMetadata
from kvloom.kernels import ops

LinearFactory = Callable[[int, int, bool, str], nn.Module]


def default_linear(in_features: int, out_features: int, bias: bool, prefix: str) -> nn.Module:
    return nn.Linear(in_features, out_features, bias=bias)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        return ops.rms_norm(x, self.weight, self.eps, residual)


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


class Attention(nn.Module):
    def __init__(self, config, layer_idx: int, backend: AttentionBackend, linear: LinearFactory) -> None:
        super().__init__()
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = getattr(config, "num_key_value_heads", None) or self.num_heads
        self.head_dim = getattr(config, "head_dim", None) or config.hidden_size // self.num_heads
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        self.scale = self.head_dim**-0.5
        bias = bool(getattr(config, "attention_bias", False)) or config.model_type == "qwen2"
        prefix = f"model.layers.{layer_idx}.self_attn"
        self.qkv_proj = linear(config.hidden_size, self.q_size + 2 * self.kv_size, bias, f"{prefix}.qkv_proj")
        self.o_proj = linear(self.q_size, config.hidden_size, False, f"{prefix}.o_proj")
        self.qk_norm = config.model_type == "qwen3"
        if self.qk_norm:
            self.q_norm = RMSNorm(self.head_dim, config.rms_norm_eps)
            self.k_norm = RMSNorm(self.head_dim, config.rms_norm_eps)
        self.layer_idx = layer_idx
        self.backend = backend

    def forward(self, rope, h, meta: AttentionMetadata, kv_cache) -> torch.Tensor:
        qkv = self.qkv_proj(h)
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.reshape(-1, self.num_heads, self.head_dim)
        k = k.reshape(-1, self.num_kv_heads, self.head_dim)
        v = v.reshape(-1, self.num_kv_heads, self.head_dim)
        if self.qk_norm:
            q = self.q_norm(q)
            k = self.k_norm(k)
        q, k = ops.apply_rotary(rope, q, k)
        out = self.backend.forward(q, k, v, kv_cache, meta, self.scale)
        return self.o_proj(out.reshape(-1, self.q_size))


class MLP(nn.Module):
    def __init__(self, config, layer_idx: int, linear: LinearFactory) -> None:
        super().__init__()
        prefix = f"model.layers.{layer_idx}.mlp"
        inter = config.intermediate_size
        self.gate_up_proj = linear(config.hidden_size, 2 * inter, False, f"{prefix}.gate_up_proj")
        self.down_proj = linear(inter, config.hidden_size, False, f"{prefix}.down_proj")
        act = getattr(config, "hidden_act", "silu")
        if act != "silu":
            raise ValueError(f"hidden_act={act!r} is not supported; supported: silu")

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return self.down_proj(ops.silu_and_mul(self.gate_up_proj(h)))


class DecoderLayer(nn.Module):
    def __init__(self, config, layer_idx: int, backend: AttentionBackend, linear: LinearFactory) -> None:
        super().__init__()
        self.self_attn = Attention(config, layer_idx, backend, linear)
        self.mlp = MLP(config, layer_idx, linear)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, rope, h, residual, meta, kv_cache, keep=None):
        if residual is None:
            residual = h
            h = self.input_layernorm(h)
        else:
            h, residual = self.input_layernorm(h, residual)
        h = self.self_attn(rope, h, meta, kv_cache)
        if keep is not None:  # only these rows go on (their K/V for every row are cached by now)
            h, residual = h[keep], residual[keep]
            if h.shape[0] == 0:
                return h, residual
        h, residual = self.post_attention_layernorm(h, residual)
        return self.mlp(h), residual


class DecoderLM(nn.Module):
    """A Llama-family causal LM over a paged KV cache."""

    # checkpoint name fragment -> (fused parameter fragment, shard index)
    fused = {
        "q_proj": ("qkv_proj", 0), "k_proj": ("qkv_proj", 1), "v_proj": ("qkv_proj", 2),
        "gate_proj": ("gate_up_proj", 0), "up_proj": ("gate_up_proj", 1),
    }

    def __init__(self, config, backend: AttentionBackend, linear: LinearFactory = default_linear) -> None:
        super().__init__()
        self.config = config
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(
            DecoderLayer(config, i, backend, linear) for i in range(config.num_hidden_layers)
        )
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.tie_word_embeddings = bool(getattr(config, "tie_word_embeddings", False))
        # Tied: the embedding table is the output projection, unless a packed copy is set after loading.
        self.lm_head = None if self.tie_word_embeddings else nn.Linear(config.hidden_size, config.vocab_size, bias=False)
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
        if keep is not None and keep.shape[0] == input_ids.shape[0]:
            keep = None  # every row is kept (a decode step): nothing to select
        last = len(self.layers) - 1
        for i, (layer, kv) in enumerate(zip(self.layers, kv_caches)):
            h, residual = layer(rope, h, residual, meta, kv, keep if i == last else None)
        if h.shape[0] == 0:
            return h
        h, _ = self.norm(h, residual)
        return h

    def compute_logits(self, h: torch.Tensor) -> torch.Tensor:
        if self.lm_head is not None:
            return self.lm_head(h).float()
        return torch.nn.functional.linear(h, self.embed_tokens.weight).float()

    # ---------------------------------------------------------------------------------------------
    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """Copy checkpoint tensors (Hugging Face names) into the parameters, fusing q/k/v and gate/up.
        Returns the names of the parameters that were set."""
        params = dict(self.named_parameters())
        loaded: set[str] = set()
        for name, tensor in weights:
            if "rotary_emb" in name:
                continue
            if name.startswith("lm_head") and self.tie_word_embeddings:
                continue
            target, shard = name.removeprefix("model."), None
            for frag, (fused_frag, idx) in self.fused.items():
                if f".{frag}." in target:
                    target, shard = target.replace(f".{frag}.", f".{fused_frag}."), idx
                    break
            if target not in params:
                raise ValueError(f"checkpoint tensor {name!r} has no matching parameter in {type(self).__name__}")
            param = params[target]
            if shard is None:
                if param.shape != tensor.shape:
                    raise ValueError(f"{name}: checkpoint shape {tuple(tensor.shape)} != model shape {tuple(param.shape)}")
                param.data.copy_(tensor)
            else:
                sizes = self._shard_sizes(target)
                start = sum(sizes[:shard])
                param.data.narrow(0, start, sizes[shard]).copy_(tensor)
            loaded.add(target)
        return loaded

    def _shard_sizes(self, param_name: str) -> list[int]:
        attn = self.layers[0].self_attn
        if "qkv_proj" in param_name:
            return [attn.q_size, attn.kv_size, attn.kv_size]
        return [self.config.intermediate_size] * 2


SUPPORTED_ARCHITECTURES = {
    "LlamaForCausalLM": DecoderLM,
    "MistralForCausalLM": DecoderLM,
    "Qwen2ForCausalLM": DecoderLM,
    "Qwen3ForCausalLM": DecoderLM,
}
