"""Memory with a draft model (spec_decode method=draft): the GPU start-up profile budgets only this
engine's own use (weights, activation peak) and fits the KV cache of both models in it, beside what
other processes and other engines hold; ``engine plan`` counts the draft's weights and KV per token."""

from __future__ import annotations

import json

import pytest
import torch

from kvloom import LLM
from kvloom.core.engine import capacity
from tests.test_spec_decode import _make_draft, _spec

GiB = capacity.GiB


class FakeGpu:
    """What ``torch.cuda`` reports for one device, scripted: memory held by another process, this
    process's CUDA context, and this process's PyTorch allocator (``allocated``, plus ``cached``
    blocks it keeps); a profile forward peaks ``activation`` bytes above what is allocated."""

    def __init__(self, total: int, other_process: int, context: int, allocated: int) -> None:
        self.total, self.other_process, self.context = total, other_process, context
        self.allocated, self.cached, self.activation = allocated, 0, 0

    def install(self, monkeypatch) -> None:
        cuda = torch.cuda
        monkeypatch.setattr(cuda, "mem_get_info", lambda device=None: (self.free(), self.total))
        monkeypatch.setattr(cuda, "memory_allocated", lambda device=None: self.allocated)
        monkeypatch.setattr(cuda, "memory_reserved", lambda device=None: self.allocated + self.cached)
        monkeypatch.setattr(cuda, "max_memory_allocated", lambda device=None: self.allocated + self.activation)
        monkeypatch.setattr(cuda, "reset_peak_memory_stats", lambda device=None: None)
        monkeypatch.setattr(cuda, "synchronize", lambda device=None: None)
        monkeypatch.setattr(cuda, "empty_cache", lambda: setattr(self, "cached", 0))

    def free(self) -> int:
        return self.total - self.other_process - self.context - self.allocated - self.cached


@pytest.fixture(scope="module")
def draft_engine(tiny_llama, tmp_path_factory):
    """A CPU engine with a draft model (one layer against the target's two, the same width); its GPU
    profile is then run against FakeGpu figures (the forwards themselves run on the CPU)."""
    draft = _make_draft(tmp_path_factory.mktemp("draft") / "small", "llama")
    llm = LLM(str(tiny_llama), device="cpu", plugins=["spec_decode"],
              plugin_options=_spec(3, method="draft", draft_model=str(draft)))
    return llm.engine


def _profile(engine, monkeypatch, gpu: FakeGpu, weights: int, non_torch: int, activation: int):
    """Start the engine's accounting as EngineCore does before loading, then load (weights, cuBLAS
    workspaces outside PyTorch) and profile: the KV capacity it would allocate."""
    gpu.install(monkeypatch)
    monkeypatch.setattr(engine, "_gpu_start", capacity.gpu_memory_snapshot(torch.device("cpu")))
    gpu.allocated += weights
    gpu.cached += 3 * GiB // 2  # the allocator keeps freed loading buffers: reusable, not used
    gpu.context += non_torch
    gpu.activation = activation
    monkeypatch.setattr(engine, "config", engine.config.replace(kv_cache_memory_gib=None, gpu_memory_utilization=0.9))
    return engine._kv_capacity()


def test_gpu_profile_counts_this_engines_memory_only_and_both_models_kv(draft_engine, monkeypatch):
    bs = draft_engine.config.block_size
    target, draft = draft_engine.capacity.bytes_per_token, draft_engine.capacity.draft_bytes_per_token
    assert draft * 2 == target  # one layer against two: the draft's cache is half the target's per token
    per_block = bs * (target + draft)
    reserve = capacity.PROFILE_RESERVE_BYTES

    # Alone on a 141 GiB GPU: 0.9 x 141 GiB less this engine's 2 GiB of weights, 1 GiB of activations and
    # 0.25 GiB of cuBLAS workspaces. The CUDA context (there before the engine began) is not its own.
    alone = FakeGpu(141 * GiB, other_process=0, context=GiB // 2, allocated=0)
    cap = _profile(draft_engine, monkeypatch, alone, weights=2 * GiB, non_torch=GiB // 4, activation=GiB)
    budget = int(0.9 * 141 * GiB) - 2 * GiB - GiB - GiB // 4 - reserve
    assert cap.num_blocks == budget // per_block
    assert cap.bytes <= budget and cap.draft_bytes_per_token == draft

    # Another process holds 60 GiB and an engine started earlier in this process holds 20 GiB: neither
    # counts against this engine's share, but the cache must fit beside them (141 - 60 - 20 - 0.75 of
    # context and workspaces - 2 of weights = 58.25 GiB free), with the activation peak still to come.
    shared = FakeGpu(141 * GiB, other_process=60 * GiB, context=GiB // 2, allocated=20 * GiB)
    cap = _profile(draft_engine, monkeypatch, shared, weights=2 * GiB, non_torch=GiB // 4, activation=GiB)
    fits = 141 * GiB - 60 * GiB - 20 * GiB - 3 * GiB // 4 - 2 * GiB - GiB - reserve
    assert cap.num_blocks == fits // per_block


def test_gpu_profile_runs_the_draft_models_largest_forward_too(draft_engine, monkeypatch):
    calls = []
    model = draft_engine.proposer.model
    forward = model.forward
    monkeypatch.setattr(model, "forward", lambda ids, *a, **kw: calls.append(ids.shape[0]) or forward(ids, *a, **kw))
    gpu = FakeGpu(80 * GiB, other_process=0, context=0, allocated=0)
    _profile(draft_engine, monkeypatch, gpu, weights=GiB, non_torch=0, activation=GiB)
    cfg = draft_engine.config
    assert calls == [min(cfg.max_num_batched_tokens, draft_engine.max_model_len)]


def test_plan_counts_the_draft_models_weights_and_kv_per_token(tiny_llama, tmp_path, capsys):
    from kvloom.builder import build_engine
    from kvloom.core.config import EngineConfig
    from tests.test_plan import checkpoint_bytes, plan_json

    draft = _make_draft(tmp_path / "small", "llama")
    options = {"spec_decode": {"method": "draft", "draft_model": str(draft)}}
    spec = ["--plugins", "spec_decode", "--plugin-options", json.dumps(options)]
    # CPU: the plan prints the KV line the engine logs, with both models' bytes per token in it.
    engine = build_engine(EngineConfig(model=str(tiny_llama), device="cpu", plugins=["spec_decode"],
                                     plugin_options=options))
    plan = plan_json(capsys, "--model", str(tiny_llama), "--device", "cpu", *spec)
    plain = plan_json(capsys, "--model", str(tiny_llama), "--device", "cpu")
    assert plan["rows"][0]["kv_cache_line"] == engine.capacity.describe()
    assert "+ the draft model 256 bytes/token" in plan["rows"][0]["kv_cache_line"]
    assert plan["draft"]["weight_bytes"] == checkpoint_bytes(engine.proposer.model)
    assert plan["draft"]["kv_bytes_per_token"] == engine.capacity.draft_bytes_per_token == 256
    assert plan["rows"][0]["kv_blocks"] == plain["rows"][0]["kv_blocks"] * 2 // 3  # 512 + 256 bytes per token

    # GPU (an estimate for 80 GiB): the draft's weights come out of the budget, and a block costs both
    # models' KV; tensor parallel sizes other than 1 are not planned (the engine refuses them).
    gpu = plan_json(capsys, "--model", str(tiny_llama), "--gpu-memory", "80", *spec)
    gpu_plain = plan_json(capsys, "--model", str(tiny_llama), "--gpu-memory", "80")
    row, row_plain = gpu["rows"][0], gpu_plain["rows"][0]
    assert [r["tensor_parallel"] for r in gpu["rows"]] == [1]
    assert row["weight_bytes_per_gpu"] == row_plain["weight_bytes_per_gpu"] + gpu["draft"]["weight_bytes"]
    assert row["kv_budget_bytes"] <= row_plain["kv_budget_bytes"] - gpu["draft"]["weight_bytes"]
    per_token = row["kv_bytes_per_token"] + gpu["draft"]["kv_bytes_per_token"]
    assert row["kv_blocks"] == row["kv_budget_bytes"] // (16 * per_token)
    assert any("draft model" in note for note in gpu["notes"])
