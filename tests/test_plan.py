"""``engine plan``: the memory arithmetic equals what the engine computes and logs at start-up."""

from __future__ import annotations

import json
import logging

import pytest
import torch

from benchmarks.shapes import SHAPES
from kvloom.builder import build_engine
from kvloom.cli.main import main
from kvloom.cli.plan import count_parameters, make_plan, valid_tp_sizes
from kvloom.core.config import EngineConfig
from kvloom.core.model.loader import load_hf_config


@pytest.fixture
def llama2_7b(tmp_path):
    path = tmp_path / "config.json"
    path.write_text(json.dumps(SHAPES["llama-2-7b"]))
    return path


def plan_json(capsys, *argv) -> dict:
    assert main(["plan", *argv, "--json"]) == 0
    return json.loads(capsys.readouterr().out)


def test_llama2_7b_fp16_has_512_kib_of_kv_per_token(llama2_7b, capsys):
    plan = plan_json(capsys, "--config-json", str(llama2_7b), "--dtype", "float16", "--gpu-memory", "80")
    rows = {r["tensor_parallel"]: r for r in plan["rows"]}
    assert rows[1]["kv_bytes_per_token"] == 524288 == 32 * 4096 * 2 * 2  # layers x hidden x (K, V) x 2 bytes
    # Tensor parallelism splits the 32 KV heads, so each GPU holds a share of every token.
    assert [rows[tp]["kv_bytes_per_token"] for tp in (2, 4, 8)] == [262144, 131072, 65536]
    assert plan["parameters"]["total"] == 6_738_415_616  # the published Llama-2-7B size
    assert plan["weight_bytes"] == 2 * 6_738_415_616
    for r in plan["rows"]:
        # Each GPU holds its share of the matrices and the embeddings, and every norm whole.
        norms = (2 * 32 + 1) * 4096 * 2
        assert r["weight_bytes_per_gpu"] == (plan["weight_bytes"] - norms) // r["tensor_parallel"] + norms
        assert r["kv_tokens"] == r["kv_blocks"] * 16 and r["kv_blocks"] * 16 * r["kv_bytes_per_token"] <= r["kv_budget_bytes"]
        assert r["max_concurrency"] == pytest.approx(r["kv_blocks"] / (4096 // 16), abs=1e-4)
    assert main(["plan", "--config-json", str(llama2_7b), "--dtype", "float16", "--gpu-memory", "80"]) == 0
    assert "KV bytes per token: 524,288 = 2 (K, V) x 32 layers x 32 KV heads x 128 x 2 bytes" in capsys.readouterr().out


def test_quantized_weights_are_smaller(llama2_7b):
    config = EngineConfig(dtype="float16")
    hf = load_hf_config(llama2_7b)
    sizes = {q: make_plan(config, hf, "llama-2-7b", gpu_memory_gib=24, quantization=q).weight_bytes
             for q in (None, "fp8", "awq")}
    params = count_parameters(hf)
    assert sizes["fp8"] == params.linear_weights + 4 * params.linear_out_features + 2 * params.other
    assert sizes[None] > sizes["fp8"] > sizes["awq"] > params.linear_weights // 2


def test_parameter_count_is_the_models(tiny_model):
    from transformers import AutoModelForCausalLM

    hf_model = AutoModelForCausalLM.from_pretrained(str(tiny_model))
    assert count_parameters(load_hf_config(tiny_model)).total == sum(p.numel() for p in hf_model.parameters())


@pytest.mark.parametrize("flags", [
    {}, {"kv_cache_memory_gib": 0.01, "max_model_len": 100}, {"num_kv_blocks": 37, "block_size": 32},
])
def test_cpu_plan_equals_the_engines_capacity(tiny_llama, flags, capsys):
    config = EngineConfig(model=str(tiny_llama), device="cpu", **flags)
    engine = build_engine(config)
    argv = [f"--{k.replace('_', '-')}={v}" for k, v in flags.items()]
    plan = plan_json(capsys, "--model", str(tiny_llama), "--device", "cpu", *argv)
    assert plan["rows"][0]["kv_cache_line"] == engine.capacity.describe()
    assert plan["weight_bytes"] == checkpoint_bytes(engine.model)


@pytest.mark.slow
def test_smollm2_plan_prints_the_line_the_engine_logs(capsys, caplog):
    assert main(["plan", "--model", "SmolLM2-135M-Instruct", "--device", "cpu"]) == 0
    printed = capsys.readouterr().out
    with caplog.at_level(logging.INFO, logger="kvloom"):
        engine = build_engine(EngineConfig(device="cpu"))
    logged = [r.getMessage() for r in caplog.records if r.getMessage().startswith("KV cache:")]
    assert logged == [engine.capacity.describe()]
    assert logged[0] in printed.splitlines()
    per_token = 2 * 30 * 3 * 64 * torch.empty(0, dtype=engine.dtype).element_size()  # K and V, 30 layers, 3 x 64
    assert f"KV bytes per token: {per_token:,}" in printed
    weights = checkpoint_bytes(engine.model)
    assert f"Weights: {weights / 2**30:.2f} GiB" in printed


def test_tensor_parallel_sizes_must_split_the_heads(tmp_path):
    hf = load_hf_config(_config_file(tmp_path, num_attention_heads=9, num_key_value_heads=3, hidden_size=576))
    assert valid_tp_sizes(hf, [1, 2, 3, 4, 8, 9]) == [1, 3, 9]


def test_bad_plans_are_clear_errors(llama2_7b, capsys):
    cases = [
        (["--config-json", str(llama2_7b), "--device", "cpu", "--gpu-memory", "80"], "--gpu-memory"),
        (["--config-json", str(llama2_7b), "--gpu-memory", "80", "--max-model-len", "9000"], "max_model_len=9000"),
        (["--config-json", str(llama2_7b), "--gpu-memory", "80", "--tensor-parallel-sizes", "3"], "divides"),
        (["--config-json", "/no/such.json"], "/no/such.json"),
    ]
    if not torch.cuda.is_available():
        cases.append((["--config-json", str(llama2_7b), "--device", "cuda"], "--gpu-memory GiB"))
    for argv, words in cases:
        assert main(["plan", *argv]) == 2
        assert words in capsys.readouterr().err
    # A GPU too small for the weights says so instead of planning a negative cache.
    assert main(["plan", "--config-json", str(llama2_7b), "--gpu-memory", "8", "--tensor-parallel-sizes", "1"]) == 0
    assert "leave no room for a KV cache" in capsys.readouterr().out


def _config_file(tmp_path, **changes):
    path = tmp_path / "config.json"
    path.write_text(json.dumps({**SHAPES["llama-2-7b"], **changes}))
    return path


def checkpoint_bytes(model) -> int:
    """The model's weights as the engine holds them: parameters, plus the linear layers packed for the
    CPU (not the packed copy of tied embeddings, which the embedding table already counts), plus the
    4-bit copies kept of a GGUF file's 4-bit layers and the 8-bit codes of its Q8_0 output projection."""
    from kvloom.kernels.cpu_linear import PackedLinear

    total = sum(p.numel() * p.element_size() for p in model.parameters())
    total += sum(b.numel() * b.element_size() for n, b in model.named_buffers()
                 if n.rpartition(".")[2].startswith(("int4_", "q8_")))
    for name, m in model.named_modules():
        if isinstance(m, PackedLinear) and not (name in ("lm_head", "lm_head.dense") and model.tie_word_embeddings):
            size = torch.empty(0, dtype=m.packed_weight.dtype).element_size()
            total += (m.in_features * m.out_features + (m.out_features if m.bias is not None else 0)) * size
    return total
