"""FP8 checkpoints' KV-cache scales (``self_attn.k_scale``/``v_scale`` as vLLM and compressed-tensors save
them, ``k_proj.k_scale``/``v_proj.v_scale`` as ModelOpt does, one ``kv_scale`` for both): loaded into the
attention layers and used by the fp8 cache, which then stores ``x / scale``. The reference is Hugging Face
transformers in float32 whose KV cache rounds K and V through e4m3 with the same scales."""

from __future__ import annotations

import logging
import shutil

import pytest
import torch

from kvloom import LLM, SamplingParams

PROMPTS = [[5, 17, 42, 99, 3, 64, 28, 11], [200, 7, 7, 150, 31]]
NEW_TOKENS = 14
FP8_MAX = 448.0


def fake_quantize(x: torch.Tensor, scale: float) -> torch.Tensor:
    """``x`` stored in an e4m3 cache with ``scale`` and read back (``reference.quantize_kv``/``dequantize_kv``)."""
    return (x.float() * (1.0 / scale)).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn).float() * scale


def hf_greedy_fp8_cache(path, prompts, scales: dict[int, tuple[float, float]]) -> list[list[int]]:
    """transformers' greedy tokens with a KV cache that stores e4m3 with per-layer (k_scale, v_scale). As
    in kvloom, a prompt attends to its own fresh K/V; every later step reads the cache, its token included."""
    from transformers import AutoModelForCausalLM, DynamicCache

    class FP8Cache(DynamicCache):
        def update(self, key_states, value_states, layer_idx, *args, **kwargs):
            fresh = self.get_seq_length(layer_idx) == 0
            ks, vs = scales.get(layer_idx, (1.0, 1.0))
            keys, values = super().update(fake_quantize(key_states, ks), fake_quantize(value_states, vs),
                                          layer_idx, *args, **kwargs)
            return (key_states, value_states) if fresh else (keys, values)

    model = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()
    model.generation_config.eos_token_id = None
    outs = []
    with torch.no_grad():
        for p in prompts:
            ids = torch.tensor([p])
            gen = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=NEW_TOKENS, do_sample=False,
                                 pad_token_id=0, past_key_values=FP8Cache())
            outs.append(gen[0, len(p):].tolist())
    return outs


def with_tensors(src, dst, extra: dict[str, torch.Tensor]):
    """A copy of the checkpoint folder ``src`` with ``extra`` tensors added to its safetensors file."""
    from safetensors.torch import load_file, save_file

    shutil.copytree(src, dst)
    tensors = load_file(str(dst / "model.safetensors"))
    tensors.update(extra)
    save_file(tensors, str(dst / "model.safetensors"), metadata={"format": "pt"})
    return dst


# Layer 0: scales so small that most of K and V saturate at +-448; layer 1: so large that they fall among
# e4m3's coarse subnormals. Either way far from what a cache that assumes 1.0 stores.
SCALES = {0: (0.0005, 0.0004), 1: (0.5, 0.8)}
NAMINGS = {
    "vllm": lambda i, w: f"model.layers.{i}.self_attn.{w}_scale",
    "modelopt": lambda i, w: f"model.layers.{i}.self_attn.{w}_proj.{w}_scale",
    "autofp8": lambda i, w: f"model.layers.{i}.self_attn.{w}_proj.output_scale",
}


def generate(llm) -> list[list[int]]:
    params = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True)
    return [o.token_ids for o in llm.generate(PROMPTS, params, use_tqdm=False)]


@pytest.fixture(scope="module")
def reference(tiny_llama):
    return {"scaled": hf_greedy_fp8_cache(tiny_llama, PROMPTS, SCALES), "unit": hf_greedy_fp8_cache(tiny_llama, PROMPTS, {})}


def test_the_scales_change_what_the_reference_generates(reference):
    # so that the test below would fail if kvloom ignored the checkpoint's scales
    assert reference["scaled"] != reference["unit"]


@pytest.mark.parametrize("naming", sorted(NAMINGS))
def test_checkpoint_kv_scales_give_the_reference_tokens(tiny_llama, tmp_path, reference, naming, caplog):
    name = NAMINGS[naming]
    extra = {name(i, w): torch.tensor(s[j]) for i, s in SCALES.items() for j, w in enumerate("kv")}
    path = with_tensors(tiny_llama, tmp_path / "scaled", extra)
    with caplog.at_level(logging.INFO, logger="kvloom"):
        llm = LLM(str(path), dtype="float32", kv_cache_memory_gib=0.01, kv_cache_dtype="fp8")
    assert [(a.k_scale, a.v_scale) for a in (layer.self_attn for layer in llm.engine.model.layers)] == \
        [pytest.approx(SCALES[0]), pytest.approx(SCALES[1])]
    assert "KV-cache scales from the checkpoint" in caplog.text and "2/2 layers" in caplog.text
    assert generate(llm) == reference["scaled"]


def test_one_kv_scale_for_both_and_layers_without_scales(tiny_llama, tmp_path):
    path = with_tensors(tiny_llama, tmp_path / "kv", {"model.layers.1.self_attn.kv_scale": torch.tensor([0.5])})
    llm = LLM(str(path), dtype="float32", kv_cache_memory_gib=0.01, kv_cache_dtype="fp8")
    layers = [layer.self_attn for layer in llm.engine.model.layers]
    assert [(a.k_scale, a.v_scale) for a in layers] == [(1.0, 1.0), (0.5, 0.5)]
    assert generate(llm) == hf_greedy_fp8_cache(tiny_llama, PROMPTS, {1: (0.5, 0.5)})


def test_a_full_precision_cache_loads_the_scales_and_ignores_them(tiny_llama, tmp_path):
    from tests.conftest import hf_greedy

    extra = {NAMINGS["vllm"](i, w): torch.tensor(s[j]) for i, s in SCALES.items() for j, w in enumerate("kv")}
    path = with_tensors(tiny_llama, tmp_path / "scaled", extra)
    llm = LLM(str(path), dtype="float32", kv_cache_memory_gib=0.01)
    assert generate(llm) == hf_greedy(tiny_llama, PROMPTS, NEW_TOKENS)


@pytest.mark.parametrize("tensor,message", [
    (torch.tensor(-0.5), "must be positive and finite"),
    (torch.tensor(float("nan")), "must be positive and finite"),
    (torch.ones(2), "per-head or per-channel KV scales are not supported"),
])
def test_a_bad_kv_scale_is_a_load_error_naming_the_tensor(tiny_llama, tmp_path, tensor, message):
    path = with_tensors(tiny_llama, tmp_path / "bad", {"model.layers.0.self_attn.k_scale": tensor})
    with pytest.raises(ValueError, match=message) as e:
        LLM(str(path), dtype="float32", kv_cache_memory_gib=0.01, kv_cache_dtype="fp8")
    assert "model.layers.0.self_attn.k_scale" in str(e.value)
