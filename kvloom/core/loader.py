"""Model loading: configs and weights from Hugging Face folders (safetensors, sharded or not), from
GGUF files (dequantized at load), or dummy weights of any config for benchmarks. Every path hands the
tensors to the layers' weight loaders, then runs each layer's ``process_weights_after_loading``
(repacking or dequantizing a quantized format, then packing dense weights for oneDNN on the CPU)."""

from __future__ import annotations

import contextlib
import json
import logging
from pathlib import Path
from typing import Iterator

import torch
from tqdm.auto import tqdm

from kvloom.core.attention import AttentionBackend
from kvloom.core.cpu_linear import pack_layer, pack_tied_output
from kvloom.core.models.llama import SUPPORTED_ARCHITECTURES, DecoderLM

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
        _attach_quantize_config(path, config)
    for key, value in (overrides or {}).items():
        setattr(config, key, value)
    check_architecture(config)
    return config


def _attach_quantize_config(path: Path, config) -> None:
    """AutoGPTQ/AutoAWQ checkpoints may keep their quantization settings in a file of their own."""
    if getattr(config, "quantization_config", None) is not None:
        return
    for name, method in (("quantize_config.json", "gptq"), ("quant_config.json", "awq")):
        file = path / name
        if file.is_file():
            qc = json.loads(file.read_text())
            qc.setdefault("quant_method", method)
            config.quantization_config = qc
            return


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
@contextlib.contextmanager
def default_dtype(dtype: torch.dtype):
    """Build parameters in ``dtype`` unless a layer names its own (int32 packed weights, fp16 scales, FP8)."""
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(previous)


def make_model(config, backend: AttentionBackend, dtype: torch.dtype, quantization=None, tp=None) -> DecoderLM:
    """The model on the meta device, its layers in the quantization method's format, holding tensor-parallel
    rank ``tp``'s share (``engine plan`` sizes weights from exactly this)."""
    with torch.device("meta"), default_dtype(dtype):
        return SUPPORTED_ARCHITECTURES[check_architecture(config)](config, backend, quantization, tp=tp)


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
    quantization=None,
    pack_cpu_weights: bool = True,
    tp=None,
) -> DecoderLM:
    """Create the model on ``device`` (its linear layers in ``quantization``'s format, or dense), fill its
    weights from ``path`` (or randomly for ``dummy``), then process them once: the format's repacking,
    then on the CPU oneDNN packing of dense weights unless ``pack_cpu_weights`` is false."""
    model = _materialize(make_model(config, backend, dtype, quantization, tp), device)
    if load_format == "dummy":
        _init_dummy(model, seed)
    else:
        fmt = load_format if load_format != "auto" else ("gguf" if is_gguf(path) else "safetensors")
        weights = iter_gguf(path, config) if fmt == "gguf" else iter_safetensors(path)
        loaded = model.load_weights(weights)
        missing = [_weight_name(n, s) for n, s in model.required_weights() if (n, s) not in loaded]
        if missing:
            raise ValueError(f"checkpoint {str(path)!r} lacks weights for {', '.join(missing[:5])}"
                             f"{' ...' if len(missing) > 5 else ''}")
    model.init_rope(max_positions)
    process_weights_after_loading(model, pack_cpu=pack_cpu_weights)
    return model.eval()


def _materialize(model: DecoderLM, device: torch.device) -> DecoderLM:
    """``to_empty`` makes new Parameter objects off the meta device; keep what the layers set on them
    (``weight_loader``, ``output_dim``, ...)."""
    attrs = {name: dict(vars(p)) for name, p in model.named_parameters()}
    model.to_empty(device=device)
    for name, p in model.named_parameters():
        p.__dict__.update(attrs[name])
    return model


def _weight_name(name: str, shard) -> str:
    return name if shard is None else f"{name} (shard {shard!r})"


@torch.no_grad()
def process_weights_after_loading(model: DecoderLM, pack_cpu: bool = True) -> None:
    """Each layer's steps after loading: its format's own (repack, dequantize), then oneDNN packing of
    a dense CPU weight; a tied output projection gets a packed copy of the embedding table."""
    for layer in model.linear_layers():
        layer.process_weights_after_loading()
        if pack_cpu:
            pack_layer(layer)
    if pack_cpu:
        pack_tied_output(model)


@torch.no_grad()
def _init_dummy(model: torch.nn.Module, seed: int) -> None:
    """Deterministic random weights with sane scales: norms at one, matrices N(0, 0.02)."""
    gen = torch.Generator(device=next(model.parameters()).device).manual_seed(seed)
    for module in model.modules():
        init = getattr(getattr(module, "method", None), "init_dummy", None)
        if init is not None:  # a quantized format knows what random weights look like in it
            init(module, gen)
    for name, p in model.named_parameters():
        if not p.is_floating_point() or p.dtype.itemsize == 1 or "scale" in name:
            continue  # set by the format's init_dummy
        if "norm" in name:
            p.fill_(1.0)
        elif name.endswith("bias"):
            p.zero_()
        else:
            p.normal_(0.0, 0.02, generator=gen)
