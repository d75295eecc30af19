"""Tensor parallelism on the CPU (gloo, two processes): greedy parity with transformers on the tiny Llama,
Qwen2 and Qwen3 models under chunked prefill and the prefix cache, a clear error for sizes that do not
divide the model, prompt logprobs equal to one rank's and transformers', `engine plan` agreeing with the
start-up log, the real server with ``--tensor-parallel-size 2``, and a killed worker taking the engine down
instead of hanging it."""

from __future__ import annotations

import json
import logging
import os
import random
import signal
import time

import httpx
import pytest
import torch

from kvloom import LLM, SamplingParams
from kvloom.core.config import ConfigError, EngineConfig
from tests.conftest import hf_greedy, make_tiny_model
from tests.server_utils import EngineServer, alive, cmdline

MAX_NEW = 12


def _prompts() -> list[list[int]]:
    rng = random.Random(1)
    shared = [rng.randrange(3, 384) for _ in range(16)]  # two full blocks of 8: a prefix-cache hit
    return [[rng.randrange(3, 384)], shared + [rng.randrange(3, 384) for _ in range(5)],
            [rng.randrange(3, 384) for _ in range(33)], shared + [rng.randrange(3, 384) for _ in range(9)]]


@pytest.fixture(scope="module", params=["llama", "qwen2", "qwen3"])
def family_model(request, tmp_path_factory):
    path = make_tiny_model(tmp_path_factory.mktemp(f"tp-{request.param}"), request.param)
    prompts = _prompts()
    return request.param, path, prompts, hf_greedy(path, prompts, MAX_NEW)


def _tp_config(path, **options) -> EngineConfig:
    return EngineConfig(model=str(path), tensor_parallel_size=2, dtype="float32", block_size=8, num_kv_blocks=64,
                        max_num_batched_tokens=7, **options)


def test_tp2_greedy_parity_with_chunked_prefill_and_prefix_cache(family_model, caplog):
    family, path, prompts, expected = family_model
    # A 7-token budget pushes every long prompt through several chunks mixed with decodes; the second
    # pass finds the shared 16-token prefix (and whole prompts) in the cache. Llama also runs async
    # scheduling, where the workers take rank 0's sampled tokens as their next inputs.
    options = dict(plugins=["prefix_cache"])
    if family == "llama":
        options["async_scheduling"] = "on"
    config = _tp_config(path, **options)
    with caplog.at_level(logging.INFO, logger="kvloom"):
        llm = LLM(config=config)
    try:
        params = SamplingParams(temperature=0.0, max_tokens=MAX_NEW, ignore_eos=True)
        first = [o.token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
        assert first == expected
        second = [o.token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
        assert second == expected
        assert llm.engine.scheduler.prefix_cache_hits > 0
        assert llm.engine.kv.num_free_blocks() == llm.engine.kv.num_blocks  # every block came back
        # Each rank holds half the KV heads: 2 KV heads x 32 (or 16) dims of float32, split in two.
        kv_heads, head_dim = 2, llm.engine.model.head_dim
        assert llm.engine.model.num_kv_heads == kv_heads // 2
        assert llm.engine.runner.kv_caches[0][0].numel() == 64 * 8 * (kv_heads // 2) * head_dim
    finally:
        llm.engine.shutdown()

    # `engine plan` for the same settings prints what the engine logged: rank 0's weights and its KV cache.
    from kvloom.cli.plan import make_plan
    from kvloom.core.model.loader import load_hf_config

    plan = make_plan(config, load_hf_config(path), family)
    row = plan.rows[0]
    assert row.tensor_parallel == 2
    log = caplog.text
    assert f"per rank: {row.weight_bytes_per_gpu} bytes of weights" in log
    assert row.kv.describe() in log
    assert row.kv.bytes_per_token == 2 * 2 * (kv_heads // 2) * head_dim * 4  # K/V x layers x heads x dim x fp32
    assert plan.rows[0].weight_bytes_per_gpu < plan.weight_bytes * 0.6  # half the matrices, the norms whole


def _prompt_logprob_rows(out) -> tuple[list[int], torch.Tensor, list[int], list[list[int]], torch.Tensor]:
    lps = out.prompt_logprobs
    return ([lp.token_id for lp in lps], torch.tensor([lp.logprob for lp in lps]), [lp.rank for lp in lps],
            [[t.token_id for t in lp.top] for lp in lps], torch.tensor([[t.logprob for t in lp.top] for lp in lps]))


@pytest.mark.parametrize("async_scheduling", ["off", "on"])
def test_tp2_prompt_logprobs_equal_the_single_rank_engine_and_transformers(tiny_llama, async_scheduling):
    from tests.test_compat_prompt_logprobs import hf_prompt_logprobs

    rng = random.Random(2)
    # 300 tokens under a 280-token budget: two prefill chunks, the first scoring more rows than one
    # logits slice (sampler.PROMPT_LOGITS_ROWS), so each rank gathers several slices of prompt logits.
    # Beside it, a short prompt that asks too (scored in the second step, beside the long one's tail)
    # and one that does not.
    prompts = [[1] + [rng.randrange(3, 384) for _ in range(299)], [1] + [rng.randrange(3, 384) for _ in range(20)],
               [rng.randrange(3, 384) for _ in range(9)]]
    top = 4
    wants = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True, prompt_logprobs=top)
    params = [wants, wants, SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)]
    options = dict(dtype="float32", block_size=8, num_kv_blocks=96, max_num_batched_tokens=280,
                   async_scheduling=async_scheduling)
    single = LLM(config=EngineConfig(model=str(tiny_llama), **options))
    one_rank = single.generate(prompts, params, use_tqdm=False)
    del single
    llm = LLM(config=EngineConfig(model=str(tiny_llama), tensor_parallel_size=2, **options))
    try:
        two_ranks = llm.generate(prompts, params, use_tqdm=False)
    finally:
        llm.engine.shutdown()
    assert [o.token_ids for o in two_ranks] == [o.token_ids for o in one_rank] == hf_greedy(tiny_llama, prompts, 4)
    assert two_ranks[2].prompt_logprobs is None and one_rank[2].prompt_logprobs is None
    for prompt, got, ref in zip(prompts[:2], two_ranks, one_rank):
        expected = hf_prompt_logprobs(tiny_llama, prompt)
        ids, lps, ranks, top_ids, top_lps = _prompt_logprob_rows(got)
        ref_ids, ref_lps, ref_ranks, _, ref_top_lps = _prompt_logprob_rows(ref)
        assert ids == ref_ids == prompt[1:]
        want = expected.gather(1, torch.tensor(prompt[1:])[:, None])[:, 0]
        torch.testing.assert_close(lps, ref_lps, atol=1e-4, rtol=0)
        torch.testing.assert_close(lps, want, atol=1e-4, rtol=0)
        # The top alternatives and ranks, read so that two tokens within float noise of each other may
        # swap places: the listed logprobs are transformers' best ones, each under the token listed with it.
        torch.testing.assert_close(top_lps, expected.topk(top, dim=-1).values, atol=1e-4, rtol=0)
        torch.testing.assert_close(top_lps, ref_top_lps, atol=1e-4, rtol=0)
        torch.testing.assert_close(expected.gather(1, torch.tensor(top_ids)), top_lps, atol=1e-4, rtol=0)
        lowest = (expected > want[:, None] + 1e-4).sum(-1) + 1
        highest = (expected > want[:, None] - 1e-4).sum(-1) + 1
        assert all(lo <= r <= hi for r, lo, hi in zip(ranks, lowest.tolist(), highest.tolist()))
        assert all(lo <= r <= hi for r, lo, hi in zip(ref_ranks, lowest.tolist(), highest.tolist()))


def test_sizes_that_do_not_divide_the_model_are_refused(tiny_llama):
    # The tiny models have 4 attention heads and 2 KV heads: 3 ranks cannot split them.
    with pytest.raises(ConfigError, match=r"tensor_parallel_size=3 does not divide the model's "
                                          r"num_attention_heads=4"):
        LLM(str(tiny_llama), tensor_parallel_size=3, dtype="float32")
    # 4 splits the attention heads but not the 2 KV heads (they are not replicated).
    with pytest.raises(ConfigError, match=r"num_key_value_heads=2 \(replicating KV heads"):
        LLM(str(tiny_llama), tensor_parallel_size=4, dtype="float32")
    with pytest.raises(ConfigError, match="tensor_parallel_size=0 must be >= 1"):
        LLM(str(tiny_llama), tensor_parallel_size=0)
    # Speculation's verify steps are not broadcast to the workers: refused before any worker starts,
    # instead of a collective that waits for a step a worker never runs.
    started = time.monotonic()
    with pytest.raises(ConfigError, match=r"spec_decode\) cannot run with tensor_parallel_size=2"):
        LLM(str(tiny_llama), tensor_parallel_size=2, dtype="float32", plugins=["spec_decode"])
    assert time.monotonic() - started < 60


def test_a_quantized_layer_whose_groups_do_not_split_is_a_start_up_error():
    from transformers import LlamaConfig

    from kvloom.core.model.linear import RowLinear
    from kvloom.core.model.quantization import make_method

    hf = LlamaConfig(quantization_config={"quant_method": "gptq", "bits": 4, "group_size": 128,
                                          "desc_act": False, "sym": True})
    method = make_method("gptq", hf)
    # 256 inputs over 4 ranks leave 64 per rank: not one whole group of 128.
    with pytest.raises(ConfigError, match=r"64 inputs do not split into GPTQ groups of quantization_config.group_size=128"):
        with torch.device("meta"):
            RowLinear(256, 64, False, prefix="model.layers.0.mlp.down_proj",
                      method=method.linear_method("model.layers.0.mlp.down_proj", ["down"]), tp_rank=0, tp_size=4)


def test_dense_layers_narrow_by_rank():
    from kvloom.core.model.linear import MergedColumnLinear, RowLinear, UnquantizedLinearMethod

    torch.manual_seed(0)
    gate, up, down = torch.randn(8, 6), torch.randn(8, 6), torch.randn(6, 8)
    x = torch.randn(3, 6)
    partial = []
    for rank in range(2):
        col = MergedColumnLinear(6, [8, 8], False, prefix="gate_up", method=UnquantizedLinearMethod(),
                                 tp_rank=rank, tp_size=2)
        col.weight_loader(col.weight, gate, 0)
        col.weight_loader(col.weight, up, 1)
        row = RowLinear(8, 6, False, prefix="down", method=UnquantizedLinearMethod(), tp_rank=rank, tp_size=2)
        row.weight_loader(row.weight, down)
        g, u = col(x).chunk(2, dim=-1)
        partial.append(row(g * u))
    expected = ((x @ gate.T) * (x @ up.T)) @ down.T
    torch.testing.assert_close(partial[0] + partial[1], expected)  # what the all-reduce sums


def _worker_pid(server: EngineServer) -> int:
    for pid in server.descendants():
        if "kvloom.launch.tp_worker" in cmdline(pid):
            return pid
    raise LookupError("no tensor-parallel worker process")


def test_server_with_tensor_parallel_2_answers_and_a_killed_worker_ends_it(tiny_llama, tmp_path):
    server = EngineServer(["--model", str(tiny_llama), "--tensor-parallel-size", "2", "--dtype", "float32",
                           "--num-kv-blocks", "64", "--block-size", "8"], tmp_path)
    try:
        server.wait_ready(timeout=300)
        with httpx.Client(timeout=120) as http:
            prompt = [5, 9, 33, 17, 81, 200]
            r = http.post(server.url + "/v1/completions", json={
                "model": str(tiny_llama), "prompt": prompt, "max_tokens": 8, "temperature": 0, "ignore_eos": True})
            assert r.status_code == 200, r.text
            assert r.json()["usage"]["completion_tokens"] == 8 and r.json()["choices"][0]["text"]
            assert "per rank" in server.log() and "Tensor parallel: 2 ranks (gloo)" in server.log()

            worker = _worker_pid(server)
            # Killed in the middle of a stream, while rank 0 waits in a collective for it.
            with http.stream("POST", server.url + "/v1/completions", json={
                    "model": str(tiny_llama), "prompt": prompt, "max_tokens": 480, "ignore_eos": True,
                    "stream": True}) as stream:
                lines = (line for line in stream.iter_lines() if line.startswith("data:"))
                first = [next(lines) for _ in range(3)]
                os.kill(worker, signal.SIGKILL)
                t0 = time.monotonic()
                rest = list(lines)
            assert len(first) == 3 and rest[-1] == "data: [DONE]"
            error = json.loads(rest[-2].removeprefix("data:"))["error"]
            assert error["code"] == 503 and "tensor-parallel worker rank 1" in error["message"]
            # Within a generous bound for a loaded 2-core machine: the engine notices, tells the frontends,
            # and /health turns 503 (or the whole server exits non-zero); never a hang.
            down = False
            while time.monotonic() - t0 < 90 and not down:
                if server.proc.poll() is not None:
                    down = server.proc.returncode != 0
                    break
                try:
                    down = http.get(server.url + "/health", timeout=5).status_code == 503
                except httpx.HTTPError:
                    pass
                time.sleep(0.5)
            assert down, f"the engine did not go down after its worker was killed:\n{server.log()}"
            assert time.monotonic() - t0 < 90
            assert "tensor-parallel worker rank 1" in server.log()
            try:
                r = http.post(server.url + "/v1/completions", json={"model": str(tiny_llama), "prompt": prompt,
                                                                   "max_tokens": 2}) if server.proc.poll() is None else None
            except httpx.TransportError:
                # It closed its socket between the poll and the request (refused, or accepted and dropped):
                # it is exiting, and must be gone soon.
                server.proc.wait(timeout=60)
                r = None
            assert r is None or r.status_code == 503
    finally:
        server.stop(timeout=60)
    assert not alive(worker)


@pytest.mark.parametrize("name,family,fmt,settings", [
    ("awq-g32", "llama", "awq", dict(group_size=32)),
    ("gptq-8bit-g64", "qwen2", "gptq", dict(bits=8, group_size=64, sym=False, desc_act=False)),
    ("fp8-block32", "qwen3", "fp8", dict(strategy="block", block=32)),
])
def test_tp2_quantized_checkpoints_decode_like_transformers(tmp_path, name, family, fmt, settings):
    from tests.quant_checkpoints import write_checkpoint

    # Every rank's share of the inputs is whole groups (blocks): 64 or 128 inputs per rank, groups of 32/64.
    quant, ref = write_checkpoint(tmp_path, family, fmt, **settings)
    prompts = _prompts()
    llm = LLM(config=_tp_config(quant))
    try:
        got = [o.token_ids for o in llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=MAX_NEW,
                                                                         ignore_eos=True), use_tqdm=False)]
    finally:
        llm.engine.shutdown()
    assert got == hf_greedy(ref, prompts, MAX_NEW)


def test_gptq_desc_act_cannot_split_its_row_parallel_inputs(tmp_path):
    from tests.quant_checkpoints import write_checkpoint

    quant, _ = write_checkpoint(tmp_path, "llama", "gptq", bits=4, group_size=32, sym=True, desc_act=True)
    with pytest.raises(ValueError, match=r"(o_proj|down_proj).*GPTQ with desc_act=True cannot split a row-parallel layer's "
                                         r"inputs over tensor_parallel_size=2"):
        LLM(config=_tp_config(quant))
