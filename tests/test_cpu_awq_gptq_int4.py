"""AWQ and GPTQ 4-bit layers kept packed on the CPU (bfloat16): their codes turned into torch's int4 matmul's
(q, scale, zero) reproduce the dequantized reference exactly, the packed matmul equals ``x @ W.T``, greedy
decoding through ``kvloom.LLM`` agrees with the dense path, float32 stays dense, and ``engine plan`` counts
the copies the engine holds."""

from __future__ import annotations

import logging
import random

import pytest
import torch

from kvloom.kernels.cpu_int4 import dequantize_int4, int4_mm, int4_supported, pack_int4, zero_point_codes
from kvloom.kernels.quant_reference import awq_codes, dequantize_awq, dequantize_gptq, gptq_codes
from tests.quant_checkpoints import awq_quantize, gptq_quantize, write_checkpoint

needs_int4 = pytest.mark.skipif(not int4_supported(), reason="this torch has no CPU int4 matmul")

# (format, group size, sym, gptq_v2): AWQ's groups, GPTQ's sym/asym with v1's zero-point + 1 and v2's as is
LAYERS = [("awq", g, False, False) for g in (32, 64, 128)] + [
    ("gptq", g, sym, v2) for g in (32, 64, 128) for sym in (True, False) for v2 in (False, True)]


def layer_codes(fmt: str, group: int, sym: bool, v2: bool, out: int = 96, inp: int = 256):
    """(int4 codes, scale, zero, the existing dequantized reference [out, in] float32) of a random layer."""
    gen = torch.Generator().manual_seed(group + 2 * sym + v2)
    w = torch.randn(out, inp, generator=gen) * 0.05
    if fmt == "awq":
        t, _ = awq_quantize(w, group)
        ref = dequantize_awq(t["qweight"], t["qzeros"], t["scales"], group)
        q, z = awq_codes(t["qweight"], t["qzeros"])
    else:
        t, _ = gptq_quantize(w, 4, group, sym, False, v2, gen)
        ref = dequantize_gptq(t["qweight"], t["qzeros"], t["scales"], None, 4, group, not v2)
        q, z = gptq_codes(t["qweight"], t["qzeros"], 4, not v2)
    return (*zero_point_codes(q, z, t["scales"], group), ref)


@pytest.mark.parametrize("fmt,group,sym,v2", LAYERS)
def test_codes_reproduce_the_dequantized_weight_exactly(fmt, group, sym, v2):
    q, scale, zero, ref = layer_codes(fmt, group, sym, v2)
    assert q.dtype == torch.uint8 and int(q.max()) <= 15 and scale.shape == (96, 256 // group)
    assert torch.equal(dequantize_int4(q, scale, zero, group), ref)  # float32, bit for bit


def test_one_gptq_group_per_column_spreads_over_the_kernels_groups():
    gen = torch.Generator().manual_seed(3)
    t, _ = gptq_quantize(torch.randn(32, 256, generator=gen) * 0.05, 4, -1, False, False, False, gen)
    ref = dequantize_gptq(t["qweight"], t["qzeros"], t["scales"], None, 4, -1, True)
    q, scale, zero = zero_point_codes(*gptq_codes(t["qweight"], t["qzeros"], 4, True), t["scales"], 128)
    assert scale.shape == (32, 2) and torch.equal(dequantize_int4(q, scale, zero, 128), ref)


@needs_int4
@pytest.mark.parametrize("fmt,group,sym,v2", LAYERS)
def test_packed_cpu_matmul_equals_the_dequantized_product(fmt, group, sym, v2):
    q, scale, zero, ref = layer_codes(fmt, group, sym, v2)
    packed, sz = pack_int4(q, scale, zero, torch.bfloat16)
    for rows in (1, 4, 8):
        x = torch.randn(rows, 256, generator=torch.Generator().manual_seed(rows)).bfloat16()
        got, want = int4_mm(x, packed, sz, group).float(), x.float() @ ref.T
        # bf16 scales, zeros and accumulation: within 1% of the output's scale
        assert (got - want).abs().max() <= 0.01 * want.abs().max(), (got - want).abs().max()


CHECKPOINTS = {
    # Qwen2: q/k/v biases (the 4-bit path adds the bias the oneDNN copy holds)
    "awq-qwen2-g64": ("qwen2", "awq", dict(group_size=64)),
    "gptq-llama-4bit-asym-v1-g32": ("llama", "gptq", dict(bits=4, group_size=32, sym=False, desc_act=False)),
    "gptq-qwen3-4bit-sym-v2-g128": ("qwen3", "gptq", dict(bits=4, group_size=128, sym=True, desc_act=False,
                                                          checkpoint_format="gptq_v2")),
}
PROMPTS = 4
NEW = 16
# Measured 64/64 positions for each checkpoint (2026-12-05); bf16 rounding of the 4-bit path's scales and
# zeros may flip a near-tie on another CPU, and a flip changes the rest of that sequence.
AGREEMENT = 0.75


def _prompts() -> list[list[int]]:
    rng = random.Random(7)
    return [[rng.randrange(3, 384) for _ in range(k)] for k in (3, 9, 17, 30)][:PROMPTS]


def _random_biases(*folders) -> None:
    """Give every bias (zeros in a fresh model) the same random values in each checkpoint folder."""
    from safetensors.torch import load_file, save_file

    for folder in folders:
        tensors = load_file(str(folder / "model.safetensors"))
        gen = torch.Generator().manual_seed(5)
        for name in sorted(n for n in tensors if n.endswith(".bias")):
            tensors[name] = (torch.randn(tensors[name].shape, generator=gen) * 0.1).to(tensors[name].dtype)
        save_file(tensors, str(folder / "model.safetensors"), metadata={"format": "pt"})


@pytest.fixture(scope="module", params=sorted(CHECKPOINTS))
def checkpoint(request, tmp_path_factory):
    family, fmt, settings = CHECKPOINTS[request.param]
    quant, ref = write_checkpoint(tmp_path_factory.mktemp(request.param), family, fmt, **settings)
    _random_biases(quant, ref)
    return request.param, quant, ref


def _greedy(llm) -> list[list[int]]:
    from kvloom import SamplingParams

    sp = SamplingParams(temperature=0.0, max_tokens=NEW, ignore_eos=True)
    return [o.token_ids for o in llm.generate(_prompts(), sp, use_tqdm=False)]  # all 4 in each decode step


@needs_int4
def test_greedy_decoding_on_the_4_bit_copies_agrees_with_the_dense_path(checkpoint, caplog):
    from kvloom import LLM
    from kvloom.core.model.cpu_packing import Int4CPUMethod, int4_max_rows

    name, path, _ = checkpoint
    fmt = CHECKPOINTS[name][1]
    with caplog.at_level(logging.INFO, logger="kvloom"):
        int4 = LLM(str(path), dtype="bfloat16")
    line = next(r.getMessage() for r in caplog.records if r.getMessage().startswith("Quantization:"))
    layers = [layer for layer in int4.engine.model.linear_layers() if layer.prefix.startswith("model.")]
    assert len(layers) == 4 * 2 and all(isinstance(layer.method, Int4CPUMethod) for layer in layers)
    rows = int4_max_rows(gguf=False)  # AWQ/GPTQ keep bf16 inputs by default
    assert all(layer.method.name.startswith(f"int4 ({fmt}) for steps of <= {rows} rows, else dense, oneDNN-packed")
               for layer in layers)
    assert "kernel: 8 layers kept at 4 bits on the CPU" in line, line
    for layer in layers:  # each layer's 4-bit matmul (bias included) against its dense copy's: 2 rows take
        for rows in (2, 12):  # torch's int4 matmul, 12 the AMX kernel where it serves
            x = torch.randn(rows, layer.input_size, generator=torch.Generator().manual_seed(0)).bfloat16()
            got, want = layer(x).float(), layer.method.dense.apply(layer, x).float()
            assert (got - want).abs().max() <= 0.01 * want.abs().max(), (layer.prefix, rows, (got - want).abs().max())
    calls = []
    for layer in layers:  # count the steps that run on the 4-bit weights
        layer.method.apply = (lambda f: lambda lyr, x: (calls.append(x.shape[0]), f(lyr, x))[1])(layer.method.apply)
    got = _greedy(int4)
    assert calls.count(PROMPTS) >= (NEW - 1) * len(layers)  # the decode steps of 4 rows
    dense = LLM(str(path), dtype="bfloat16", gguf_int4=False)
    assert not any(hasattr(layer, "int4_weight") for layer in dense.engine.model.linear_layers())
    want = _greedy(dense)
    share = sum(a == b for x, y in zip(got, want) for a, b in zip(x, y)) / (PROMPTS * NEW)
    assert all(len(x) == NEW for x in got) and share >= AGREEMENT, (share, got, want)


def test_float32_keeps_the_dequantized_weights_and_transformers_tokens(checkpoint, caplog):
    from kvloom import LLM
    from tests.conftest import hf_greedy

    _, path, ref = checkpoint
    with caplog.at_level(logging.INFO, logger="kvloom"):
        llm = LLM(str(path), dtype="float32")
    line = next(r.getMessage() for r in caplog.records if r.getMessage().startswith("Quantization:"))
    assert line.endswith("kernel: dequantized at load to float32 (cpu: dense matmuls)"), line
    assert not any(hasattr(layer, "int4_weight") for layer in llm.engine.model.linear_layers())
    assert _greedy(llm) == hf_greedy(ref, _prompts(), NEW)


@needs_int4
def test_act_order_gptq_stays_dense_and_says_why_while_group_ordered_desc_act_runs_4_bit(tmp_path, caplog):
    from kvloom import LLM
    from kvloom.core.model.cpu_packing import Int4CPUMethod

    quant, _ = write_checkpoint(tmp_path / "a", "llama", "gptq", bits=4, group_size=32, sym=True, desc_act=True)
    with caplog.at_level(logging.INFO, logger="kvloom"):
        llm = LLM(str(quant), dtype="bfloat16")
    line = next(r.getMessage() for r in caplog.records if r.getMessage().startswith("Quantization:"))
    assert line.endswith("kernel: dequantized at load to bfloat16 (cpu: dense matmuls); dense only (no 4-bit "
                         "copy): 8 layers (act-order: g_idx not in group order)"), line
    assert not any(hasattr(layer, "int4_weight") for layer in llm.engine.model.linear_layers())
    # desc_act=True with one group per column: every g_idx is 0, in group order; it runs as groups of 128/256
    ordered, _ = write_checkpoint(tmp_path / "b", "llama", "gptq", bits=4, group_size=-1, sym=False, desc_act=True)
    llm = LLM(str(ordered), dtype="bfloat16")
    methods = [layer.method for layer in llm.engine.model.linear_layers() if layer.prefix.startswith("model.")]
    assert all(isinstance(m, Int4CPUMethod) for m in methods)
    assert {m.group for m in methods} == {128, 256}  # 128 inputs (q/k/v, o, gate/up) and down_proj's 256


@needs_int4
def test_engine_plan_counts_the_4_bit_copies_the_engine_holds(checkpoint):
    from kvloom import LLM
    from kvloom.cli.plan import make_plan
    from kvloom.core.config import EngineConfig
    from kvloom.core.model.cpu_packing import int4_bytes
    from kvloom.core.model.loader import load_hf_config
    from kvloom.kernels import cpu_int4_amx

    _, path, _ = checkpoint
    hf_config = load_hf_config(path)
    plans = {on: make_plan(EngineConfig(device="cpu", dtype="bfloat16", gguf_int4=on), hf_config, "tiny")
             for on in (True, False)}
    extra = plans[True].rows[0].weight_bytes_per_gpu - plans[False].rows[0].weight_bytes_per_gpu
    llm = LLM(str(path), dtype="bfloat16")
    held = sum(int4_bytes(layer) for layer in llm.engine.model.linear_layers())
    # half a byte a weight, a bf16 scale and zero per group: q/k/v, o, gate/up and down of 2 layers
    group = CHECKPOINTS[checkpoint[0]][2]["group_size"]
    linear = 2 * 128 * (128 + 2 * 64 + 128 + 2 * 256) + 2 * 256 * 128
    codes = 2 if cpu_int4_amx.on_amx() else 1  # the AMX kernel's own copy beside torch's; else one copy
    assert extra == held == linear // 2 * codes + linear // group * 4, (extra, held)
    assert any("also kept packed at 4 bits" in note for note in plans[True].notes)
    assert not any("also kept packed at 4 bits" in note for note in plans[False].notes)
