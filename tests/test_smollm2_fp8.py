"""SmolLM2-135M-Instruct with ``--quantization fp8`` (its GGUF weights dequantized, then quantized to
FP8 per channel at load): it still answers, and its greedy choices over a real text mostly agree with
the bf16 model's."""

from __future__ import annotations

import pytest
import torch

from kvloom import LLM, SamplingParams
from kvloom.core.model.attention.base import AttentionMetadata

pytestmark = pytest.mark.slow

TEXT = (
    "The Industrial Revolution began in Great Britain in the late eighteenth century and spread to Europe and "
    "North America over the following decades. Steam engines, powered by coal, replaced water wheels and "
    "animal labour in mills and mines. Railways cut the time needed to move goods and people between cities, "
    "and the factory system changed where and how people worked. Historians still debate why the changes "
    "started in Britain: cheap coal, high wages, a stable banking system and access to colonial markets are "
    "all part of the answer. Life in the new industrial towns was often hard. Workers, including children, "
    "spent long hours at machines, and housing was crowded and unhealthy. Over time, reform movements won "
    "shorter working days, public schools and better sanitation."
)
# Share of positions where the FP8 model's argmax equals bf16's over TEXT: measured 0.895 (128 of 143)
# on this project's CPU, both in bfloat16; asserted with a margin for other CPUs' bf16 rounding.
MIN_AGREEMENT = 0.85


@pytest.fixture(scope="module")
def llm_fp8():
    return LLM(quantization="fp8", dtype="bfloat16", kv_cache_memory_gib=0.25)  # ample here


@pytest.fixture(scope="module")
def llm_bf16():
    return LLM(dtype="bfloat16", kv_cache_memory_gib=0.25)


@torch.inference_mode()
def argmax_at_every_position(llm, ids: list[int]) -> torch.Tensor:
    """The model's greedy choice after each prefix of ``ids`` (one prefill over the whole text)."""
    engine = llm.engine
    n, bs = len(ids), engine.config.block_size
    blocks = -(-n // bs)
    shape = engine.attention_backend.kv_cache_shape(blocks, bs, engine.model.num_kv_heads, engine.model.head_dim)
    caches = [(torch.zeros(shape, dtype=engine.dtype), torch.zeros(shape, dtype=engine.dtype))
              for _ in engine.model.layers]
    meta = AttentionMetadata(
        slot_mapping=torch.arange(n), block_tables=torch.arange(blocks, dtype=torch.int32)[None],
        seq_lens=torch.tensor([n], dtype=torch.int32), query_start_loc=torch.tensor([0, n], dtype=torch.int32),
        num_decodes=0, max_query_len=n, max_seq_len=n, query_lens_cpu=[n], seq_lens_cpu=[n])
    hidden = engine.model(torch.tensor(ids), torch.arange(n), meta, caches)
    return engine.model.compute_logits(hidden).argmax(-1)


def test_fp8_answers_paris(llm_fp8):
    assert llm_fp8.engine.quantization.name == "fp8"
    out = llm_fp8.chat([{"role": "user", "content": "What is the capital of France?"}],
                       SamplingParams(temperature=0.0, max_tokens=32))[0]
    assert "Paris" in out.text


def test_fp8_greedy_choices_agree_with_bf16_over_a_real_text(llm_fp8, llm_bf16):
    ids = llm_bf16.tokenizer.encode(TEXT)
    assert len(ids) > 120
    fp8, bf16 = argmax_at_every_position(llm_fp8, ids), argmax_at_every_position(llm_bf16, ids)
    agreement = (fp8 == bf16).float().mean().item()
    print(f"fp8 vs bf16 greedy agreement over {len(ids)} positions: {agreement:.3f}")
    assert agreement >= MIN_AGREEMENT, agreement
    assert agreement < 1.0  # the FP8 rounding is real
