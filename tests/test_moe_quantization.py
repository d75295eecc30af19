"""Quantized MoE experts: tiny Qwen3-MoE checkpoints in FP8 (block and per-tensor scales, and
``--quantization fp8`` of a dense one), AWQ and GPTQ, and a tiny gpt-oss in MXFP4, each packed here from the
format's documented layout (tests/quant_checkpoints.py), decode token for token like transformers' float32
model on the dequantized weights; the start-up log names the experts' format."""

from __future__ import annotations

import json
import logging
import random
from pathlib import Path

import pytest
import torch

from kvloom import LLM, SamplingParams
from tests.conftest import hf_greedy
from tests.quant_checkpoints import LINEARS, awq_quantize, fp8_quantize, gptq_quantize

MAX_NEW = 12
GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_NEW, ignore_eos=True)
QWEN3_MOE = dict(hidden_size=64, intermediate_size=128, moe_intermediate_size=64, num_hidden_layers=2,
                 num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_experts=10, num_experts_per_tok=4,
                 norm_topk_prob=True, mlp_only_layers=[1], vocab_size=384, tie_word_embeddings=False,
                 max_position_embeddings=512, bos_token_id=1, eos_token_id=2, pad_token_id=0, initializer_range=0.1)


def _prompts(seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, 384) for _ in range(k)] for k in (1, 5, 17, 33, 70)]


def _tokens(path, **options) -> tuple[LLM, list[list[int]]]:
    llm = LLM(str(path), dtype="float32", **options)
    return llm, [o.token_ids for o in llm.generate(_prompts(), GREEDY, use_tqdm=False)]


def _quantize(w: torch.Tensor, fmt: str, settings: dict, gen) -> tuple[dict, torch.Tensor]:
    if fmt == "awq":
        return awq_quantize(w, settings["group_size"])
    if fmt == "gptq":
        return gptq_quantize(w, settings["bits"], settings["group_size"], settings["sym"], settings["desc_act"],
                             settings.get("checkpoint_format") == "gptq_v2", gen)
    return fp8_quantize(w, settings["strategy"], settings.get("block"))


def _quant_config(fmt: str, settings: dict) -> dict:
    if fmt == "awq":
        return {"quant_method": "awq", "bits": 4, "group_size": settings["group_size"], "zero_point": True,
                "version": "gemm"}
    if fmt == "gptq":
        return {"quant_method": "gptq", "bits": settings["bits"], "group_size": settings["group_size"],
                "desc_act": settings["desc_act"], "sym": settings["sym"],
                "checkpoint_format": settings.get("checkpoint_format", "gptq")}
    qc = {"quant_method": "fp8", "activation_scheme": "dynamic"}
    if settings.get("block"):
        qc["weight_block_size"] = [settings["block"]] * 2
    return qc


def write_qwen3_moe(path: Path, fmt: str, seed: int = 0, **settings) -> tuple[Path, Path]:
    """(quantized checkpoint, float32 reference) of a tiny Qwen3-MoE: every linear layer and every expert's
    gate/up/down projection quantized (per expert, as the checkpoints on the Hub hold them), the router dense."""
    import transformers
    from safetensors.torch import save_file

    config = transformers.Qwen3MoeConfig(**QWEN3_MOE, architectures=["Qwen3MoeForCausalLM"])
    torch.manual_seed(seed)
    model = transformers.Qwen3MoeForCausalLM(config).eval()
    gen = torch.Generator().manual_seed(seed + 1)
    tensors = {}
    with torch.no_grad():
        for name, p in model.named_parameters():
            leaf_module = name.rsplit(".", 2)[-2]
            if name.endswith(".weight") and leaf_module in LINEARS:
                t, deq = _quantize(p.detach().float(), fmt, settings, gen)
                tensors.update({f"{name[:-len('.weight')]}.{k}": v for k, v in t.items()})
                p.copy_(deq)
            elif name.endswith("experts.gate_up_proj"):
                base, i = name[:-len("gate_up_proj")], p.shape[1] // 2
                for e in range(p.shape[0]):
                    for proj, rows in (("gate_proj", slice(0, i)), ("up_proj", slice(i, 2 * i))):
                        t, deq = _quantize(p[e, rows].float(), fmt, settings, gen)
                        tensors.update({f"{base}{e}.{proj}.{k}": v for k, v in t.items()})
                        p[e, rows] = deq
            elif name.endswith("experts.down_proj"):
                base = name[:-len("down_proj")]
                for e in range(p.shape[0]):
                    t, deq = _quantize(p[e].float(), fmt, settings, gen)
                    tensors.update({f"{base}{e}.down_proj.{k}": v for k, v in t.items()})
                    p[e] = deq
            else:
                tensors[name] = p.detach().clone()
    quant, ref = path / f"qwen3_moe-{fmt}", path / f"qwen3_moe-{fmt}-reference"
    quant.mkdir(parents=True)
    cfg = model.config.to_dict()
    cfg["quantization_config"] = _quant_config(fmt, settings)
    (quant / "config.json").write_text(json.dumps(cfg))
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(quant / "model.safetensors"))
    model.save_pretrained(str(ref), safe_serialization=True)
    return quant, ref


CASES = {
    "fp8-block": ("fp8", dict(strategy="block", block=32)),
    "fp8-tensor": ("fp8", dict(strategy="tensor")),
    "fp8-channel": ("fp8", dict(strategy="channel")),
    "awq-g32": ("awq", dict(group_size=32)),
    "gptq-4bit-descact-asym": ("gptq", dict(bits=4, group_size=32, sym=False, desc_act=True)),
    "gptq-4bit-sym-v2": ("gptq", dict(bits=4, group_size=64, sym=True, desc_act=False, checkpoint_format="gptq_v2")),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_quantized_qwen3_moe_decodes_like_transformers_on_its_dequantized_weights(case, tmp_path, caplog):
    fmt, settings = CASES[case]
    quant, ref = write_qwen3_moe(tmp_path, fmt, **settings)
    expected = hf_greedy(ref, _prompts(), MAX_NEW)
    with caplog.at_level(logging.INFO, logger="kvloom"):
        llm, got = _tokens(quant)
    assert got == expected
    messages = [r.getMessage() for r in caplog.records]
    assert any(m.startswith(f"Quantization: {fmt}") for m in messages)
    moe = next(m for m in messages if m.startswith("MoE:"))
    assert f"experts {fmt}" in moe
    experts = llm.engine.model.moe_blocks()[0].experts
    assert experts.method.name == fmt and experts.w13_weight.dtype == torch.float32  # dequantized once at load


def test_online_fp8_rounds_each_experts_weight_per_output_channel(tmp_path, caplog):
    """``--quantization fp8`` of a dense Qwen3-MoE: every expert (and linear layer) rounded to e4m3 with a
    scale per output channel, as transformers' model with those rounded weights computes."""
    import transformers

    dense = tmp_path / "dense"
    config = transformers.Qwen3MoeConfig(**QWEN3_MOE, architectures=["Qwen3MoeForCausalLM"])
    torch.manual_seed(0)
    model = transformers.Qwen3MoeForCausalLM(config).eval()
    model.save_pretrained(str(dense), safe_serialization=True)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(".weight") and name.rsplit(".", 2)[-2] in LINEARS:
                p.copy_(fp8_quantize(p.float(), "channel")[1])
            elif name.endswith(("experts.gate_up_proj", "experts.down_proj")):
                for e in range(p.shape[0]):
                    p[e] = fp8_quantize(p[e].float(), "channel")[1]
    model.save_pretrained(str(tmp_path / "rounded"), safe_serialization=True)
    expected = hf_greedy(tmp_path / "rounded", _prompts(), MAX_NEW)
    with caplog.at_level(logging.INFO, logger="kvloom"):
        llm, got = _tokens(dense, quantization="fp8")
    assert got == expected
    assert any("experts fp8" in r.getMessage() for r in caplog.records)
    experts = llm.engine.model.moe_blocks()[0].experts
    w = experts.w13_weight.data[3]  # already on the e4m3 grid of its rows' scales: rounding again changes nothing
    assert experts.method.name == "fp8" and torch.equal(fp8_quantize(w, "channel")[1], w)


# --- gpt-oss MXFP4 ----------------------------------------------------------------------------------
def write_gpt_oss_mxfp4(path: Path, seed: int = 0) -> tuple[Path, Path]:
    """(MXFP4 checkpoint, float32 reference) of a tiny gpt-oss: random e2m1 ``*_blocks`` ``[E, N, K / 32, 16]``
    and e8m0 ``*_scales`` ``[E, N, K / 32]`` (gate and up rows interleaved, as gpt-oss stores them), the
    reference's experts set to transformers' own dequantization of them (integrations/mxfp4.py)."""
    import transformers
    from safetensors.torch import save_file

    mxfp4 = pytest.importorskip("transformers.integrations.mxfp4")
    from tests.conftest import MOE_FAMILIES, TINY_COMMON

    extra = {**TINY_COMMON, **MOE_FAMILIES["gpt_oss"][2], "hidden_size": 64, "intermediate_size": 64,
             "num_attention_heads": 4, "head_dim": 16, "vocab_size": 384}
    config = transformers.GptOssConfig(**extra, architectures=["GptOssForCausalLM"])
    torch.manual_seed(seed)
    model = transformers.GptOssForCausalLM(config).eval()
    gen = torch.Generator().manual_seed(seed + 1)
    tensors = {}
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("bias"):
                p.normal_(0.0, 0.2, generator=gen)  # transformers starts them at zero
            if name.endswith(("experts.gate_up_proj", "experts.down_proj")):
                e, k, n = p.shape  # x @ W: [E, in, out]
                blocks = torch.randint(0, 256, (e, n, k // 32, 16), dtype=torch.uint8, generator=gen)
                scales = torch.randint(119, 124, (e, n, k // 32), dtype=torch.uint8, generator=gen)
                tensors[f"{name}_blocks"], tensors[f"{name}_scales"] = blocks, scales
                p.copy_(mxfp4.convert_moe_packed_tensors(blocks, scales, dtype=torch.float32))
            else:
                tensors[name] = p.detach().clone()
    quant, ref = path / "gpt_oss-mxfp4", path / "gpt_oss-mxfp4-reference"
    quant.mkdir(parents=True)
    cfg = model.config.to_dict()
    cfg["quantization_config"] = {"quant_method": "mxfp4", "modules_to_not_convert": [
        "model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens", "lm_head"]}
    (quant / "config.json").write_text(json.dumps(cfg))
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(quant / "model.safetensors"))
    model.save_pretrained(str(ref), safe_serialization=True)
    return quant, ref


def test_gpt_oss_mxfp4_decodes_like_transformers_on_its_dequantized_weights(tmp_path, caplog):
    quant, ref = write_gpt_oss_mxfp4(tmp_path)
    expected = hf_greedy(ref, _prompts(), MAX_NEW)
    with caplog.at_level(logging.INFO, logger="kvloom"):
        llm, got = _tokens(quant, max_num_batched_tokens=7, block_size=8, plugins=["prefix_cache"])
    assert got == expected
    messages = [r.getMessage() for r in caplog.records]
    assert any(m.startswith("Quantization: mxfp4") and "kernel: dequantized at load" in m for m in messages)
    assert any(m.startswith("MoE:") and "experts mxfp4" in m for m in messages)
    again = [o.token_ids for o in llm.generate(_prompts(), GREEDY, use_tqdm=False)]
    assert again == expected and llm.engine.scheduler.prefix_cache_hits > 0


@pytest.mark.parametrize("quantization", ["fp8", "awq", "gptq"])
def test_dummy_quantized_experts_run_and_are_deterministic(tmp_path, quantization):
    """``load_format=dummy`` of a Qwen3-MoE config in each format (the usual settings: AWQ and GPTQ group 128,
    so the experts' inputs are 128 here): random weights in the format, two runs the same tokens."""
    import transformers

    folder = tmp_path / "config-only"
    folder.mkdir()
    shapes = {**QWEN3_MOE, "hidden_size": 128, "moe_intermediate_size": 128, "intermediate_size": 256, "head_dim": 32}
    config = transformers.Qwen3MoeConfig(**shapes, architectures=["Qwen3MoeForCausalLM"])
    (folder / "config.json").write_text(json.dumps(config.to_dict()))
    prompts = [[5, 6, 7, 8], [9, 10, 11]]
    runs = []
    for _ in range(2):
        llm = LLM(str(folder), load_format="dummy", quantization=quantization, seed=3, dtype="float32")
        runs.append([o.token_ids for o in llm.generate(prompts, GREEDY, use_tqdm=False)])
    assert runs[0] == runs[1] and all(len(t) == MAX_NEW for t in runs[0])
    assert llm.engine.model.moe_blocks()[0].experts.method.name == quantization
    assert len(set(runs[0][0])) > 1  # random weights of sane scale: not one token repeated


# --- engine plan ----------------------------------------------------------------------------------------
def _plan(tmp_path, shape: str, quantization: str | None, capsys, device: list[str]) -> int:
    from benchmarks.shapes import SHAPES
    from kvloom.cli.main import main

    path = tmp_path / f"{shape}.json"
    path.write_text(json.dumps(SHAPES[shape]))
    argv = ["plan", "--config-json", str(path), "--tensor-parallel-sizes", "1", "--json", *device]
    assert main(argv + (["--quantization", quantization] if quantization else [])) == 0
    return json.loads(capsys.readouterr().out)["weight_bytes"]


def _all_but_experts(shape: str, quantization: str | None, device_type: str) -> int:
    """What the plan's model holds besides its experts (the linear layers' formats are tests/test_quantization's)."""
    import transformers

    from benchmarks.shapes import SHAPES
    from kvloom.cli.plan import quantization_method
    from kvloom.core.model.attention.base import TorchAttentionBackend
    from kvloom.core.model.linear import LinearBase
    from kvloom.core.model.loader import make_model
    from kvloom.core.model.moe import FusedMoE

    config = transformers.AutoConfig.for_model(**SHAPES[shape])
    method = quantization_method(config, quantization)
    model = make_model(config, TorchAttentionBackend(), torch.bfloat16, method)
    total = 0
    for m in model.modules():
        if isinstance(m, LinearBase):
            total += m.method.held_bytes(m, device_type)
        elif not isinstance(m, FusedMoE):
            total += sum(p.numel() * p.element_size() for p in m.parameters(recurse=False))
    return total


GPU = ["--gpu-memory", "141", "--dtype", "bfloat16"]
# Qwen3-30B-A3B: 48 layers of 128 experts, hidden 2048, expert intermediate 768; int4 in groups of 128
# (AWQ and GPTQ alike: half a byte a weight, an fp16 scale and a uint8 zero point per group and output).
QWEN3_EXPERTS = 48 * 128 * 3 * 768 * 2048
PLAN_EXPERTS = {
    None: QWEN3_EXPERTS * 2,
    "fp8": QWEN3_EXPERTS + 48 * 128 * 4 * (2 * 768 + 2048),  # e4m3, a float32 scale per output channel
    "awq": QWEN3_EXPERTS // 2 + QWEN3_EXPERTS // 128 * 3,
    "gptq": QWEN3_EXPERTS // 2 + QWEN3_EXPERTS // 128 * 3,
}


@pytest.mark.parametrize("quantization", [None, "fp8", "awq", "gptq"])
def test_engine_plan_sizes_quantized_experts_per_format(tmp_path, capsys, quantization):
    got = _plan(tmp_path, "qwen3-30b-a3b", quantization, capsys, GPU)
    assert got - _all_but_experts("qwen3-30b-a3b", quantization, "cuda") == PLAN_EXPERTS[quantization]
    # on the CPU the experts are dequantized at load: dense bf16 whatever the format
    cpu = _plan(tmp_path, "qwen3-30b-a3b", quantization, capsys, ["--device", "cpu", "--dtype", "bfloat16"])
    assert cpu - _all_but_experts("qwen3-30b-a3b", quantization, "cpu") == QWEN3_EXPERTS * 2


def test_engine_plan_sizes_gpt_oss_mxfp4_experts_at_four_and_a_quarter_bits(tmp_path, capsys):
    """gpt-oss-20b: 24 layers of 32 experts of 2880 x 2880; MXFP4 half a byte a weight and a byte of scale per
    32, the biases bf16; the rest of the model dense in either case."""
    weights = 24 * 32 * 3 * 2880 * 2880
    biases = 24 * 32 * (2 * 2880 + 2880) * 2
    dense = _plan(tmp_path, "gpt-oss-20b", None, capsys, GPU)
    mxfp4 = _plan(tmp_path, "gpt-oss-20b", "mxfp4", capsys, GPU)
    assert dense - mxfp4 == weights * 2 - (weights // 2 + weights // 32)
    assert mxfp4 - _all_but_experts("gpt-oss-20b", "mxfp4", "cuda") == weights // 2 + weights // 32 + biases


# --- tensor parallelism ---------------------------------------------------------------------------------
def _expert_layer(fmt: str, settings: dict, tp):
    from kvloom.core.model.distributed import TensorParallel
    from kvloom.core.model.moe import FusedMoE
    from kvloom.core.model.quantization import make_method

    qc = {"quant_method": "mxfp4"} if fmt == "mxfp4" else _quant_config(fmt, settings)
    method = make_method(fmt, type("HF", (), {"quantization_config": qc})())
    return FusedMoE(4, 64, 128, prefix="model.layers.0.mlp.experts", activation="swiglu_oai" if fmt == "mxfp4" else "silu",
                    bias=fmt == "mxfp4", tp=TensorParallel(*tp) if tp else None, method=method.moe_method("experts"))


def _checkpoint_tensors(fmt: str, settings: dict, gen) -> dict[str, torch.Tensor]:
    """One layer's experts as a checkpoint names them (``mlp.experts.<rest>``), 4 experts of 64 x 128."""
    if fmt == "mxfp4":
        out = {}
        for name, (n, k) in {"gate_up_proj": (256, 64), "down_proj": (64, 128)}.items():
            out[f"{name}_blocks"] = torch.randint(0, 256, (4, n, k // 32, 16), dtype=torch.uint8, generator=gen)
            out[f"{name}_scales"] = torch.randint(119, 124, (4, n, k // 32), dtype=torch.uint8, generator=gen)
            out[f"{name}_bias"] = torch.randn(4, n, generator=gen) * 0.2
        return out
    out = {}
    for e in range(4):
        for proj, shape in (("gate_proj", (128, 64)), ("up_proj", (128, 64)), ("down_proj", (64, 128))):
            t, _ = _quantize(torch.randn(*shape, generator=gen) * 0.1, fmt, settings, gen)
            out.update({f"{e}.{proj}.{k}": v for k, v in t.items()})
    return out


@pytest.mark.parametrize("case", ["fp8-block", "fp8-tensor", "awq-g32", "gptq-4bit-descact-asym",
                                  "gptq-4bit-sym-v2", "mxfp4"])
def test_quantized_experts_split_over_two_ranks_sum_to_the_whole(case):
    """Each rank loads its slice of every expert's intermediate dim from the same checkpoint tensors; the two
    ranks' partial outputs (which the engine all-reduces) add up to one rank's output."""
    from kvloom.core.model.families.gpt_oss import GptOssForCausalLM

    fmt, settings = ("mxfp4", {}) if case == "mxfp4" else CASES[case]
    gen = torch.Generator().manual_seed(5)
    tensors = _checkpoint_tensors(fmt, settings, gen)
    x = torch.randn(9, 64, generator=gen)
    weights, ids = torch.rand(9, 2, generator=gen), torch.stack([torch.randperm(4, generator=gen)[:2] for _ in range(9)])
    outs = []
    for tp in (None, (0, 2), (1, 2)):
        layer = _expert_layer(fmt, settings, tp)
        for rest, tensor in tensors.items():
            for leaf, shard, piece in GptOssForCausalLM.expert_tensors(rest, tensor, rest):
                if leaf not in getattr(layer.method, "ignored", ()):
                    param = layer._parameters[leaf]
                    param.weight_loader(param, piece, shard)
        layer.process_weights_after_loading()
        outs.append(layer(x, weights, ids))
    assert layer.w13_weight.shape == (4, 128, 64)  # half of each expert's 2 x 128 gate/up rows
    torch.testing.assert_close(outs[1] + outs[2], outs[0], atol=1e-5, rtol=1e-5)
    assert outs[0].abs().mean() > 1e-3


@pytest.mark.parametrize("case", ["fp8-block", "fp8-channel", "awq-g32", "gptq-4bit-descact-asym", "mxfp4"])
def test_the_gpu_layout_kept_packed_computes_the_dequantized_experts(case):
    """What a CUDA device keeps (the packed expert weights, as buffers; no dense copy), run here through the
    reference path, gives the same output as the CPU's experts dequantized at load."""
    fmt, settings = ("mxfp4", {}) if case == "mxfp4" else CASES[case]
    from kvloom.core.model.families.gpt_oss import GptOssForCausalLM

    gen = torch.Generator().manual_seed(7)
    tensors = _checkpoint_tensors(fmt, settings, gen)
    x = torch.randn(9, 64, generator=gen)
    weights, ids = torch.rand(9, 2, generator=gen), torch.stack([torch.randperm(4, generator=gen)[:2] for _ in range(9)])
    outs = []
    for packed in (False, True):
        layer = _expert_layer(fmt, settings, None)
        layer.method.method.keep_packed = packed
        for rest, tensor in tensors.items():
            for leaf, shard, piece in GptOssForCausalLM.expert_tensors(rest, tensor, rest):
                if leaf not in getattr(layer.method, "ignored", ()):
                    layer._parameters[leaf].weight_loader(layer._parameters[leaf], piece, shard)
        layer.process_weights_after_loading()
        outs.append(layer(x, weights, ids))
    assert "w13_weight" not in layer._parameters and any(n.startswith("w13_packed_") for n, _ in layer.named_buffers())
    assert layer.device.type == "cpu"
    torch.testing.assert_close(outs[1], outs[0], atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("fmt, settings", [("awq", {"group_size": 32}),
                                           ("gptq", {"bits": 4, "group_size": 32, "sym": False, "desc_act": False})],
                         ids=["awq-g32", "gptq-4bit-asym-g32"])
def test_quantized_qwen3_moe_on_two_ranks_over_gloo(fmt, settings, tmp_path):
    """The engine with tensor_parallel_size=2: each rank's slice of every quantized expert, decoding like
    transformers on the dequantized weights, chunked (7 tokens a step). (GPTQ desc_act cannot split the dense
    row-parallel layers' inputs: its experts' split is covered by the layer test above.)"""
    from kvloom.core.config import EngineConfig

    quant, ref = write_qwen3_moe(tmp_path, fmt, **settings)
    expected = hf_greedy(ref, _prompts(), MAX_NEW)
    llm = LLM(config=EngineConfig(model=str(quant), tensor_parallel_size=2, dtype="float32", block_size=8,
                                  max_num_batched_tokens=7))
    try:
        got = [o.token_ids for o in llm.generate(_prompts(), GREEDY, use_tqdm=False)]
        assert got == expected
        experts = llm.engine.model.moe_blocks()[0].experts
        assert experts.method.name == fmt and experts.local_intermediate * 2 == experts.intermediate_size
    finally:
        llm.engine.shutdown()


def test_online_fp8_experts_kept_packed_compute_what_the_cpu_rounding_does():
    """``--quantization fp8`` of dense experts: the CUDA layout (e4m3 with a scale per output channel, no dense
    copy) and the CPU's weights rounded at load give the same output."""
    from kvloom.core.model.moe import FusedMoE
    from kvloom.core.model.quantization import make_method

    gen = torch.Generator().manual_seed(9)
    w13, w2 = torch.randn(4, 256, 64, generator=gen) * 0.1, torch.randn(4, 64, 128, generator=gen) * 0.1
    x = torch.randn(9, 64, generator=gen)
    weights, ids = torch.rand(9, 2, generator=gen), torch.stack([torch.randperm(4, generator=gen)[:2] for _ in range(9)])
    outs = []
    for packed in (False, True):
        method = make_method("fp8", type("HF", (), {"quantization_config": None})())
        method.keep_packed = packed
        layer = FusedMoE(4, 64, 128, prefix="experts", method=method.moe_method("experts"))
        layer.w13_weight.weight_loader(layer.w13_weight, w13[:, :128], (None, "gate"))
        layer.w13_weight.weight_loader(layer.w13_weight, w13[:, 128:], (None, "up"))
        layer.w2_weight.weight_loader(layer.w2_weight, w2, (None, "down"))
        layer.process_weights_after_loading()
        outs.append(layer(x, weights, ids))
    assert "w13_weight" not in layer._parameters and layer.w13_packed_weight.dtype == torch.float8_e4m3fn
    torch.testing.assert_close(outs[1], outs[0], atol=1e-6, rtol=1e-6)
    dense = FusedMoE(4, 64, 128, prefix="experts")
    dense.w13_weight.data.copy_(w13)
    dense.w2_weight.data.copy_(w2)
    assert not torch.allclose(dense(x, weights, ids), outs[0], atol=1e-6)  # the rounding is there


def test_compressed_tensors_fp8_experts_are_refused_at_start_up_naming_the_format():
    from kvloom.core.config import ConfigError
    from kvloom.core.model.moe import FusedMoE
    from kvloom.core.model.quantization.fp8 import FP8Method

    method = FP8Method("compressed-tensors", "dynamic", None, "channel")
    with pytest.raises(ConfigError, match="compressed-tensors FP8 experts are not supported yet"):
        FusedMoE(4, 64, 128, prefix="model.layers.0.mlp.experts", method=method.moe_method("x"))
