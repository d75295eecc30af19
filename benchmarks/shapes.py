"""Real model shapes for benchmarks with dummy weights (no checkpoint download needed), and the
matching Hugging Face transformers model that every benchmark runs beside kvloom."""

from __future__ import annotations

import json
import tempfile
from pathlib import Path

SHAPES = {
    "llama-3-8b": dict(
        architectures=["LlamaForCausalLM"], model_type="llama", hidden_size=4096, intermediate_size=14336,
        num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8, vocab_size=128256,
        max_position_embeddings=8192, rms_norm_eps=1e-5, rope_theta=500000.0, tie_word_embeddings=False,
        bos_token_id=128000, eos_token_id=128001,
    ),
    "llama-2-7b": dict(
        architectures=["LlamaForCausalLM"], model_type="llama", hidden_size=4096, intermediate_size=11008,
        num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=32, vocab_size=32000,
        max_position_embeddings=4096, rms_norm_eps=1e-5, rope_theta=10000.0, tie_word_embeddings=False,
        bos_token_id=1, eos_token_id=2,
    ),
    "qwen3-0.6b": dict(
        architectures=["Qwen3ForCausalLM"], model_type="qwen3", hidden_size=1024, intermediate_size=3072,
        num_hidden_layers=28, num_attention_heads=16, num_key_value_heads=8, head_dim=128, vocab_size=151936,
        max_position_embeddings=40960, rms_norm_eps=1e-6, rope_theta=1000000.0, tie_word_embeddings=True,
        bos_token_id=151643, eos_token_id=151645,
    ),
    # Mixture-of-experts shapes (config.json of the published checkpoints, trimmed to what kvloom reads).
    "mixtral-8x7b": dict(
        architectures=["MixtralForCausalLM"], model_type="mixtral", hidden_size=4096, intermediate_size=14336,
        num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8, vocab_size=32000,
        num_local_experts=8, num_experts_per_tok=2, max_position_embeddings=32768, rms_norm_eps=1e-5,
        rope_theta=1000000.0, tie_word_embeddings=False, bos_token_id=1, eos_token_id=2,
    ),
    "qwen3-30b-a3b": dict(
        architectures=["Qwen3MoeForCausalLM"], model_type="qwen3_moe", hidden_size=2048, intermediate_size=6144,
        moe_intermediate_size=768, num_hidden_layers=48, num_attention_heads=32, num_key_value_heads=4,
        head_dim=128, vocab_size=151936, num_experts=128, num_experts_per_tok=8, norm_topk_prob=True,
        decoder_sparse_step=1, mlp_only_layers=[], max_position_embeddings=40960, rms_norm_eps=1e-6,
        rope_theta=1000000.0, tie_word_embeddings=False, bos_token_id=151643, eos_token_id=151645,
    ),
    "gpt-oss-20b": dict(
        architectures=["GptOssForCausalLM"], model_type="gpt_oss", hidden_size=2880, intermediate_size=2880,
        num_hidden_layers=24, num_attention_heads=64, num_key_value_heads=8, head_dim=64, vocab_size=201088,
        num_local_experts=32, num_experts_per_tok=4, sliding_window=128, attention_bias=True,
        layer_types=["sliding_attention", "full_attention"] * 12, max_position_embeddings=131072,
        rope_scaling={"rope_type": "yarn", "factor": 32.0, "beta_fast": 32.0, "beta_slow": 1.0,
                      "truncate": False, "original_max_position_embeddings": 4096},
        rope_theta=150000.0, rms_norm_eps=1e-5, swiglu_limit=7.0, tie_word_embeddings=False,
        bos_token_id=199998, eos_token_id=200002,
    ),
}


def shape_folder(name: str) -> Path:
    """A folder holding just the config.json of a known shape (enough for ``--load-format dummy``)."""
    if name not in SHAPES:
        raise SystemExit(f"unknown shape {name!r}; known: {sorted(SHAPES)}")
    folder = Path(tempfile.gettempdir()) / "kvloom-shapes" / name
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(SHAPES[name], indent=2))
    return folder


def model_for_benchmark(model: str | None, shape: str | None) -> tuple[str, str, int]:
    """(model path or name, load format, vocab size) for the benchmark's arguments."""
    if shape:
        return str(shape_folder(shape)), "dummy", SHAPES[shape]["vocab_size"]
    from kvloom.core.config import DEFAULT_MODEL
    from kvloom.core.model.files import resolve_model
    from kvloom.core.model.loader import load_hf_config

    model = model or DEFAULT_MODEL
    return model, "auto", load_hf_config(resolve_model(model)).vocab_size


def load_transformers_model(model: str, load_format: str, dtype_name: str = "auto"):
    """The same model in transformers, on the GPU if there is one: same weights (or, for dummy
    weights, the same shape), EOS disabled so it generates exactly what it is asked for."""
    import torch
    from transformers import AutoModelForCausalLM

    from kvloom.core.model.files import resolve_model
    from kvloom.core.model.loader import load_hf_config

    path = resolve_model(model)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    dtype = {"auto": torch.bfloat16 if device == "cuda" else torch.float32, "float32": torch.float32,
             "bfloat16": torch.bfloat16, "float16": torch.float16}[dtype_name]
    if load_format == "dummy":
        with torch.device(device):
            hf = AutoModelForCausalLM.from_config(load_hf_config(path), dtype=dtype)
    elif path.suffix == ".gguf":
        hf = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=dtype).to(device)
    else:
        hf = AutoModelForCausalLM.from_pretrained(str(path), dtype=dtype).to(device)
    hf.eval()
    hf.generation_config.eos_token_id = None
    return hf, device


def kernel_options(items: list[str]) -> dict:
    """``NAME=VALUE`` each, VALUE in JSON (``pdl=false``, ``int4_row_min_weight=0``,
    ``fp8_row_tiles=[[16777216, {"BLOCK_N": 8, ...}]]``): the engine's ``kernel_options``
    (kvloom/kernels/options.py) for ``--kernel-option``; a bad name or value exits naming it."""
    from kvloom.kernels.options import KernelOptions

    options = {}
    for item in items:
        name, sep, value = item.partition("=")
        try:
            options[name] = json.loads(value) if sep else None
            if not sep:
                raise ValueError("expected NAME=VALUE")
        except ValueError as e:
            raise SystemExit(f"--kernel-option {item!r}: {e}") from None
    try:
        KernelOptions.from_mapping(options)
    except ValueError as e:
        raise SystemExit(f"--kernel-option: {e}") from None
    return options
