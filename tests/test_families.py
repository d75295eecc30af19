"""The newer families beyond single-process parity (tests/test_parity.py runs those on every tiny family):
Gemma 3 multimodal checkpoints serving their text model, tensor parallelism on gloo, longrope past its
original length, and the FP8 KV cache on sliding-window layers."""

from __future__ import annotations

import logging
import random

import pytest
import torch

from kvloom import LLM, SamplingParams
from kvloom.core.config import EngineConfig
from tests.conftest import TINY_COMMON, TINY_FAMILIES, hf_greedy, make_tiny_model, make_tokenizer

MAX_NEW = 12
GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_NEW, ignore_eos=True)
NEW_FAMILIES = ["gemma2", "gemma3_text", "phi3", "phi4", "mistral_window", "qwen2_window"]


def _prompts(seed: int = 1) -> list[list[int]]:
    """A shared 16-token prefix (two blocks of 8: prefix-cache hits) and prompts several times a window."""
    rng = random.Random(seed)
    shared = [rng.randrange(3, 384) for _ in range(16)]
    return [[rng.randrange(3, 384)], shared + [rng.randrange(3, 384) for _ in range(5)],
            [rng.randrange(3, 384) for _ in range(41)], shared + [rng.randrange(3, 384) for _ in range(27)]]


def _generate(llm: LLM, prompts, params=GREEDY) -> list[list[int]]:
    return [o.token_ids for o in llm.generate(prompts, params, use_tqdm=False)]


def make_gemma3_multimodal(path):
    """A tiny Gemma3ForConditionalGeneration checkpoint: the gemma3_text model plus a small SigLIP tower."""
    import transformers

    _, _, extra = TINY_FAMILIES["gemma3_text"]
    text = transformers.Gemma3TextConfig(**{**TINY_COMMON, **extra})
    vision = transformers.SiglipVisionConfig(hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                             num_attention_heads=2, image_size=28, patch_size=14)
    config = transformers.Gemma3Config(text_config=text.to_dict(), vision_config=vision.to_dict(),
                                       mm_tokens_per_image=4, architectures=["Gemma3ForConditionalGeneration"])
    torch.manual_seed(0)
    transformers.Gemma3ForConditionalGeneration(config).eval().save_pretrained(str(path), safe_serialization=True)
    make_tokenizer(path)
    return path


def test_gemma3_multimodal_checkpoint_serves_its_text_model(tmp_path, caplog):
    path = make_gemma3_multimodal(tmp_path / "gemma3-mm")
    prompts = _prompts()
    expected = hf_greedy(path, prompts, MAX_NEW)
    with caplog.at_level(logging.INFO, logger="kvloom"):
        llm = LLM(str(path), block_size=8, max_num_batched_tokens=7, plugins=["prefix_cache"])
    assert _generate(llm, prompts) == expected
    assert _generate(llm, prompts) == expected and llm.engine.scheduler.prefix_cache_hits > 0
    assert "vision tower and projector are skipped" in caplog.text
    assert llm.engine.model.skipped_vision_tensors > 10  # the tower's tensors never reached the model


@pytest.fixture(scope="module", params=NEW_FAMILIES)
def family_model(request, tmp_path_factory):
    path = make_tiny_model(tmp_path_factory.mktemp(f"tp-{request.param}"), request.param)
    prompts = _prompts()
    return request.param, path, prompts, hf_greedy(path, prompts, MAX_NEW)


def test_tp2_greedy_parity(family_model):
    """Two ranks on gloo, each holding 3 of 6 query heads, 1 of 2 KV heads (and its share of the sinks,
    norms whole): chunked prefill (7 tokens a step, across the windows' edges), prefix-cache hits on the
    second pass and async scheduling, token for token with transformers."""
    family, path, prompts, expected = family_model
    config = EngineConfig(model=str(path), tensor_parallel_size=2, dtype="float32", block_size=8, num_kv_blocks=64,
                          max_num_batched_tokens=7, plugins=["prefix_cache"], async_scheduling="on")
    llm = LLM(config=config)
    try:
        assert _generate(llm, prompts) == expected
        assert _generate(llm, prompts) == expected
        assert llm.engine.scheduler.prefix_cache_hits > 0
        assert llm.engine.model.num_kv_heads == 1
        assert llm.engine.kv.num_free_blocks() == llm.engine.kv.num_blocks
    finally:
        llm.engine.shutdown()


def test_longrope_past_the_original_length_rotates_with_the_long_factors(tmp_path):
    """Phi-4-mini's kind (orig 96): a 90-token prompt generating 20 crosses the original length. Positions from
    it on rotate with the long factors, those before with the short ones, as transformers' model computes
    step by step over its cache. (transformers' ``generate`` differs there: at the crossing it drops the
    cache and recomputes the whole sequence with the long factors; kvloom keeps the computed KV.)"""
    from transformers import AutoModelForCausalLM, DynamicCache

    path = make_tiny_model(tmp_path / "phi4", "phi4")
    rng = random.Random(5)
    prompt = [rng.randrange(3, 384) for _ in range(90)]
    model = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()
    expected, cache = [], DynamicCache(config=model.config)
    ids = torch.tensor([prompt])
    with torch.no_grad():
        for _ in range(20):
            out = model(ids, cache=cache, use_cache=True)
            cache = out.cache if getattr(out, "cache", None) is not None else out.past_key_values
            expected.append(int(out.logits[0, -1].argmax()))
            ids = torch.tensor([[expected[-1]]])
    params = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True)
    llm = LLM(str(path), block_size=8, max_num_batched_tokens=16)
    assert _generate(llm, [prompt], params) == [expected]
    # the long factors decide those tokens: with the short ones everywhere they differ
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    model = llm.engine.model
    short, scaling = ROPE_INIT_FUNCTIONS["longrope"](model.config, torch.device("cpu"))
    freqs = torch.arange(model.cos_sin.shape[0], dtype=torch.float32)[:, None] * short[None, :]
    model.cos_sin = torch.cat([freqs.cos() * scaling, freqs.sin() * scaling], dim=-1)
    model.rope_tables = {key: model.cos_sin for key in model.rope_tables}
    assert _generate(llm, [prompt], params) != [expected]


@pytest.mark.parametrize("family", ["gemma2", "mistral_window"])
def test_fp8_kv_cache_on_sliding_layers(tmp_path, family):
    """The FP8 cache under windows (and soft-caps): half the bytes, and greedy tokens that mostly agree with
    the float32 cache (the tiny random models' logits lie close together, a hard case for rounding)."""
    path = make_tiny_model(tmp_path / family, family)
    prompts = _prompts()
    full = LLM(str(path), dtype="float32", kv_cache_memory_gib=0.01, block_size=8)
    fp8 = LLM(str(path), dtype="float32", kv_cache_memory_gib=0.01, block_size=8, kv_cache_dtype="fp8")
    assert fp8.engine.runner.kv_caches[0][0].dtype == torch.float8_e4m3fn
    want, got = _generate(full, prompts), _generate(fp8, prompts)
    same = sum(a == b for w, g in zip(want, got) for a, b in zip(w, g)) / sum(len(w) for w in want)
    assert same >= 0.75, (same, want, got)
    assert want == hf_greedy(path, prompts, MAX_NEW)
