"""Quantized checkpoints (AWQ, GPTQ, FP8) of Llama, Qwen2, Qwen3, Phi-3 and Gemma 2 shapes load and decode exactly like
transformers' float32 model whose weights are the dequantized ones; bad quantization_configs fail at
start-up naming the key and the supported values."""

from __future__ import annotations

import json
import logging
import random

import pytest
import torch

from kvloom import LLM, SamplingParams
from kvloom.core.config import ConfigError, EngineConfig
from tests.conftest import hf_greedy
from tests.quant_checkpoints import write_checkpoint

MAX_NEW = 12
GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_NEW, ignore_eos=True)


def _prompts(seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, 384) for _ in range(k)] for k in (1, 5, 17, 33, 70)]


def _tokens(path, **options) -> tuple[LLM, list[list[int]]]:
    llm = LLM(str(path), dtype="float32", **options)
    return llm, [o.token_ids for o in llm.generate(_prompts(), GREEDY, use_tqdm=False)]


CASES = {
    # W4A16 AWQ, every group size it has
    "awq-llama-g32": ("llama", "awq", dict(group_size=32)),
    "awq-qwen2-g64": ("qwen2", "awq", dict(group_size=64)),
    "awq-qwen3-g128": ("qwen3", "awq", dict(group_size=128)),
    # GPTQ: 4 and 8 bits, desc_act on and off, sym and asym, v1 and v2 zero points, one group
    # q, k and v each with their own input order (kvloom keeps a g_idx per shard)
    "gptq-llama-4bit-descact-sym": ("llama", "gptq", dict(bits=4, group_size=32, sym=True, desc_act=True,
                                                          zero_biases=True, shared_order=False)),
    "gptq-qwen2-8bit-asym": ("qwen2", "gptq", dict(bits=8, group_size=64, sym=False, desc_act=False)),
    "gptq-qwen3-4bit-descact-asym-v2": ("qwen3", "gptq", dict(bits=4, group_size=128, sym=False, desc_act=True,
                                                              checkpoint_format="gptq_v2")),
    "gptq-llama-8bit-descact-sym-one-group": ("llama", "gptq", dict(bits=8, group_size=-1, sym=True, desc_act=True)),
    "gptq-qwen2-4bit-asym-v1": ("qwen2", "gptq", dict(bits=4, group_size=32, sym=False, desc_act=False)),
    # FP8 (weight-only on the CPU: the FP8 weights are dequantized at load, so tokens are exact)
    "fp8-llama-tensor-static": ("llama", "fp8", dict(strategy="tensor", static=0.01)),
    "fp8-qwen3-block": ("qwen3", "fp8", dict(strategy="block", block=32)),
    "ct-fp8-qwen2-channel": ("qwen2", "ct-fp8", dict(strategy="channel")),
    "ct-fp8-llama-tensor": ("llama", "ct-fp8", dict(strategy="tensor")),
    # the newer families: Phi-3's fused q/k/v and gate/up tensors split into shards in each format
    "awq-phi3-g32": ("phi3", "awq", dict(group_size=32)),
    "gptq-phi3-4bit-descact-asym": ("phi3", "gptq", dict(bits=4, group_size=32, sym=False, desc_act=True)),
    "ct-fp8-phi3-channel": ("phi3", "ct-fp8", dict(strategy="channel")),
    "gptq-gemma2-8bit-sym": ("gemma2", "gptq", dict(bits=8, group_size=64, sym=True, desc_act=False)),
    "fp8-gemma2-block": ("gemma2", "fp8", dict(strategy="block", block=32)),
}


@pytest.fixture(scope="module", params=sorted(CASES))
def checkpoint(request, tmp_path_factory):
    family, fmt, settings = CASES[request.param]
    quant, ref = write_checkpoint(tmp_path_factory.mktemp(request.param), family, fmt, **settings)
    return request.param, quant, hf_greedy(ref, _prompts(), MAX_NEW)


def test_quantized_checkpoint_decodes_like_transformers_on_its_dequantized_weights(checkpoint, caplog):
    name, path, expected = checkpoint
    with caplog.at_level(logging.INFO, logger="kvloom"):
        llm, got = _tokens(path)
    assert got == expected
    line = next(r.getMessage() for r in caplog.records if r.getMessage().startswith("Quantization:"))
    fmt = CASES[name][1]
    assert line.startswith(f"Quantization: {'fp8' if 'fp8' in fmt else fmt}")
    assert "kernel: dequantized at load" in line or "kernel: weight-only, dequantized at load" in line
    if fmt == "gptq":
        assert f"{CASES[name][2]['bits']} bits" in line


@pytest.mark.parametrize("name", ["awq-llama-g32", "gptq-llama-4bit-descact-sym"])
def test_quantized_parity_with_prefix_cache_chunked_prefill_and_preemption(name, tmp_path):
    family, fmt, settings = CASES[name]
    quant, ref = write_checkpoint(tmp_path, family, fmt, **settings)
    expected = hf_greedy(ref, _prompts(), MAX_NEW)
    # 7 tokens a step: long prompts go through many chunks; 14 blocks of 8 cannot hold every sequence.
    llm, got = _tokens(quant, max_num_batched_tokens=7, block_size=8, num_kv_blocks=14, plugins=["prefix_cache"])
    assert got == expected
    assert llm.engine.scheduler.num_preemptions > 0
    again = [o.token_ids for o in llm.generate(_prompts(), GREEDY, use_tqdm=False)]
    assert again == expected and llm.engine.scheduler.prefix_cache_hits > 0


def test_online_fp8_of_a_dense_checkpoint_rounds_each_weight_per_channel(tmp_path):
    from tests.quant_checkpoints import fp8_quantize, tiny_hf_model

    model = tiny_hf_model("llama")
    dense = tmp_path / "dense"
    model.save_pretrained(str(dense), safe_serialization=True)
    for name, module in model.named_modules():
        if name.endswith("_proj"):
            module.weight.data.copy_(fp8_quantize(module.weight.detach().float(), "channel")[1])
    model.save_pretrained(str(tmp_path / "ref"), safe_serialization=True)
    expected = hf_greedy(tmp_path / "ref", _prompts(), MAX_NEW)
    llm, got = _tokens(dense, quantization="fp8")
    assert got == expected
    assert llm.engine.quantization.name == "fp8" and llm.engine.quantization.source == "online"
    _, plain = _tokens(dense)
    assert plain != got  # the rounding is real: the dense model decodes differently


def test_missing_quantized_tensor_is_named(tmp_path):
    from safetensors.torch import load_file, save_file

    quant, _ = write_checkpoint(tmp_path, "llama", "awq", group_size=32)
    tensors = load_file(str(quant / "model.safetensors"))
    del tensors["model.layers.1.self_attn.k_proj.qzeros"]
    save_file(tensors, str(quant / "model.safetensors"))
    with pytest.raises(ValueError, match=r"lacks weights for layers.1.self_attn.qkv_proj.qzeros \(shard 'k'\)$"):
        LLM(str(quant), dtype="float32")


def test_modules_to_not_convert_stay_dense(tmp_path):
    quant, ref = write_checkpoint(tmp_path, "llama", "awq", group_size=32, modules_to_not_convert=["layers.1.mlp"])
    llm, got = _tokens(quant)
    assert got == hf_greedy(ref, _prompts(), MAX_NEW)
    from kvloom.core.model.quantization.awq import AWQLinearMethod

    model = llm.engine.model
    assert isinstance(model.layers[0].mlp.down_proj.method, type(model.layers[1].mlp.down_proj.method))  # dense after load
    made = model.layers[0].mlp.gate_up_proj  # both were dense matmuls after loading; only layer 0 came packed
    assert not isinstance(made.method, AWQLinearMethod)


# --- start-up errors, one per key --------------------------------------------------------------------
def _folder(tmp_path, tiny_llama, qc: dict | None, name="m"):
    folder = tmp_path / name
    folder.mkdir()
    config = json.loads((tiny_llama / "config.json").read_text())
    config.update(hidden_size=128, intermediate_size=256)
    config.pop("head_dim", None)
    if qc is not None:
        config["quantization_config"] = qc
    (folder / "config.json").write_text(json.dumps(config))
    return folder


AWQ = {"quant_method": "awq", "bits": 4, "group_size": 128, "zero_point": True, "version": "gemm"}
GPTQ = {"quant_method": "gptq", "bits": 4, "group_size": 128, "desc_act": False, "sym": True}
FP8 = {"quant_method": "fp8", "activation_scheme": "dynamic"}
CT = {"quant_method": "compressed-tensors", "config_groups": {"g": {
    "weights": {"num_bits": 8, "type": "float", "strategy": "channel"},
    "input_activations": {"num_bits": 8, "type": "float", "strategy": "token", "dynamic": True}}}}
BAD = [
    ({**AWQ, "bits": 3}, r"quantization_config.bits=3 is not supported by awq; supported: \[4\]"),
    ({**AWQ, "group_size": 256}, r"quantization_config.group_size=256 is not supported by awq; supported: \[32, 64, 128\]"),
    ({**AWQ, "zero_point": False}, r"quantization_config.zero_point=False is not supported by awq; supported: \[True\]"),
    ({**AWQ, "version": "gemv"}, r"quantization_config.version='gemv' is not supported by awq; supported: \['gemm'\]"),
    ({**GPTQ, "bits": 3}, r"quantization_config.bits=3 is not supported by gptq; supported: \[4, 8\]"),
    ({**GPTQ, "group_size": 100}, r"quantization_config.group_size=100 is not supported by gptq; supported: \[-1, 32, 64, 128\]"),
    ({**GPTQ, "desc_act": "yes"}, r"quantization_config.desc_act='yes' is not supported by gptq; supported: \[False, True\]"),
    ({**GPTQ, "sym": 1}, r"quantization_config.sym=1 is not supported by gptq; supported: \[True, False\]"),
    ({**GPTQ, "checkpoint_format": "marlin"}, r"quantization_config.checkpoint_format='marlin' is not supported by gptq; "
                                              r"supported: \['gptq', 'gptq_v2'\]"),
    ({**GPTQ, "dynamic": {"-:.*down": {}}}, r"quantization_config.dynamic=.* is not supported by gptq"),
    ({**FP8, "activation_scheme": "per-row"}, r"quantization_config.activation_scheme='per-row' is not supported by fp8; "
                                              r"supported: \['dynamic', 'static'\]"),
    ({**FP8, "weight_block_size": [128]}, r"quantization_config.weight_block_size=\[128\] is not supported by fp8"),
    ({**CT, "config_groups": {"g": {**CT["config_groups"]["g"], "weights": {"num_bits": 8, "type": "float",
                                                                               "strategy": "group"}}}},
     r"weights.strategy='group' is not supported; supported: \['channel', 'tensor'\]"),
    ({**CT, "config_groups": {"g": {**CT["config_groups"]["g"], "weights": {"num_bits": 4, "type": "int",
                                                                               "strategy": "channel"}}}},
     r"weights type='int' num_bits=4 is not supported; supported: type 'float', num_bits 8"),
    ({**CT, "config_groups": {"g": {**CT["config_groups"]["g"], "input_activations": None}}},
     r"input_activations=None \(weight-only FP8\) is not supported"),
    ({"quant_method": "bitsandbytes"}, r"quantization_config.quant_method='bitsandbytes' is not supported; supported: "
                                       r"\['awq', 'compressed-tensors', 'fp8', 'gptq', 'mxfp4'\]"),
]


@pytest.mark.parametrize("qc, message", BAD, ids=[m[:40] for _, m in BAD])
def test_unsupported_quantization_config_fails_at_start_up_naming_the_key(tmp_path, tiny_llama, qc, message):
    with pytest.raises(ConfigError, match=message):
        LLM(str(_folder(tmp_path, tiny_llama, qc)), load_format="dummy")


def test_forced_quantization_must_match_the_checkpoint(tmp_path, tiny_llama):
    gptq = _folder(tmp_path, tiny_llama, GPTQ, "gptq")
    with pytest.raises(ConfigError, match=r"quantization='awq' does not match the checkpoint's "
                                          r"quantization_config.quant_method='gptq'; use quantization='gptq'"):
        LLM(str(gptq), load_format="dummy", quantization="awq")
    dense = _folder(tmp_path, tiny_llama, None, "dense")
    with pytest.raises(ConfigError, match=r"quantization='gptq' needs a checkpoint quantized with gptq"):
        LLM(str(dense), quantization="gptq")
    with pytest.raises(ConfigError, match=r"quantization='int4' is not one of \['fp8', 'awq', 'gptq', 'mxfp4'\]"):
        EngineConfig(quantization="int4").validate()


def test_quantize_config_json_beside_the_config_picks_the_method(tmp_path, tiny_llama):
    folder = _folder(tmp_path, tiny_llama, None)
    (folder / "quantize_config.json").write_text(json.dumps({k: v for k, v in GPTQ.items() if k != "quant_method"}))
    llm = LLM(str(folder), load_format="dummy")
    assert llm.engine.quantization.name == "gptq" and llm.engine.quantization.bits == 4


# --- dummy weights in each format ------------------------------------------------------------------
@pytest.mark.parametrize("quantization", ["awq", "gptq", "fp8"])
def test_dummy_weights_in_each_format_run_and_are_deterministic(tmp_path, tiny_llama, quantization):
    folder = tmp_path / "config-only"
    folder.mkdir()
    config = json.loads((tiny_llama / "config.json").read_text())
    config.update(hidden_size=128, intermediate_size=256)
    config.pop("head_dim", None)
    (folder / "config.json").write_text(json.dumps(config))
    prompts = [[5, 6, 7, 8], [9, 10, 11]]
    runs = []
    for _ in range(2):
        llm = LLM(str(folder), load_format="dummy", quantization=quantization, seed=3, dtype="float32")
        runs.append([o.token_ids for o in llm.generate(prompts, GREEDY, use_tqdm=False)])
    assert runs[0] == runs[1] and all(len(t) == MAX_NEW for t in runs[0])
    assert llm.engine.quantization.name == quantization
    assert len(set(runs[0][0])) > 1  # random weights of sane scale: not one token repeated


@pytest.mark.parametrize("name", ["awq-qwen2-g64", "gptq-llama-4bit-descact-sym", "gptq-qwen2-8bit-asym",
                                  "gptq-qwen3-4bit-descact-asym-v2"])
def test_the_gpu_layout_repacked_at_load_computes_the_dequantized_product(name, tmp_path):
    """The GPU path (AWQ and GPTQ repacked into one K-packed layout, desc_act inputs sorted by group, the
    in-kernel dequantizing GEMM) run here through its PyTorch reference: each layer equals the CPU path's."""
    from kvloom.core.model.attention.base import TorchAttentionBackend
    from kvloom.core.model.loader import build_model, load_hf_config
    from kvloom.core.model.quantization import make_method
    from kvloom.core.model.quantization.packed_int import PackedIntLinearMethod

    family, fmt, settings = CASES[name]
    quant, _ = write_checkpoint(tmp_path, family, fmt, **settings)
    config = load_hf_config(quant)
    models = []
    for packed in (False, True):
        method = make_method(fmt, config)
        method.keep_packed = packed
        models.append(build_model(quant, config, load_format="safetensors", device=torch.device("cpu"),
                                  dtype=torch.float32, backend=TorchAttentionBackend(), max_positions=64,
                                  quantization=method, pack_cpu_weights=False))
        if packed:
            assert "dequantizing in the kernel" in method.describe()
    dense, packed = models
    runs_packed = [layer for layer in packed.linear_layers() if isinstance(layer.method, PackedIntLinearMethod)]
    if settings.get("shared_order", True):
        assert len(runs_packed) == 4 * config.num_hidden_layers  # every projection; lm_head stays dense
    else:  # fused shards with their own input orders cannot share one sorted matmul: dequantized, and said so
        assert {layer.prefix.rsplit(".", 1)[1] for layer in runs_packed} == {"o_proj", "down_proj"}
        assert "(4 fused layers with per-shard input orders dequantized at load)" in method.describe()
    for a, b in zip(dense.linear_layers(), packed.linear_layers()):
        x = torch.randn(7, a.input_size, generator=torch.Generator().manual_seed(0))
        torch.testing.assert_close(b(x), a(x), atol=1e-5, rtol=1e-5)
        if isinstance(b.method, PackedIntLinearMethod):  # held packed: 4 or 8 bits a weight, not 32
            assert b.qweight.numel() * 4 <= a.weight.numel() * settings.get("bits", 4) // 8 * 1.01


def test_engine_plan_sizes_each_format_from_the_engines_layers(tmp_path, capsys):
    from benchmarks.shapes import SHAPES
    from kvloom.cli.main import main

    path = tmp_path / "config.json"
    path.write_text(json.dumps(SHAPES["llama-3-8b"]))
    sizes = {}
    for q in (None, "fp8", "awq", "gptq"):
        argv = ["plan", "--config-json", str(path), "--gpu-memory", "141", "--tensor-parallel-sizes", "1", "--json"]
        assert main(argv + (["--quantization", q] if q else [])) == 0
        sizes[q] = json.loads(capsys.readouterr().out)["weight_bytes"]
    linear = 32 * 4096 * (4096 + 2 * 1024 + 4096 + 3 * 14336)  # the projections of Llama-3-8B
    assert sizes[None] - sizes["fp8"] == linear * 2 - (linear + 4 * 32 * (4096 + 2 * 1024 + 4096 + 2 * 14336 + 4096))
    # int4: half a byte a weight, plus an fp16 scale and a uint8 zero point per 128 inputs; on a bf16 GPU also
    # the decode rows' second (tinygemm) copy: half a byte a weight and a bf16 scale and zero per 128 inputs
    int4 = linear // 2 + linear // 128 * 3
    # on Hopper the weights are held once, in the Gluon GEMM's MMA row layout, and tinygemm's copy only for
    # the weights whose one row it runs (o_proj's 4096 x 4096)
    from kvloom.kernels.quant import dispatch

    hopper = torch.cuda.is_available() and dispatch.mma_layout_wanted(torch.device("cuda"), 4096, 128, torch.bfloat16)
    copied = 32 * 4096 * 4096 if hopper else linear
    tinygemm = copied // 2 + copied // 128 * 4
    assert sizes[None] - sizes["awq"] == linear * 2 - (int4 + tinygemm) == sizes[None] - sizes["gptq"]
