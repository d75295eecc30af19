"""Model loading: configs and weights from Hugging Face folders (safetensors, sharded or not), from
GGUF files (dequantized at load), or dummy weights of any config for benchmarks."""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Iterator

import torch
from tqdm.auto import tqdm

from kvloom.core.attention import AttentionBackend
from kvloom.core.cpu_linear import pack_linear_layers
from kvloom.core.models.llama import SUPPORTED_ARCHITECTURES, DecoderLM, default_linear

logger = logging.getLogger("kvloom")

# GGUF architecture -> (transformers config class name, HF architecture)
_GGUF_ARCHS = {
    "llama": ("LlamaConfig", "LlamaForCausalLM"),
    "mistral": ("MistralConfig", "MistralForCausalLM"),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM"),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM"),
}

_GGUF_LAYER_NAMES = {
    "attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj", "attn_q_norm": "self_attn.q_norm", "attn_k_norm": "self_attn.k_norm",
    "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj",
}
_GGUF_GLOBAL_NAMES = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}


def is_gguf(path: Path) -> bool:
    return path.is_file() and path.suffix == ".gguf"


# --- configs ---------------------------------------------------------------------------------------
def load_hf_config(path: Path, overrides: dict | None = None):
    """The model's transformers config (from config.json or GGUF metadata), with ``overrides`` applied."""
    if is_gguf(path):
        config = _gguf_config(path)
    else:
        from transformers import AutoConfig

        config = AutoConfig.from_pretrained(str(path))
    for key, value in (overrides or {}).items():
        setattr(config, key, value)
    check_architecture(config)
    return config


def check_architecture(config) -> str:
    archs = list(getattr(config, "architectures", None) or [])
    arch = archs[0] if archs else None
    if arch not in SUPPORTED_ARCHITECTURES:
        raise ValueError(
            f"unsupported model architecture {arch!r}; supported: {sorted(SUPPORTED_ARCHITECTURES)}"
        )
    return arch


def _gguf_config(path: Path):
    import transformers
    from gguf import GGUFReader

    reader = GGUFReader(str(path))
    fields = {k: v.contents() for k, v in reader.fields.items() if not k.startswith("tokenizer.ggml.")
              or k.endswith("_token_id")}
    arch = fields["general.architecture"]
    if arch not in _GGUF_ARCHS:
        raise ValueError(f"unsupported GGUF architecture {arch!r}; supported: {sorted(_GGUF_ARCHS)}")
    cls_name, hf_arch = _GGUF_ARCHS[arch]
    a = lambda key, default=None: fields.get(f"{arch}.{key}", default)  # noqa: E731
    heads = a("attention.head_count")
    hidden = a("embedding_length")
    names = {t.name for t in reader.tensors}
    vocab = a("vocab_size") or len(reader.fields["tokenizer.ggml.tokens"].data)
    kwargs = dict(
        vocab_size=vocab, hidden_size=hidden, intermediate_size=a("feed_forward_length"),
        num_hidden_layers=a("block_count"), num_attention_heads=heads,
        num_key_value_heads=a("attention.head_count_kv", heads),
        max_position_embeddings=a("context_length", 4096),
        rms_norm_eps=a("attention.layer_norm_rms_epsilon", 1e-6), rope_theta=a("rope.freq_base", 10000.0),
        tie_word_embeddings="output.weight" not in names, architectures=[hf_arch],
        bos_token_id=fields.get("tokenizer.ggml.bos_token_id"), eos_token_id=fields.get("tokenizer.ggml.eos_token_id"),
    )
    head_dim = a("attention.key_length")
    if head_dim:
        kwargs["head_dim"] = head_dim
    config = getattr(transformers, cls_name)(**kwargs)
    config.gguf_architecture = arch
    return config


# --- weights ---------------------------------------------------------------------------------------
def iter_safetensors(path: Path) -> Iterator[tuple[str, torch.Tensor]]:
    from safetensors import safe_open

    index = path / "model.safetensors.index.json"
    if index.exists():
        files = sorted(set(json.loads(index.read_text())["weight_map"].values()))
    else:
        files = sorted(p.name for p in path.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no .safetensors files in {str(path)!r}")
    for fname in tqdm(files, desc="Loading safetensors shards", unit="shard", disable=len(files) < 2):
        with safe_open(str(path / fname), framework="pt") as f:
            for name in f.keys():
                yield name, f.get_tensor(name)


def _reverse_llama_permute(w: torch.Tensor, n_head: int) -> torch.Tensor:
    """Undo llama.cpp's interleaving of rotary halves in q/k weights (its converter permutes them)."""
    dim = w.shape[0] // n_head // 2
    return w.reshape(n_head, dim, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def iter_gguf(path: Path, config) -> Iterator[tuple[str, torch.Tensor]]:
    from gguf import GGUFReader
    from gguf.quants import dequantize

    reader = GGUFReader(str(path))
    permute = getattr(config, "gguf_architecture", "llama") in ("llama", "mistral")
    for t in tqdm(reader.tensors, desc="Loading GGUF (dequantizing)", unit="tensor"):
        stem, _, kind = t.name.rpartition(".")
        parts = stem.split(".")
        if parts[0] == "blk":
            name = f"model.layers.{parts[1]}.{_GGUF_LAYER_NAMES[parts[2]]}.{kind}"
        elif stem in _GGUF_GLOBAL_NAMES:
            name = f"{_GGUF_GLOBAL_NAMES[stem]}.{kind}"
        else:
            continue  # e.g. rope_freqs: recomputed from the config
        tensor = torch.from_numpy(dequantize(t.data, t.tensor_type).copy())
        if permute and stem.endswith("attn_q"):
            tensor = _reverse_llama_permute(tensor, config.num_attention_heads)
        elif permute and stem.endswith("attn_k"):
            tensor = _reverse_llama_permute(tensor, config.num_key_value_heads)
        yield name, tensor


# --- model -----------------------------------------------------------------------------------------
def build_model(
    path: Path | None,
    config,
    *,
    load_format: str,
    device: torch.device,
    dtype: torch.dtype,
    backend: AttentionBackend,
    max_positions: int,
    seed: int = 0,
    linear=default_linear,
    pack_cpu_weights: bool = True,
) -> DecoderLM:
    """Create the model on ``device`` and fill its weights from ``path`` (or randomly for ``dummy``).
    On the CPU the linear layers are then packed for oneDNN (``kvloom.core.cpu_linear``) unless
    ``pack_cpu_weights`` is false."""
    with torch.device("meta"):
        model = SUPPORTED_ARCHITECTURES[check_architecture(config)](config, backend, linear)
    model = model.to_empty(device=device).to(dtype)
    if load_format == "dummy":
        _init_dummy(model, seed)
    else:
        fmt = load_format if load_format != "auto" else ("gguf" if is_gguf(path) else "safetensors")
        weights = iter_gguf(path, config) if fmt == "gguf" else iter_safetensors(path)
        loaded = model.load_weights(weights)
        missing = sorted(n for n, _ in model.named_parameters() if n not in loaded)
        if missing:
            raise ValueError(f"checkpoint {str(path)!r} lacks weights for {missing[:5]}{'...' if len(missing) > 5 else ''}")
    model.init_rope(max_positions)
    if pack_cpu_weights and device.type == "cpu" and linear is default_linear:
        pack_linear_layers(model)
    return model.eval()


@torch.no_grad()
def _init_dummy(model: torch.nn.Module, seed: int) -> None:
    """Deterministic random weights with sane scales: norms at one, matrices N(0, 0.02)."""
    gen = torch.Generator(device=next(model.parameters()).device).manual_seed(seed)
    for name, p in model.named_parameters():
        if "norm" in name:
            p.fill_(1.0)
        elif name.endswith("bias"):
            p.zero_()
        else:
            p.normal_(0.0, 0.02, generator=gen)
