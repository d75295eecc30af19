"""The MoE layer against transformers' own modules: each router variant, each family's sparse block loaded
through the family's checkpoint mapping (gpt-oss's interleaved gate/up columns, transformers 5's stacked
experts), the tensor-parallel split of every expert, and what a user sees around it: missing or misshapen
expert tensors named at load, formats that cannot quantize experts refused, ``engine plan``'s total and
active parameters, and the start-up log."""

from __future__ import annotations

import json
import logging
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file

from benchmarks.shapes import SHAPES
from kvloom import LLM, SamplingParams
from kvloom.cli.main import main
from kvloom.cli.plan import count_parameters
from kvloom.core.config import ConfigError
from kvloom.core.model.attention.base import TorchAttentionBackend
from kvloom.core.model.distributed import TensorParallel, tp_refusal
from kvloom.core.model.families import model_class
from kvloom.core.model.loader import load_hf_config
from kvloom.core.model.moe import SOFTMAX_TOPK, TOPK_SOFTMAX, FusedMoE, Router, RouterSpec
from kvloom.kernels.moe import reference
from tests.conftest import MOE_FAMILIES, TINY_COMMON, hf_greedy, make_tiny_model, make_tokenizer
from tests.test_plan import checkpoint_bytes


def _hf_config(family: str, **changes):
    import transformers

    cls_name, arch, extra = MOE_FAMILIES[family]
    return getattr(transformers, cls_name)(**{**TINY_COMMON, **extra, **changes}, architectures=[arch])


def _randomize(module: torch.nn.Module, seed: int = 0) -> torch.nn.Module:
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in module.parameters():
            p.copy_(torch.randn(p.shape, generator=gen) * 0.3)
    return module.eval()


# --- the router ------------------------------------------------------------------------------------
def _hf_router(family: str, config):
    from transformers.models.gpt_oss.modeling_gpt_oss import GptOssTopKRouter
    from transformers.models.mixtral.modeling_mixtral import MixtralTopKRouter
    from transformers.models.qwen2_moe.modeling_qwen2_moe import Qwen2MoeTopKRouter
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeTopKRouter

    cls = {"mixtral": MixtralTopKRouter, "qwen2_moe": Qwen2MoeTopKRouter, "qwen3_moe": Qwen3MoeTopKRouter,
           "gpt_oss": GptOssTopKRouter}[family]
    return _randomize(cls(config))


@pytest.mark.parametrize("family,changes", [
    ("mixtral", {}), ("qwen2_moe", {"norm_topk_prob": False}), ("qwen2_moe", {"norm_topk_prob": True}),
    ("qwen3_moe", {"norm_topk_prob": True}), ("qwen3_moe", {"norm_topk_prob": False}), ("gpt_oss", {}),
])
def test_router_variants_equal_transformers(family, changes):
    config = _hf_config(family, **changes)
    hf = _hf_router(family, config)
    spec = model_class(config).router_spec(config)
    router = Router(config.hidden_size, spec)
    router.load_state_dict(hf.state_dict())
    h = torch.randn(37, config.hidden_size)
    _, hf_weights, hf_ids = hf(h)
    weights, ids = router(h)
    assert torch.equal(ids, hf_ids)
    torch.testing.assert_close(weights, hf_weights.float(), rtol=0, atol=1e-7)
    # what each variant means for the weights a token's experts get
    sums = weights.sum(-1)
    if spec.scoring == TOPK_SOFTMAX or spec.renormalize:
        torch.testing.assert_close(sums, torch.ones_like(sums))
    else:
        assert sums.mean() < 0.99  # the top k's share of the softmax over every expert
    assert (spec.scoring, spec.renormalize) == (
        (TOPK_SOFTMAX, True) if family == "gpt_oss" else (SOFTMAX_TOPK, changes.get("norm_topk_prob", True)))


# --- the sparse block, loaded through the family's checkpoint mapping ---------------------------------
def _hf_block(family: str, config):
    from transformers.models.gpt_oss.modeling_gpt_oss import GptOssMLP
    from transformers.models.mixtral.modeling_mixtral import MixtralSparseMoeBlock
    from transformers.models.qwen2_moe.modeling_qwen2_moe import Qwen2MoeSparseMoeBlock
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeSparseMoeBlock

    cls = {"mixtral": MixtralSparseMoeBlock, "qwen2_moe": Qwen2MoeSparseMoeBlock,
           "qwen3_moe": Qwen3MoeSparseMoeBlock, "gpt_oss": GptOssMLP}[family]
    block = cls(config)
    if family == "gpt_oss":  # older transformers (5.17) sets its constants here, not the config's clamp
        block.experts.alpha, block.experts.limit = config.swiglu_alpha, config.swiglu_limit
    return _randomize(block)


def _kvloom_block(family: str, config, hf_block, tp: TensorParallel | None = None):
    """The first sparse layer's MoE block of a kvloom model, loaded by the model's ``load_weights`` from the
    transformers block's state dict named as checkpoints name it (gpt-oss: ``mlp.router`` and its own expert
    layout; Mixtral: ``block_sparse_moe.experts.N.w1/w3/w2``; the Qwens: transformers 5's stacked experts)."""
    family_cls = model_class(config)
    layer = next(i for i in range(config.num_hidden_layers) if family_cls.is_sparse(config, i))
    prefix = f"model.layers.{layer}." + ("block_sparse_moe." if family == "mixtral" else "mlp.")
    state = hf_block.state_dict()
    if family == "mixtral":  # the checkpoints' names for one expert each
        gate, up = state.pop("experts.gate_up_proj").chunk(2, dim=1)
        down = state.pop("experts.down_proj")
        for e in range(config.num_local_experts):
            state.update({f"experts.{e}.w1.weight": gate[e], f"experts.{e}.w3.weight": up[e],
                          f"experts.{e}.w2.weight": down[e]})
    model = family_cls(config, TorchAttentionBackend(), None, tp=tp)
    loaded = model.load_weights((prefix + k, v) for k, v in state.items())
    block = model.layers[layer].mlp
    expected = {(n, s) for n, s in model.required_weights() if n.startswith(f"layers.{layer}.mlp.")}
    assert expected == loaded  # every parameter of the block, every expert's every projection
    return block.eval()


def _routed(block_out):
    return block_out[0] if isinstance(block_out, tuple) else block_out


@pytest.mark.parametrize("family", sorted(MOE_FAMILIES))
def test_sparse_block_equals_transformers_and_splits_over_ranks(family):
    """The whole block (router, experts, shared expert) equals transformers' on random weights and biases
    (gpt-oss: its gate/up columns de-interleaved, the clamp cutting the activations); loaded as rank 0
    and rank 1 of two, the ranks' partial sums add up to it, each bias counted once."""
    config = _hf_config(family)
    hf = _hf_block(family, config)
    x = torch.randn(3, 11, config.hidden_size)
    with torch.no_grad():
        want = _routed(hf(x)).reshape(-1, config.hidden_size)
        got = _kvloom_block(family, config, hf)(x.reshape(-1, config.hidden_size))
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
        parts = [_kvloom_block(family, config, hf, TensorParallel(rank, 2))(x.reshape(-1, config.hidden_size))
                 for rank in range(2)]
    torch.testing.assert_close(parts[0] + parts[1], want, rtol=1e-5, atol=1e-5)
    assert not torch.allclose(parts[0], want, atol=1e-3)  # each rank holds only part of it


def test_gpt_oss_gate_up_columns_interleave_and_the_clamp_bites():
    """gpt-oss's ``gate_up_proj`` alternates gate and up columns: read as halves (Mixtral's layout) the
    experts compute something else; and the config's swiglu_limit clamps these activations."""
    from kvloom.core.model.families.gpt_oss import deinterleave_gate_up

    config = _hf_config("gpt_oss")
    hf = _hf_block("gpt_oss", config).experts
    gate, up = deinterleave_gate_up(hf.gate_up_proj.detach())
    assert torch.equal(gate[:, :, 0], hf.gate_up_proj[:, 0, 0::2])
    assert torch.equal(up[:, 3, :], hf.gate_up_proj[:, :, 7])
    gate_up = torch.randn(5, config.hidden_size) @ hf.gate_up_proj[0].detach() + hf.gate_up_proj_bias[0].detach()
    assert (gate_up.abs() > config.swiglu_limit).any()
    halves = torch.cat(hf.gate_up_proj.detach().chunk(2, dim=-1), dim=-1)
    assert not torch.equal(halves, torch.cat([gate, up], dim=1).transpose(1, 2))


def test_reference_runs_only_the_experts_that_got_tokens(monkeypatch):
    """The CPU path sorts a step's rows by expert once and runs one matmul per projection per expert with
    tokens: 64 tokens over 3 of 16 experts cost 6 matmuls, not a loop over experts or tokens."""
    calls = []

    def linear(x, w, b=None):
        calls.append(x.shape[0])
        return F.linear(x, w, b)

    monkeypatch.setattr(reference, "F", SimpleNamespace(linear=linear, silu=F.silu))
    experts = FusedMoE(16, 32, 24, prefix="experts")
    with torch.no_grad():
        for p in experts.parameters():
            p.normal_()
    ids = torch.tensor([[1, 7], [7, 12]]).repeat(32, 1)
    out = experts(torch.randn(64, 32), torch.full((64, 2), 0.5), ids)
    assert out.shape == (64, 32)
    assert sorted(calls) == [32, 32, 32, 32, 64, 64]  # experts 1 and 12: 32 rows each; expert 7: 64


# --- loading and start-up ----------------------------------------------------------------------------
@pytest.fixture(scope="module")
def tiny_mixtral(tmp_path_factory):
    return make_tiny_model(tmp_path_factory.mktemp("moe-mixtral"), "mixtral")


def test_transformers_5_stacked_expert_names_load(tmp_path):
    """A checkpoint written from transformers 5's own state dict (``mlp.experts.gate_up_proj`` ``[E, 2I, H]``
    and ``down_proj`` stacked) serves the same tokens as the per-expert names save_pretrained writes."""
    import transformers

    saved = make_tiny_model(tmp_path / "saved", "qwen2_moe")
    model = transformers.AutoModelForCausalLM.from_pretrained(str(saved), dtype=torch.float32)
    state = model.state_dict()
    assert "model.layers.0.mlp.experts.gate_up_proj" in state
    stacked = tmp_path / "stacked"
    model.config.save_pretrained(str(stacked))
    save_file({k: v.contiguous() for k, v in state.items()}, str(stacked / "model.safetensors"))
    make_tokenizer(stacked)
    prompts = [[5, 9, 33, 71, 200, 17, 8], [300]]
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    got = [o.token_ids for o in LLM(str(stacked)).generate(prompts, params, use_tqdm=False)]
    assert got == hf_greedy(saved, prompts, 12)


def test_missing_or_misshapen_expert_tensors_are_named(tiny_mixtral, tmp_path):
    state = load_file(str(tiny_mixtral / "model.safetensors"))
    broken = tmp_path / "missing"
    broken.mkdir()
    for f in ("config.json", "tokenizer.json", "tokenizer_config.json"):
        (broken / f).write_bytes((tiny_mixtral / f).read_bytes())
    save_file({k: v for k, v in state.items() if k != "model.layers.1.block_sparse_moe.experts.4.w3.weight"},
              str(broken / "model.safetensors"))
    missing = r"lacks weights for layers\.1\.mlp\.experts\.w13_weight \(shard \(4, 'up'\)\)"
    with pytest.raises(ValueError, match=missing):
        LLM(str(broken))
    state["model.layers.0.block_sparse_moe.experts.2.w2.weight"] = torch.zeros(72, 41)
    save_file(state, str(broken / "model.safetensors"))
    with pytest.raises(ValueError, match=r"w2_weight shard \(2, 'down'\).*\(72, 41\).*intermediate dim of 40"):
        LLM(str(broken))


def test_quantized_experts_and_unsplittable_sizes_are_refused_at_start_up(tiny_mixtral):
    # Mixtral's experts of 72 and 40 inputs: no whole MXFP4 blocks of 32
    with pytest.raises(ConfigError, match=r"layers.0.mlp.experts: 40 inputs do not split into MXFP4 blocks of 32"):
        LLM(str(tiny_mixtral), quantization="mxfp4", load_format="dummy")
    config = _hf_config("qwen3_moe", moe_intermediate_size=25)
    assert tp_refusal(config, 2) == "tensor_parallel_size=2 does not divide the model's moe_intermediate_size=25"


def test_start_up_log_names_experts_top_k_and_kernel(tiny_mixtral, caplog):
    with caplog.at_level(logging.INFO, logger="kvloom"):
        LLM(str(tiny_mixtral))
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("MoE:")]
    assert lines == ["MoE: 6 experts, top-2 (softmax, top-k renormalised) on 2 of 2 layers; expert intermediate "
                     "size 40; activation silu; experts dense; kernel PyTorch reference (rows sorted by expert, one "
                     "matmul a projection for each expert with tokens)"]


# --- engine plan ----------------------------------------------------------------------------------------
@pytest.mark.parametrize("shape,total,active", [
    ("mixtral-8x7b", 46_702_792_704, 12_879_925_248),  # published: 46.7B total, 12.9B active
    ("qwen3-30b-a3b", 30_532_122_624, 3_353_032_704),  # published: 30.5B total, 3.3B active
    ("gpt-oss-20b", 20_914_757_184, 4_187_440_704),  # published: 20.9B total; 3.6B active without the embedding
])
def test_plan_counts_total_and_active_parameters(tmp_path, capsys, shape, total, active):
    path = tmp_path / "config.json"
    path.write_text(json.dumps(SHAPES[shape]))
    assert main(["plan", "--config-json", str(path), "--dtype", "bfloat16", "--gpu-memory", "80", "--json"]) == 0
    plan = json.loads(capsys.readouterr().out)
    assert (plan["parameters"]["total"], plan["parameters"]["active"]) == (total, active)
    sinks = SHAPES[shape]["num_hidden_layers"] * SHAPES[shape]["num_attention_heads"] if shape == "gpt-oss-20b" else 0
    assert plan["weight_bytes"] == 2 * total + 2 * sinks  # bfloat16, but the attention sinks in float32
    if shape == "gpt-oss-20b":
        assert active - SHAPES[shape]["vocab_size"] * SHAPES[shape]["hidden_size"] == 3_608_307_264
    rows = {r["tensor_parallel"]: r["weight_bytes_per_gpu"] for r in plan["rows"]}
    # the experts split by rank: each GPU of 2 holds half of nearly everything (norms and routers whole)
    assert 0.5 < rows[2] / rows[1] < 0.5005 and 0.25 < rows[4] / rows[1] < 0.2505
    assert main(["plan", "--config-json", str(path), "--dtype", "bfloat16", "--gpu-memory", "80"]) == 0
    text = capsys.readouterr().out
    assert f"{active:,} active per token" in text and f"top-{SHAPES[shape]['num_experts_per_tok']}" in text


def test_cpu_plan_equals_the_engines_moe_weights(tiny_mixtral, capsys):
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(str(tiny_mixtral))
    counts = count_parameters(load_hf_config(tiny_mixtral))
    assert counts.total == sum(p.numel() for p in hf.parameters())
    assert counts.expert_weights == sum(p.numel() for n, p in hf.named_parameters() if ".experts." in n)
    assert counts.active == counts.total - counts.expert_weights * 4 // 6  # 2 of 6 experts a token
    llm = LLM(str(tiny_mixtral))
    assert main(["plan", "--model", str(tiny_mixtral), "--device", "cpu", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["weight_bytes"] == checkpoint_bytes(llm.engine.model)


def test_cuda_graphs_stay_off_while_the_experts_run_on_the_reference(tiny_mixtral, monkeypatch):
    """The reference reads each expert's row count on the host, which a CUDA graph capture forbids: the
    engine asks the model before capturing (a kernel that names itself lifts it)."""
    from kvloom.kernels import moe as moe_kernels

    model = LLM(str(tiny_mixtral)).engine.model
    assert "PyTorch reference" in model.cuda_graphs_refusal()
    monkeypatch.setattr(moe_kernels, "kernel_name", lambda device: "triton", raising=False)
    assert model.cuda_graphs_refusal() is None
