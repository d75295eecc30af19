"""Shared fixtures: tiny random models of each family (saved as Hugging Face folders with a locally
made tokenizer) and the real SmolLM2 GGUF file."""

from __future__ import annotations

import ctypes
import gc
import json
import os
from pathlib import Path

# The engine compiles its CPU steps at start-up (tens of seconds a model); the suite starts hundreds of
# engines, so it runs them eagerly, child processes included (torch reads this once, at import), and
# tests/test_cpu_compile.py turns compiling back on where it is under test.
os.environ["TORCH_COMPILE_DISABLE"] = "1"
# oneDNN's primitive cache and ideep's above it keep an entry, with its memory, per matmul shape (set before
# torch loads): the suite's hundreds of tiny models of odd shapes filled the default 1,024 entries in pytest and its
# engines, hundreds of MB that stayed to the end. The engine's own cap (cpu_threads.ONEDNN_ENVIRONMENT) is for
# one model's shapes; a few entries are enough for a test's.
os.environ.setdefault("ONEDNN_PRIMITIVE_CACHE_CAPACITY", "16")
os.environ.setdefault("LRU_CACHE_CAPACITY", "16")

import pytest  # noqa: E402
import torch  # noqa: E402  (not torch._dynamo: it imports triton, which tests/kernels must load interpreted)

TINY_COMMON = dict(
    hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
    max_position_embeddings=512, rms_norm_eps=1e-6, vocab_size=384, bos_token_id=1, eos_token_id=2,
    pad_token_id=0, initializer_range=0.1,
)

ODD_SHAPES = dict(hidden_size=72, intermediate_size=100, num_attention_heads=6, num_key_value_heads=2, vocab_size=386)

TINY_FAMILIES = {
    # Llama with Llama-3 rope scaling and untied embeddings.
    "llama": ("LlamaConfig", "LlamaForCausalLM", dict(
        tie_word_embeddings=False,
        rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                      "original_max_position_embeddings": 128},
        rope_theta=500000.0)),
    # Qwen2: q/k/v biases, tied embeddings.
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", dict(tie_word_embeddings=True, rope_theta=10000.0)),
    # Mistral: the Llama layout under its own architecture name (no sliding window in this config).
    "mistral": ("MistralConfig", "MistralForCausalLM", dict(tie_word_embeddings=False, sliding_window=None)),
    # Qwen3: per-head q/k norms and a head_dim that is not hidden/heads.
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", dict(tie_word_embeddings=False, head_dim=32, rope_theta=10000.0)),
    # The families with sliding windows, soft-capping, fused checkpoints: odd shapes (6 heads over 2 KV heads,
    # head sizes 24/12/16, an MLP of 100, a vocabulary of 386) and windows several times shorter than the
    # parity prompts (up to 70 tokens, 20 more generated).
    # Gemma 2: (1 + w) norms on both sides of attention and MLP, GeGLU, scaled embeddings, query_pre_attn_scalar,
    # soft-capped scores and logits (caps low enough to bend random scores), a window on alternate layers.
    "gemma2": ("Gemma2Config", "Gemma2ForCausalLM", dict(
        ODD_SHAPES, num_hidden_layers=4, head_dim=24, sliding_window=8, query_pre_attn_scalar=20,
        attn_logit_softcapping=4.0, final_logit_softcapping=5.0, tie_word_embeddings=True)),
    # Gemma 3: q/k norms, local layers with a 7-token window and base 10k, a global one with linear-scaled
    # base 1e6 (five-to-one in the real models; here sliding, sliding, global, sliding).
    "gemma3_text": ("Gemma3TextConfig", "Gemma3ForCausalLM", dict(
        ODD_SHAPES, num_hidden_layers=4, head_dim=24, sliding_window=7, query_pre_attn_scalar=24,
        layer_types=["sliding_attention", "sliding_attention", "full_attention", "sliding_attention"],
        rope_parameters={"full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1_000_000.0},
                         "sliding_attention": {"rope_type": "default", "rope_theta": 10_000.0}},
        tie_word_embeddings=True)),
    # Phi-3-mini-4k's kind: q/k/v and gate/up fused in the checkpoint, an 11-token window on every layer.
    "phi3": ("Phi3Config", "Phi3ForCausalLM", dict(
        ODD_SHAPES, num_hidden_layers=3, sliding_window=11, tie_word_embeddings=False)),
    # Phi-4-mini's kind: partial rotary (12 of 16 dims), longrope (its original length, 96, is past the
    # parity sequences: transformers' generate recomputes a sequence's cache with the long factors when it
    # crosses it, see test_families.py), tied embeddings.
    "phi4": ("Phi3Config", "Phi3ForCausalLM", dict(
        ODD_SHAPES, hidden_size=96, num_hidden_layers=2, tie_word_embeddings=True, partial_rotary_factor=0.75,
        original_max_position_embeddings=96,
        rope_scaling={"rope_type": "longrope", "short_factor": [1.0, 1.1, 1.3, 1.6, 2.0, 2.5],
                      "long_factor": [1.5, 2.0, 3.0, 4.5, 6.0, 8.0], "original_max_position_embeddings": 96})),
    # Mistral v0.1's kind: a 9-token window on every layer.
    "mistral_window": ("MistralConfig", "MistralForCausalLM", dict(ODD_SHAPES, sliding_window=9,
                                                                   tie_word_embeddings=False)),
    # Qwen2 with use_sliding_window: full attention below max_window_layers, a 12-token window above.
    "qwen2_window": ("Qwen2Config", "Qwen2ForCausalLM", dict(
        ODD_SHAPES, num_hidden_layers=3, use_sliding_window=True, sliding_window=12, max_window_layers=1,
        tie_word_embeddings=True)),
}

# Mixture-of-experts families (tests/test_moe.py, tests/test_families_moe.py): odd shapes, odd expert counts,
# top-k 2 and 4, the shared expert on (Qwen2-MoE) and off, norm_topk_prob both ways, dense layers among the sparse;
# untied and with larger weights than the dense families', so that greedy tokens vary instead of repeating.
MOE_FAMILIES = {
    # Mixtral: 6 experts, top-2, always renormalised; a window on every layer shorter than the long prompts.
    "mixtral": ("MixtralConfig", "MixtralForCausalLM", dict(
        ODD_SHAPES, intermediate_size=40, num_local_experts=6, num_experts_per_tok=2, sliding_window=13,
        tie_word_embeddings=False, initializer_range=0.2)),
    # Qwen2-MoE: 10 experts, top-4 not renormalised, a shared expert behind its sigmoid gate, q/k/v biases, and
    # layer 1 a dense MLP (mlp_only_layers).
    "qwen2_moe": ("Qwen2MoeConfig", "Qwen2MoeForCausalLM", dict(
        ODD_SHAPES, num_hidden_layers=3, num_experts=10, num_experts_per_tok=4, moe_intermediate_size=24,
        shared_expert_intermediate_size=36, norm_topk_prob=False, mlp_only_layers=[1], tie_word_embeddings=False,
        initializer_range=0.2)),
    # Qwen3-MoE: q/k norms, 10 experts, top-4 renormalised, sparse on every second layer (decoder_sparse_step=2).
    "qwen3_moe": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM", dict(
        ODD_SHAPES, num_hidden_layers=3, head_dim=16, num_experts=10, num_experts_per_tok=4,
        moe_intermediate_size=24, norm_topk_prob=True, decoder_sparse_step=2, tie_word_embeddings=False,
        initializer_range=0.2)),
    # gpt-oss: 6 experts, top-2 of the biased logits, a clamp low enough to cut random activations, biases
    # everywhere, sinks, a 6-token window on alternate layers, yarn.
    "gpt_oss": ("GptOssConfig", "GptOssForCausalLM", dict(
        ODD_SHAPES, num_hidden_layers=3, head_dim=12, num_local_experts=6, num_experts_per_tok=2,
        intermediate_size=32, sliding_window=6, swiglu_limit=1.2, swiglu_alpha=1.5, tie_word_embeddings=False,
        initializer_range=0.2,
        rope_parameters={"rope_type": "yarn", "factor": 8.0, "beta_fast": 32.0, "beta_slow": 1.0, "truncate": False,
                         "original_max_position_embeddings": 64, "rope_theta": 150000.0})),
}

CORPUS = [
    "The quick brown fox jumps over the lazy dog.",
    "Paris is the capital of France. Berlin is the capital of Germany.",
    "kvloom schedules tokens, not phases: prefill and decode share one batch.",
    "Numbers: 0 1 2 3 4 5 6 7 8 9 10 100 1000. Unicode: café, naïve, 東京, 🚀.",
]


def make_tokenizer(path: Path) -> None:
    """A small byte-level BPE tokenizer with a chat template, saved as a Hugging Face tokenizer."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=320, special_tokens=["<pad>", "<s>", "</s>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False,
    )
    tok.train_from_iterator(CORPUS * 4, trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", pad_token="<pad>")
    fast.chat_template = (
        "{% for m in messages %}<s>{{ m['role'] }}: {{ m['content'] }}</s>{% endfor %}"
        "{% if add_generation_prompt %}<s>assistant:{% endif %}"
    )
    fast.save_pretrained(str(path))


def make_tiny_model(path: Path, family: str, seed: int = 0, max_shard_size: str | None = None) -> Path:
    import transformers

    cls_name, arch, extra = {**TINY_FAMILIES, **MOE_FAMILIES}[family]
    config = getattr(transformers, cls_name)(**{**TINY_COMMON, **extra}, architectures=[arch])
    torch.manual_seed(seed)
    model = getattr(transformers, arch)(config).eval()
    if family in MOE_FAMILIES:  # transformers starts biases at zero: random ones show where each one lands
        with torch.no_grad():
            for name, p in model.named_parameters():
                if name.endswith("bias") and not p.any():
                    p.normal_(0.0, 0.2)
    if family == "gpt_oss":
        # older transformers (5.17) computes gpt-oss's clamp with its constants (alpha 1.702, limit 7.0), whatever
        # the config says: there the saved config carries those, so kvloom and the reference compute alike
        experts = model.model.layers[0].mlp.experts
        config.swiglu_alpha, config.swiglu_limit = experts.alpha, experts.limit
    kwargs = {"max_shard_size": max_shard_size} if max_shard_size else {}
    model.save_pretrained(str(path), safe_serialization=True, **kwargs)
    make_tokenizer(path)
    return path


def _malloc_trim() -> None:
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):  # not glibc: nothing was kept
        pass


@pytest.fixture(scope="module", autouse=True)
def _return_freed_memory_after_each_module():
    """Hand the memory a module's in-process engines freed back to the system: an engine raises glibc's trim
    threshold (cpu_malloc.keep_freed_memory), so a dropped engine's KV cache stays in pytest's heap, and
    freeze_startup_heap hides what it froze from the collector. Without this, pytest keeps the largest heap
    of any module it ran and the suite's peak memory adds up across modules."""
    yield
    gc.unfreeze()
    gc.collect()
    _malloc_trim()


@pytest.fixture(autouse=True)
def _return_freed_memory_after_each_test():
    """The same after each test, without the collection (milliseconds): engines a test dropped leave pytest
    before the next test starts servers of its own."""
    yield
    _malloc_trim()


@pytest.fixture(scope="session", params=sorted(TINY_FAMILIES))
def tiny_model(request, tmp_path_factory) -> Path:
    return make_tiny_model(tmp_path_factory.mktemp(f"tiny-{request.param}"), request.param)


@pytest.fixture(scope="session")
def tiny_llama(tmp_path_factory) -> Path:
    return make_tiny_model(tmp_path_factory.mktemp("tiny-llama"), "llama")


@pytest.fixture(scope="session")
def smollm2_path() -> Path:
    from kvloom.core.model.files import default_model_path

    return default_model_path()


def hf_greedy(path: Path, prompts: list[list[int]], max_new_tokens: int) -> list[list[int]]:
    """Hugging Face transformers' greedy continuation of each prompt (batch of one, EOS ignored)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()
    model.generation_config.eos_token_id = None  # generate exactly max_new_tokens, EOS included
    outs = []
    with torch.no_grad():
        for p in prompts:
            ids = torch.tensor([p])
            gen = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens,
                                 do_sample=False, pad_token_id=0)
            outs.append(gen[0, len(p):].tolist())
    return outs


def read_json(path: Path) -> dict:
    return json.loads(Path(path).read_text())
