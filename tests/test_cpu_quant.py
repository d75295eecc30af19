"""GGUF 4-bit weights kept packed on the CPU: the block decoding against gguf's own dequantizer, torch's
int4 matmul against the dequantized weight, and on the real SmolLM2 Q4_1 file the 4-bit path's greedy
choices against the dequantized bf16 path's over a real text."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from gguf.constants import GGMLQuantizationType
from gguf.quants import dequantize

from kvloom.kernels.cpu_int4 import GGUF_INT4_TYPES, dequantize_int4, gguf_int4_codes, int4_mm, int4_supported, pack_int4

needs_int4 = pytest.mark.skipif(not int4_supported(), reason="this torch has no CPU int4 matmul")


def random_blocks(type_name: str, rows: int, cols: int, rng: np.random.Generator) -> np.ndarray:
    """Valid GGUF bytes of a [rows, cols] tensor: random codes (and Q4_K sub-block scales), sane fp16 scales."""
    block, nbytes = GGUF_INT4_TYPES[type_name]
    b = rng.integers(0, 256, size=(rows * cols // block, nbytes), dtype=np.uint8)
    halves = 2 if type_name == "Q4_0" else 4
    scales = rng.uniform(-0.05, 0.05, size=(b.shape[0], halves // 2)).astype(np.float16)
    b[:, :halves] = scales.view(np.uint8).reshape(b.shape[0], halves)
    return b.reshape(rows, cols // block * nbytes)


@pytest.mark.parametrize("type_name", sorted(GGUF_INT4_TYPES))
def test_codes_scales_and_zeros_reproduce_gguf_dequantization(type_name):
    rng = np.random.default_rng(0)
    raw = random_blocks(type_name, 24, 512, rng)
    ref = dequantize(raw, GGMLQuantizationType[type_name])
    q, scale, zero = (torch.from_numpy(a) for a in gguf_int4_codes(raw, type_name, 24, 512))
    assert q.dtype == torch.uint8 and int(q.max()) <= 15 and scale.shape == (24, 16)
    torch.testing.assert_close(dequantize_int4(q, scale, zero), torch.from_numpy(ref), rtol=0, atol=1e-6)


@needs_int4
@pytest.mark.parametrize("rows", [1, 3, 8])
def test_packed_int4_matmul_equals_the_dequantized_weight(rows):
    rng = np.random.default_rng(1)
    raw = random_blocks("Q4_K", 96, 256, rng)
    q, scale, zero = (torch.from_numpy(a) for a in gguf_int4_codes(raw, "Q4_K", 96, 256))
    w = dequantize_int4(q, scale, zero)
    x = torch.randn(rows, 256, generator=torch.Generator().manual_seed(0)).bfloat16()
    packed, sz = pack_int4(q, scale, zero, torch.bfloat16)
    got = int4_mm(x, packed, sz).float()
    ref = x.float() @ w.T
    # bf16 scales/zeros and accumulation: within 1% of the output's scale
    assert (got - ref).abs().max() <= 0.01 * ref.abs().max(), (got - ref).abs().max()


TEXT = (Path(__file__).resolve().parent.parent / "docs" / "benchmarks.md").read_text()[:3000]
AGREEMENT = 0.93  # measured over 511 positions of this text (SmolLM2 Q4_1): torch int4 0.965-0.967, AMX 0.963,
# AMX grouped (the weights unrounded, so a little further from the bf16 copy's) 0.957, the dot products' loop 0.965
# and its 8-bit inputs 0.953; with the output projection's inputs at 8 bits too (a GGUF file's default on the dot
# products, as the layers'), 0.953 and 0.947
Q8_AGREEMENT = 0.99  # the 8-bit output projection against its bf16 copy, same positions: measured 1.0 (0.957 with
# its inputs at 8 bits; the layers' and the projection's inputs at 8 bits together, a GGUF file's default on the dot
# products: 0.947)


@pytest.fixture(scope="module")
def int4_llm():
    from kvloom import LLM

    return LLM(dtype="bfloat16", max_model_len=1024)


@pytest.fixture(scope="module")
def dense_llm():
    from kvloom import LLM

    return LLM(dtype="bfloat16", max_model_len=1024, gguf_int4=False)


def argmax_over_text(llm, ids):
    from kvloom import SamplingParams

    out = llm.generate([ids], SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=1), use_tqdm=False)[0]
    return [lp.top[0].token_id for lp in out.prompt_logprobs]


@pytest.mark.slow
@needs_int4
def test_int4_greedy_choices_agree_with_the_dequantized_bf16_path_over_a_real_text(int4_llm, dense_llm, monkeypatch):
    layers = int4_llm.engine.model.linear_layers()
    assert all(layer.method.name.startswith("int4 (Q4_1)") for layer in layers)  # every q/k/v/o/gate/up/down
    assert not any(hasattr(layer, "int4_weight") for layer in dense_llm.engine.model.linear_layers())
    ids = int4_llm.tokenizer.encode(TEXT)[:512]
    want = argmax_over_text(dense_llm, ids)
    # every position on one 4-bit path: torch's int4 matmul, and the AMX kernel where it serves (each a prompt
    # pass of 512 rows here, every position's rows on the path a decode step of few streams takes)
    paths = {"torch int4": (1 << 30, 1 << 30, False)} if layers[0].int4_weight.numel() else {}  # not kept: unused
    if hasattr(layers[0], "int4_amx_codes"):
        paths["AMX"] = (0, 1 << 30, False)
        # the kernel's other loop (its codes multiplied, each group's sums scaled), which serves decode steps of
        # up to GROUPED_ROWS rows: the pass handed to it that many rows at a time
        paths["AMX, grouped"] = (0, 1 << 30, False)
        if layers[0].method.int8_inputs:  # the dot products' default: every step's inputs rounded to 8 bits
            paths["8-bit inputs"] = (0, 1 << 30, True)
    saved = [(layer.method.torch_rows, layer.method.max_rows, layer.method.int8_inputs) for layer in layers]
    for name, (torch_rows, max_rows, int8_inputs) in paths.items():
        for layer in layers:
            layer.method.torch_rows, layer.method.max_rows, layer.method.int8_inputs = torch_rows, max_rows, int8_inputs
        if name == "AMX, grouped":
            from kvloom.kernels import cpu_int4_amx

            whole, rows = cpu_int4_amx.int4_amx_mm, cpu_int4_amx.GROUPED_ROWS
            monkeypatch.setattr(cpu_int4_amx, "int4_amx_mm", lambda x, *a: torch.cat(
                [whole(part, *a) for part in x.split(rows)]))
        try:
            got = argmax_over_text(int4_llm, ids)
        finally:
            monkeypatch.undo()
            for layer, (torch_rows, max_rows, int8_inputs) in zip(layers, saved):
                layer.method.torch_rows, layer.method.max_rows, layer.method.int8_inputs = (torch_rows, max_rows,
                                                                                            int8_inputs)
        share = sum(x == y for x, y in zip(got, want)) / len(got)
        assert len(got) == len(ids) - 1 and share >= AGREEMENT, (name, share)


@pytest.mark.slow
@needs_int4
def test_the_q8_output_projection_chooses_as_its_bf16_copy_over_a_real_text(int4_llm, dense_llm):
    from kvloom.core.model.cpu_packing import Q8Linear
    from kvloom.kernels import cpu_int4_amx

    head = int4_llm.engine.model.lm_head
    if not cpu_int4_amx.available():
        assert not isinstance(head, Q8Linear)
        pytest.skip("no AMX nor AVX512-BF16 here: the output projection keeps its bf16 copy only")
    assert isinstance(head, Q8Linear) and not isinstance(dense_llm.engine.model.lm_head, Q8Linear)
    ids = int4_llm.tokenizer.encode(TEXT)[:512]
    want = argmax_over_text(dense_llm, ids)
    layers = int4_llm.engine.model.linear_layers()
    saved = [layer.method.max_rows for layer in layers], head.max_rows
    for layer in layers:
        layer.method.max_rows = 0  # every linear layer on its bf16 copy, as in the dense engine
    head.max_rows = 1 << 30  # every position's logits from the 8-bit codes
    try:
        got = argmax_over_text(int4_llm, ids)
    finally:
        for layer, max_rows in zip(layers, saved[0]):
            layer.method.max_rows = max_rows
        head.max_rows = saved[1]
    # the same bf16 weights, their products summed in another order: the same choice nearly everywhere; with the
    # inputs rounded to 8 bits (a GGUF file's default on the dot products), as the layers' agreement
    share = sum(x == y for x, y in zip(got, want)) / len(got)
    assert len(got) == len(ids) - 1 and share >= (AGREEMENT if head.int8_inputs else Q8_AGREEMENT), share


@pytest.mark.slow
@needs_int4
def test_int4_decoding_answers_and_batches_like_one_at_a_time(int4_llm):
    from kvloom import SamplingParams

    sp = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    # prompts longer than INT4_MAX_ROWS tokens: each prompt pass, alone or together, runs on the bf16 copy
    texts = ("Question: what is the capital city of Italy? Answer:",
             'def fibonacci(n):\n    """Return the n-th Fibonacci number."""', "1, 2, 3, 4, 5, 6, 7, 8,")
    prompts = [int4_llm.tokenizer.encode(p) for p in texts]
    together = [o.token_ids for o in int4_llm.generate(prompts, sp, use_tqdm=False)]  # 3 rows: the 4-bit path
    alone = [int4_llm.generate([p], sp, use_tqdm=False)[0].token_ids for p in prompts]
    assert together == alone
    # (the bare question's first token is a near tie on these weights: llama.cpp answers "L'Étoile, ...")
    answer = int4_llm.chat([{"role": "user", "content": "What is the capital of France? Answer in one sentence."}],
                           SamplingParams(temperature=0.0, max_tokens=32))[0]
    assert "Paris" in answer.text


@pytest.mark.slow
def test_float32_keeps_the_dequantized_weights():
    from kvloom import LLM

    llm = LLM(dtype="float32", max_model_len=256)
    assert not any(hasattr(layer, "int4_weight") for layer in llm.engine.model.linear_layers())


def test_held_bytes_count_fused_layers_only_when_all_their_tensors_are_4_bit():
    from kvloom.kernels.cpu_int4 import int4_held_bytes

    types = {"blk.0.attn_q.weight": ("Q4_K", 64, 256), "blk.0.attn_k.weight": ("Q4_K", 32, 256),
             "blk.0.attn_v.weight": ("Q6_K", 32, 256),  # so q/k/v stay dense
             "blk.0.attn_output.weight": ("Q4_1", 256, 64), "blk.0.ffn_down.weight": ("Q8_0", 256, 64)}
    from kvloom.kernels import cpu_int4_amx

    # the AMX kernel's own copy of the codes beside torch's; on AVX512-BF16's dot products its copy alone
    codes = 2 if cpu_int4_amx.on_amx() else 1
    # o_proj alone: 256 x 64 half-bytes, and a bf16 scale and zero per 32
    assert int4_held_bytes(types, torch.bfloat16) == 256 * 64 // 2 * codes + 256 * 2 * 2 * 2
    assert int4_held_bytes(types, torch.float16) == 256 * 64 // 2 + 256 * 2 * 2 * 2


@pytest.mark.slow
def test_engine_plan_counts_the_4_bit_copies(smollm2_path):
    from kvloom.cli.plan import make_plan
    from kvloom.core.config import EngineConfig
    from kvloom.core.model.loader import load_hf_config

    hf_config = load_hf_config(smollm2_path)
    plans = {on: make_plan(EngineConfig(device="cpu", dtype="bfloat16", gguf_int4=on), hf_config, "smollm2")
             for on in (True, False)}
    extra = plans[True].rows[0].weight_bytes_per_gpu - plans[False].rows[0].weight_bytes_per_gpu
    # 30 layers x 106M linear weights at half a byte, plus scales and zeros: the 63.3 MiB the engine logs; where
    # the AMX kernel serves, its copy of the codes besides (113.9 MiB),
    from kvloom.kernels import cpu_int4_amx

    # and the output projection's Q8_0 codes and scales (28.7 MiB); where it runs on AVX512-BF16's dot products,
    # its copy of the codes instead of torch's (63.3 MiB) and the output projection's
    if cpu_int4_amx.on_amx():
        low, high = 139 << 20, 146 << 20
    elif cpu_int4_amx.available():
        low, high = 89 << 20, 95 << 20
    else:
        low, high = 60 << 20, 66 << 20
    assert low < extra < high, extra


def test_cpu_kv_cache_memory_is_resident_only_where_written():
    from kvloom.core.worker.model_runner import make_kv_caches

    def rss_mib() -> float:
        return next(int(x.split()[1]) for x in open("/proc/self/status") if x.startswith("VmRSS")) / 1024

    before = rss_mib()
    caches = make_kv_caches(8, (512, 32, 4, 64), torch.bfloat16, torch.device("cpu"))  # 256 MiB reserved
    k, v = caches[0]
    assert k.abs().sum() == 0 and v.shape == (512, 32, 4, 64)  # zeroed as before
    k[3] = 1.0  # a written block reads back
    assert float(k[3].sum()) == 32 * 4 * 64 and float(k[4].sum()) == 0
    assert rss_mib() - before < 64
