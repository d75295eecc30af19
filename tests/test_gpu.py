"""GPU checks (run on the H200; skipped without CUDA): greedy parity with transformers in bf16 with
the Triton backend and CUDA graphs."""

from __future__ import annotations

import random

import pytest
import torch

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


PROMPT_LENGTHS = (3, 9, 17, 40, 64, 100, 130, 7)


def _prompts():
    rng = random.Random(0)
    return [[rng.randrange(3, 384) for _ in range(n)] for n in PROMPT_LENGTHS]


def test_float32_greedy_parity_is_exact_on_gpu(tiny_llama):
    """Same kernels, graphs and scheduling as bf16, but in float32: token for token like the CPU."""
    from kvloom import LLM, SamplingParams
    from tests.conftest import hf_greedy

    prompts = _prompts()
    expected = hf_greedy(tiny_llama, prompts, 16)  # float32 on the CPU: the reference
    llm = LLM(str(tiny_llama), dtype="float32", device="cuda", max_num_seqs=16, kv_cache_memory_gib=0.25)
    assert llm.engine.runner.graphs, "CUDA graphs were not captured"
    outs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True), use_tqdm=False)
    assert [o.token_ids for o in outs] == expected
    # Chunked prefill (mixed prefill/decode batches through the prefill kernel) too.
    llm = LLM(str(tiny_llama), dtype="float32", device="cuda", max_num_seqs=16, max_num_batched_tokens=24,
              kv_cache_memory_gib=0.25)
    outs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True), use_tqdm=False)
    assert [o.token_ids for o in outs] == expected


@pytest.mark.parametrize("family", ["gemma2", "gemma3_text", "phi3", "phi4", "mistral_window", "qwen2_window",
                                    "mixtral", "qwen2_moe", "qwen3_moe", "gpt_oss"])
def test_newer_families_are_exact_on_gpu(family, tmp_path):
    """The newer families through the Triton kernels (sliding windows, soft-caps, sinks, odd head sizes, the
    fused MoE) with CUDA graphs, chunked prefill across the windows' edges and prefix-cache hits, in float32:
    token for token like transformers on the CPU."""
    from kvloom import LLM, SamplingParams
    from tests.conftest import hf_greedy, make_tiny_model

    path = make_tiny_model(tmp_path / family, family)
    rng = random.Random(1)
    shared = [rng.randrange(3, 384) for _ in range(16)]
    prompts = [[rng.randrange(3, 384)], shared + [rng.randrange(3, 384) for _ in range(5)],
               [rng.randrange(3, 384) for _ in range(41)], shared + [rng.randrange(3, 384) for _ in range(27)]]
    expected = hf_greedy(path, prompts, 12)
    llm = LLM(str(path), dtype="float32", device="cuda", block_size=8, max_num_batched_tokens=7,
              plugins=["prefix_cache"], kv_cache_memory_gib=0.25)
    assert llm.engine.runner.graphs, "CUDA graphs were not captured"
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    for _ in range(2):
        assert [o.token_ids for o in llm.generate(prompts, params, use_tqdm=False)] == expected
    assert llm.engine.scheduler.prefix_cache_hits > 0


def test_bf16_greedy_parity_with_transformers_on_gpu(tiny_llama):
    from transformers import AutoModelForCausalLM

    from kvloom import LLM, SamplingParams

    prompts = _prompts()
    hf = AutoModelForCausalLM.from_pretrained(str(tiny_llama), dtype=torch.bfloat16).cuda().eval()
    hf.generation_config.eos_token_id = None
    expected, hf_first_logprobs = [], []
    with torch.no_grad():
        for p in prompts:
            ids = torch.tensor([p], device="cuda")
            out = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=16, do_sample=False,
                              pad_token_id=0, output_scores=True, return_dict_in_generate=True)
            expected.append(out.sequences[0, len(p):].tolist())
            hf_first_logprobs.append(torch.log_softmax(out.scores[0][0].float(), -1))

    llm = LLM(str(tiny_llama), dtype="bfloat16", device="cuda", max_num_seqs=16, kv_cache_memory_gib=0.25)
    assert llm.engine.runner.graphs, "CUDA graphs were not captured"
    assert llm.engine.model.layers[0].self_attn.backend.name == "triton"
    outs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True, logprobs=5),
                        use_tqdm=False)
    # bf16 rounding differs between any two implementations, so a near-tie can flip a later token:
    # the first token must agree everywhere and whole sequences on most prompts.
    assert all(o.token_ids[0] == e[0] for o, e in zip(outs, expected))
    same = sum(o.token_ids == e for o, e in zip(outs, expected))
    assert same > len(prompts) // 2, f"only {same}/{len(prompts)} prompts matched transformers token for token"
    for out, ref in zip(outs, hf_first_logprobs):
        first = out.outputs[0].logprobs[0]
        for top in first.top:
            assert abs(top.logprob - ref[top.token_id].item()) < 0.1


def test_programmatic_dependent_launch_changes_no_output_on_gpu(tiny_llama):
    """The decode step's kernels launched with PDL (each waits for its predecessor inside the kernel)
    give the same tokens and logprobs, bit for bit, as launched one after another: a missing wait would
    show up as a race between a kernel and the one before it."""
    from kvloom import LLM, SamplingParams
    from kvloom.kernels.pdl import pdl_enabled

    if not pdl_enabled(torch.empty(1, device="cuda")):
        pytest.skip("PDL needs compute capability 9.0 (Hopper) or newer")
    prompts = _prompts()
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True, logprobs=3)
    runs = {}
    for pdl in (True, False):
        llm = LLM(str(tiny_llama), dtype="bfloat16", device="cuda", max_num_seqs=16, kv_cache_memory_gib=0.25,
                  kernel_options={"pdl": pdl})
        assert llm.engine.runner.graphs, "CUDA graphs were not captured"
        outs = llm.generate(prompts, params, use_tqdm=False)
        runs[pdl] = [(o.token_ids, [[(t.token_id, t.logprob) for t in lp.top] for lp in o.outputs[0].logprobs])
                     for o in outs]
        del llm
    assert runs[True] == runs[False]


@pytest.mark.parametrize("name", ["awq-llama-g32", "ct-fp8-llama-tensor"])
def test_silu_and_mul_fused_into_quantized_one_row_decode_changes_no_token_on_gpu(name, tmp_path, monkeypatch):
    """Decoding one request at a time, the merged gate/up layer's GEMV stores silu(gate) * up itself (one
    kernel less a layer); in float32 the tokens are those of the GEMV followed by the SiLU-and-mul kernel."""
    from kvloom import LLM, SamplingParams
    from kvloom.core.model.quantization.fp8 import FP8LinearMethod
    from kvloom.core.model.quantization.packed_int import PackedIntLinearMethod
    from tests.quant_checkpoints import write_checkpoint
    from tests.test_quantization import CASES

    family, fmt, settings = CASES[name]
    quant, _ = write_checkpoint(tmp_path, family, fmt, **settings)
    cls = FP8LinearMethod if "fp8" in fmt else PackedIntLinearMethod
    fused = []
    original = cls.apply_silu_and_mul

    def counted(self, layer, x):
        out = original(self, layer, x)
        fused.append(out is not None)
        return out

    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    runs = []
    for patch in (counted, lambda self, layer, x: None):
        monkeypatch.setattr(cls, "apply_silu_and_mul", patch)
        llm = LLM(str(quant), dtype="float32", device="cuda", max_num_seqs=4, kv_cache_memory_gib=0.25,
                  kernel_options={"int4_fused_silu_mul": True})  # off by default (docs/benchmarks.md)
        runs.append([llm.generate([p], params, use_tqdm=False)[0].token_ids for p in _prompts()[:3]])
        del llm
    assert any(fused), "the fused GEMV never ran"
    assert runs[0] == runs[1]


@pytest.mark.parametrize("name,kv_dtype", [("ct-fp8-llama-tensor", "auto"), ("ct-fp8-qwen2-channel", "auto"),
                                           ("fp8-llama-tensor-static", "fp8")])
def test_rotary_and_cache_write_in_the_fp8_qkv_gemv_change_no_token_on_gpu(name, kv_dtype, tmp_path, monkeypatch):
    """Decoding one request at a time with ``fp8_qkv_rope`` (on by default since it measured faster), the
    qkv GEMV rotates q/k and writes the KV cache in its epilogue, the rotary + cache-write kernel gone: in
    float32 the same tokens and logprobs as without, for Llama, Qwen2 (qkv bias) and an fp8 cache."""
    from kvloom import LLM, SamplingParams
    from kvloom.core.model.quantization.fp8 import FP8LinearMethod
    from tests.quant_checkpoints import write_checkpoint
    from tests.test_quantization import CASES

    family, fmt, settings = CASES[name]
    path, _ = write_checkpoint(tmp_path, family, fmt, **settings)
    fused = []
    original = FP8LinearMethod.apply_qkv_rope

    def counted(self, layer, x, *args):
        out = original(self, layer, x, *args)
        fused.append(out is not None)
        return out

    monkeypatch.setattr(FP8LinearMethod, "apply_qkv_rope", counted)
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, logprobs=2)
    runs = {}
    for on in (True, False):
        llm = LLM(str(path), dtype="float32", device="cuda", max_num_seqs=4, kv_cache_memory_gib=0.25,
                  kv_cache_dtype=kv_dtype, kernel_options={"fp8_qkv_rope": on})
        outs = [llm.generate([p], params, use_tqdm=False)[0] for p in _prompts()[:3]]
        runs[on] = ([o.token_ids for o in outs], [t.logprob for o in outs for lp in o.outputs[0].logprobs for t in lp.top])
        del llm
    assert any(fused), "the fused qkv GEMV never ran"
    assert runs[True][0] == runs[False][0]
    assert max(abs(a - b) for a, b in zip(runs[True][1], runs[False][1])) < 1e-4


@pytest.mark.parametrize("name", ["ct-fp8-llama-tensor", "ct-fp8-qwen2-channel"])
def test_fp8_activations_quantized_by_the_norm_and_silu_kernels_change_no_token_on_gpu(name, tmp_path, monkeypatch):
    """Where a W8A8 layer takes more rows than the GEMVs do (batched prefill here), RMSNorm and SiLU-and-mul
    hand it FP8 rows (``fp8_fused_quant``): the same tokens and logprobs as the layer quantizing its input."""
    from kvloom import LLM, SamplingParams
    from kvloom.core.model.quantization import fp8
    from tests.quant_checkpoints import write_checkpoint
    from tests.test_quantization import CASES

    if not fp8.fp8_matmul_supported(torch.device("cuda")):
        pytest.skip("no FP8 matmul on this GPU")
    family, fmt, settings = CASES[name]
    path, _ = write_checkpoint(tmp_path, family, fmt, **settings)
    handed = []
    original = fp8.fp8_w8a8_linear

    def counted(x, *args):
        handed.append(isinstance(x, fp8.FP8Rows))
        return original(x, *args)

    monkeypatch.setattr(fp8, "fp8_w8a8_linear", counted)
    params = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True, logprobs=2)
    runs = {}
    for on in (True, False):
        llm = LLM(str(path), dtype="float32", device="cuda", max_num_seqs=8, kv_cache_memory_gib=0.25,
                  kernel_options={"fp8_fused_quant": on})
        outs = llm.generate(_prompts(), params, use_tqdm=False)
        runs[on] = ([o.token_ids for o in outs], [t.logprob for o in outs for lp in o.outputs[0].logprobs for t in lp.top])
        del llm
        if on:
            assert any(handed), "no layer was handed FP8 rows"
            handed.clear()
    assert not any(handed)
    assert runs[True][0] == runs[False][0]
    assert max(abs(a - b) for a, b in zip(runs[True][1], runs[False][1])) < 1e-4


@pytest.mark.skipif(not (torch.cuda.is_available() and torch.cuda.get_device_capability() == (9, 0)),
                    reason="the MMA row layout is Hopper's")
def test_the_mma_row_layout_gives_the_row_layouts_tokens_on_hopper(tmp_path, monkeypatch):
    """An fp16 AWQ model (group 128, widths the Gluon GEMM takes) on Hopper holds its 4-bit weights once, in
    the MMA row layout, and runs every path on it (one row on the GEMV, 2-256 on the Gluon GEMM, a long
    prefill dequantized); in fp16 its dequantized values are the row layout's, so the tokens of the 8
    prompts, one at a time and batched, are the row layout's and the logprobs within fp16 sums' noise."""
    from kvloom import LLM, SamplingParams
    from kvloom.kernels.quant import gluon_int4
    from tests import quant_checkpoints
    from tests.quant_checkpoints import write_checkpoint

    if not gluon_int4.AVAILABLE:
        pytest.skip("this Triton has no Gluon")
    monkeypatch.setitem(quant_checkpoints.QUANT_COMMON, "hidden_size", 256)
    monkeypatch.setitem(quant_checkpoints.QUANT_COMMON, "intermediate_size", 512)
    path, _ = write_checkpoint(tmp_path, "llama", "awq", group_size=128)
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, logprobs=1)
    runs = {}
    for on in (True, False):
        llm = LLM(str(path), dtype="float16", device="cuda", max_num_seqs=8, kv_cache_memory_gib=0.25,
                  kernel_options={"int4_mma_layout": on})
        layouts = {layer.method.layout for layer in llm.engine.model.linear_layers()
                   if hasattr(layer.method, "layout")}
        assert layouts == ({"mma"} if on else {"row"}), layouts
        outs = [llm.generate([p], params, use_tqdm=False)[0] for p in _prompts()]
        outs += llm.generate(_prompts(), params, use_tqdm=False)
        runs[on] = [(o.token_ids, [t.logprob for lp in o.outputs[0].logprobs for t in lp.top]) for o in outs]
        del llm
    same = [(a, b) for a, b in zip(runs[True], runs[False]) if a[0] == b[0]]
    assert len(same) >= 14, (runs[True], runs[False])  # of 16 sequences: a near-tie may flip one or two
    assert max(abs(x - y) for a, b in same for x, y in zip(a[1], b[1])) < 5e-2
