"""Multi-LoRA serving in the engine: greedy token-for-token parity with PEFT on transformers (float32) on
tiny Llama and Qwen2 models (and Gemma 3 on a hybrid KV cache), three adapters of different ranks and
targets and the base model in one batch, under chunked prefill, preemption, the prefix cache (no KV shared
between adapters), async scheduling, speculative decoding, few slots and a small host LRU; bad adapters
refused with clear errors; unloading refused while an adapter is in use."""

from __future__ import annotations

import json
import shutil

import pytest
import torch

from kvloom import LLM, SamplingParams
from kvloom.core.config import ConfigError, EngineConfig
from kvloom.core.engine.core import RequestRejected
from kvloom.core.messages import AddRequest
from kvloom.core.model.lora import LoRAError
from tests.conftest import make_tiny_model
from tests.lora_utils import MAX_RANK, make_adapter, make_adapters, peft_greedy, prompts

MAX_NEW = 12
NAMES = [None, "a", "b", "c", "a", "b", None, "c"]  # one prompt each, in one batch


@pytest.fixture(scope="module", params=["llama", "qwen2"])
def reference(request, tmp_path_factory):
    folder = tmp_path_factory.mktemp(f"lora-{request.param}")
    base = make_tiny_model(folder / "base", request.param)
    adapters = make_adapters(base, folder)
    ps = prompts()
    expected = peft_greedy(base, adapters, ps, NAMES, MAX_NEW)
    return base, adapters, ps, expected


def _llm(base, adapters, **options) -> LLM:
    options = {"max_loras": 3, "max_lora_rank": MAX_RANK, **options}
    return LLM(str(base), dtype="float32", enable_lora=True, lora_modules=adapters, **options)


def _greedy(llm: LLM, ps, names, max_tokens: int = MAX_NEW) -> list[list[int]]:
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    return [o.token_ids for o in llm.generate(ps, params, use_tqdm=False, lora=names)]


def test_three_adapters_and_the_base_in_one_batch_equal_peft(reference):
    base, adapters, ps, expected = reference
    # Each adapter changes the output (else parity would prove nothing), and the base is the base.
    assert expected[1] != peft_greedy(base, adapters, [ps[1]], [None], MAX_NEW)[0]
    llm = _llm(base, adapters)
    steps = []  # the distinct adapter slots each step reads
    execute = llm.engine.runner.execute
    llm.engine.runner.execute = lambda plan: steps.append({s.lora_slot for s in plan.seqs} - {-1}) or execute(plan)
    assert _greedy(llm, ps, NAMES) == expected
    assert max(len(s) for s in steps) == 3  # all three adapters in one step
    assert llm.engine.kv.num_free_blocks() == llm.engine.kv.num_blocks
    assert sorted(a["name"] for a in llm.list_lora_adapters()) == ["a", "b", "c"]


def test_chunked_prefill_preemption_and_async_scheduling(reference):
    base, adapters, ps, expected = reference
    # 7 tokens a step push every long prompt through many chunks beside decodes; 12 blocks of 8 cannot hold
    # all eight sequences, so some are preempted and recomputed; the next step is planned while one runs.
    for mode in ("off", "on"):
        llm = _llm(base, adapters, max_num_batched_tokens=7, block_size=8, num_kv_blocks=12, async_scheduling=mode)
        assert _greedy(llm, ps, NAMES) == expected, mode
        assert llm.engine.scheduler.num_preemptions > 0
        assert llm.engine.kv.num_free_blocks() == 12


def test_prefix_cache_never_shares_kv_between_adapters(reference):
    base, adapters, ps, expected = reference
    llm = _llm(base, adapters, plugins=["prefix_cache"], block_size=8)
    sched = llm.engine.scheduler
    prompt = ps[4]  # 40 tokens: four full blocks
    by_name = {}
    for name in ("a", "b", None, "c"):  # one prompt, asked under each adapter in turn
        by_name[name] = _greedy(llm, [prompt], [name])[0]
        assert sched.prefix_cache_hits == 0, name  # the blocks cached under the others never match
    assert by_name["a"] == expected[4]
    again = _greedy(llm, [prompt, prompt], ["a", "b"])  # the same adapters again: their own blocks are found
    assert again == [by_name["a"], by_name["b"]]
    assert sched.prefix_cache_hits == 2 * 32
    # The whole batch under chunking and async scheduling: with preemption, and with room to keep blocks,
    # twice (the second pass served from the cache).
    llm = _llm(base, adapters, plugins=["prefix_cache"], max_num_batched_tokens=7, block_size=8, num_kv_blocks=12,
               async_scheduling="on")
    assert _greedy(llm, ps, NAMES) == expected
    assert llm.engine.scheduler.num_preemptions > 0
    llm = _llm(base, adapters, plugins=["prefix_cache"], max_num_batched_tokens=7, block_size=8, num_kv_blocks=64,
               async_scheduling="on")
    assert _greedy(llm, ps, NAMES) == expected
    assert _greedy(llm, ps, NAMES) == expected
    assert llm.engine.scheduler.prefix_cache_hits > 0


def test_one_slot_and_a_host_lru_of_one_still_serve_every_adapter(reference):
    base, adapters, ps, expected = reference
    # max_loras=1: each step reads one adapter at most, so the adapters take turns in the one slot;
    # max_cpu_loras=1: adapters that left the host LRU are read from their folders again.
    llm = _llm(base, adapters, max_loras=1, max_cpu_loras=1)
    steps = []
    execute = llm.engine.runner.execute
    llm.engine.runner.execute = lambda plan: steps.append({s.lora_slot for s in plan.seqs} - {-1}) or execute(plan)
    assert _greedy(llm, ps, NAMES) == expected
    assert max(len(s) for s in steps) == 1
    assert llm.engine.adapters.num_loads >= 3
    assert len(llm.engine.lora.host) == 1


def test_speculative_decoding_verifies_drafts_under_each_adapter(reference):
    base, adapters, ps, expected = reference
    repeated = [p * 3 for p in ps[:4]]  # n-gram lookup finds drafts in prompts that repeat themselves
    names = NAMES[:4]
    want = peft_greedy(base, adapters, repeated, names, MAX_NEW)
    ngram = {"num_speculative_tokens": 3, "prompt_lookup_min": 1}
    # A draft model drafts with its own (base) weights; the target verifies under each request's adapter.
    draft = {"num_speculative_tokens": 3, "method": "draft", "draft_model": str(base), "adaptive": False}
    for options in (ngram, draft):
        llm = _llm(base, adapters, plugins=["spec_decode"], plugin_options={"spec_decode": options})
        assert _greedy(llm, repeated, names) == want, options
        assert llm.engine.stats().spec_decode_num_drafts > 0
        assert llm.engine.kv.num_free_blocks() == llm.engine.kv.num_blocks


def test_adapters_load_and_unload_at_run_time(reference, tmp_path):
    base, adapters, ps, expected = reference
    llm = _llm(base, {})
    with pytest.raises(RequestRejected, match="unknown LoRA adapter 'a'"):
        _greedy(llm, [ps[1]], ["a"])
    llm.load_lora_adapter("a", adapters["a"])
    assert _greedy(llm, [ps[1]], ["a"]) == [expected[1]]
    with pytest.raises(ValueError, match="already loaded"):
        llm.load_lora_adapter("a", adapters["b"])
    # A request in flight keeps its adapter: unloading it is refused, and the request finishes unharmed.
    engine = llm.engine
    engine.add_request(AddRequest(request_id="r", prompt_token_ids=ps[4], lora_name="a",
                                  sampling=SamplingParams(temperature=0.0, max_tokens=MAX_NEW, ignore_eos=True)))
    tokens = []
    tokens += [t for d in engine.step() for t in d.new_token_ids]
    with pytest.raises(ValueError, match="in use by 1 unfinished request"):
        llm.unload_lora_adapter("a")
    while engine.has_unfinished():
        tokens += [t for d in engine.step() for t in d.new_token_ids]
    assert tokens == expected[4]
    assert llm.unload_lora_adapter("a")["name"] == "a"
    with pytest.raises(LookupError, match="'a' is not loaded"):
        llm.unload_lora_adapter("a")
    with pytest.raises(RequestRejected, match="unknown LoRA adapter 'a'"):
        _greedy(llm, [ps[1]], ["a"])
    # The name can serve another adapter now; blocks and slots of the old one are not reused for it.
    llm.load_lora_adapter("a", adapters["c"])
    assert _greedy(llm, [ps[3]], ["a"]) == [expected[3]]


def _effective_weights(llm: LLM) -> dict[str, torch.Tensor]:
    """Each linear layer's weight as the engine multiplies by it (after its format's quantization), by
    Hugging Face module name: the layer applied to the identity, less the layer applied to zeros (its bias)."""
    out = {}
    model = llm.engine.model
    for layer in model.linear_layers():
        if layer.prefix == "lm_head":
            continue
        eye = torch.eye(layer.input_size)
        with torch.no_grad():
            w = (layer.method.apply(layer, eye) - layer.method.apply(layer, torch.zeros_like(eye))).t()
        head, _, fused = layer.prefix.rpartition(".")
        split = {"qkv_proj": ["q_proj", "k_proj", "v_proj"], "gate_up_proj": ["gate_proj", "up_proj"]}
        names = split.get(fused, [fused])
        for name, part in zip(names, w.split(layer.output_sizes)):
            out[f"{head}.{name}.weight"] = part.clone()
    return out


def test_adapters_on_an_fp8_base_equal_peft_on_the_same_weights(reference):
    """Adapters sit on a quantized base: the engine's FP8 weights, moved into transformers, under PEFT give
    the tokens the engine gives with the adapters on its FP8 layers."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    base, adapters, ps, expected = reference
    from safetensors.torch import load_file

    llm = _llm(base, adapters, quantization="fp8")
    got = _greedy(llm, ps, NAMES)
    weights = _effective_weights(llm)
    name = "model.layers.0.self_attn.q_proj.weight"
    original = load_file(str(base / "model.safetensors"))[name]
    assert not torch.equal(weights[name], original)  # FP8-rounded
    torch.testing.assert_close(weights[name], original, rtol=0.07, atol=1e-3)
    want = []
    for prompt, name in zip(ps, NAMES):
        model = AutoModelForCausalLM.from_pretrained(str(base), dtype=torch.float32).eval()
        missing = model.load_state_dict(weights, strict=False).missing_keys
        assert not any(k.endswith("_proj.weight") for k in missing)
        if name is not None:
            model = PeftModel.from_pretrained(model, adapters[name]).eval()
        ids = torch.tensor([prompt])
        with torch.no_grad():
            gen = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=MAX_NEW,
                                 do_sample=False, pad_token_id=0, eos_token_id=None)
        want.append(gen[0, len(prompt):].tolist())
    assert got == want
    assert got != expected  # FP8 weights are not the float32 ones: the check above is not a tautology


# --- bad adapters -----------------------------------------------------------------------------------
def _copy(src: str, dst) -> str:
    shutil.copytree(src, dst)
    return str(dst)


def _edit_config(folder: str, **changes) -> str:
    path = f"{folder}/adapter_config.json"
    config = json.loads(open(path).read())
    config.update(changes)
    open(path, "w").write(json.dumps(config))
    return folder


def test_bad_adapters_are_clear_errors_at_load(reference, tmp_path):
    base, adapters, ps, expected = reference
    llm = _llm(base, {}, max_lora_rank=4)
    with pytest.raises(LoRAError, match=r"rank 8, over max_lora_rank=4"):
        llm.load_lora_adapter("b", adapters["b"])
    with pytest.raises(LoRAError, match="is not a folder"):
        llm.load_lora_adapter("x", str(tmp_path / "nowhere"))
    missing = _copy(adapters["a"], tmp_path / "missing")
    (tmp_path / "missing" / "adapter_model.safetensors").unlink()
    with pytest.raises(LoRAError, match="adapter_model.safetensors' is missing"):
        llm.load_lora_adapter("x", missing)
    head = make_adapter(base, tmp_path / "head", 5, r=2, lora_alpha=2, target_modules=["lm_head"]
                        if json.loads((base / "config.json").read_text())["tie_word_embeddings"] is False
                        else ["embed_tokens"])
    with pytest.raises(LoRAError, match="target module '(lm_head|embed_tokens)' is not supported"):
        llm.load_lora_adapter("x", str(head))
    dora = _edit_config(_copy(adapters["a"], tmp_path / "dora"), use_dora=True)
    with pytest.raises(LoRAError, match="use_dora=true"):
        llm.load_lora_adapter("x", dora)
    # An adapter of another base model (a wider MLP): its shapes do not fit this one.
    import transformers

    wide = make_tiny_model(tmp_path / "wide", "llama")
    config = transformers.AutoConfig.from_pretrained(str(wide))
    config.intermediate_size = 96
    transformers.AutoModelForCausalLM.from_config(config).save_pretrained(str(wide))
    other = make_adapter(wide, tmp_path / "other", 6, r=2, lora_alpha=2, target_modules=["down_proj"])
    with pytest.raises(LoRAError, match=r"down_proj has lora_A \(2, 96\).*needs \(2, 128\)"):
        llm.load_lora_adapter("x", str(other))
    # Nothing was loaded, and the engine still serves what it can.
    assert llm.list_lora_adapters() == []
    llm.load_lora_adapter("a", adapters["a"])
    assert _greedy(llm, [ps[1]], ["a"]) == [expected[1]]


def test_an_adapter_whose_folder_vanished_fails_its_requests_not_the_engine(reference, tmp_path):
    base, adapters, ps, expected = reference
    folder = _copy(adapters["a"], tmp_path / "a")
    llm = _llm(base, {"a": folder, "b": adapters["b"]}, max_loras=1, max_cpu_loras=1)
    assert _greedy(llm, [ps[1]], ["a"]) == [expected[1]]
    assert _greedy(llm, [ps[2]], ["b"]) == [expected[2]]  # a leaves the slot and the host LRU
    shutil.rmtree(folder)
    params = SamplingParams(temperature=0.0, max_tokens=MAX_NEW, ignore_eos=True)
    out = llm.generate([ps[1], ps[2]], params, lora=["a", "b"], use_tqdm=False)
    assert out[0].finish_reason == "error" and "LoRA adapter 'a'" in out[0].outputs[0].error
    assert out[1].token_ids == expected[2]
    assert llm.engine.kv.num_free_blocks() == llm.engine.kv.num_blocks


def test_lora_settings_are_checked():
    with pytest.raises(ConfigError, match="lora_modules=\\['a'\\] needs enable_lora"):
        EngineConfig(lora_modules={"a": "/x"}).validate()
    with pytest.raises(ConfigError, match="max_cpu_loras=1 must be >= max_loras=2"):
        EngineConfig(enable_lora=True, max_loras=2, max_cpu_loras=1).validate()
    with pytest.raises(ConfigError, match="max_lora_rank=0"):
        EngineConfig(max_lora_rank=0).validate()
    assert EngineConfig.from_dict({"lora_modules": ["a=/x", '{"name": "b", "path": "/y"}']}).lora_modules == {
        "a": "/x", "b": "/y"}
    with pytest.raises(ConfigError, match="must be NAME=PATH"):
        EngineConfig.from_dict({"lora_modules": ["a"]})


def test_adapters_from_flags_and_the_config_file(reference, tmp_path, capsys):
    from kvloom.cli.main import build_parser, config_from_args, main

    base, adapters, ps, expected = reference
    config_file = tmp_path / "engine.toml"
    config_file.write_text(f'enable_lora = true\nmax_loras = 2\n[lora_modules]\na = "{adapters["a"]}"\n')
    args = build_parser().parse_args(["--config", str(config_file)])
    assert config_from_args(args).lora_modules == {"a": adapters["a"]}
    args = build_parser().parse_args(["--config", str(config_file), "--lora-modules", f"b={adapters['b']}",
                                      json.dumps({"name": "c", "path": adapters["c"]})])
    config = config_from_args(args)
    assert config.lora_modules == {"b": adapters["b"], "c": adapters["c"]} and config.max_loras == 2
    # `engine generate --lora NAME` runs the prompt with that adapter.
    texts = []
    for extra in ([], ["--lora", "b"]):
        assert main(["generate", "--model", str(base), "--dtype", "float32", "--enable-lora", "--max-lora-rank", "8",
                     "--lora-modules", f"b={adapters['b']}", "--prompt", "hello", "--max-tokens", "8", *extra]) == 0
        texts.append(json.loads(capsys.readouterr().out.strip().splitlines()[-1])["text"])
    assert texts[0] != texts[1]


def test_a_request_for_an_adapter_of_an_engine_without_lora_is_rejected(tiny_llama):
    llm = LLM(str(tiny_llama))
    with pytest.raises(RequestRejected, match="start it with --enable-lora"):
        llm.generate([[5, 6]], SamplingParams(max_tokens=2), lora="a", use_tqdm=False)
    with pytest.raises(ValueError, match="LoRA is off"):
        llm.load_lora_adapter("a", "/x")


def test_tensor_parallel_2_splits_adapters_with_their_layers(reference):
    """Two ranks on gloo: a column layer's B splits with its outputs, a row layer's A with its inputs (its
    partial products join the all-reduce); adapters loaded at start and at run time reach both ranks."""
    base, adapters, ps, expected = reference
    first = {k: v for k, v in adapters.items() if k != "c"}
    llm = LLM(config=EngineConfig(model=str(base), tensor_parallel_size=2, dtype="float32", block_size=8,
                                  num_kv_blocks=64, max_num_batched_tokens=7, enable_lora=True, lora_modules=first,
                                  max_loras=2, max_lora_rank=MAX_RANK, plugins=["prefix_cache"],
                                  async_scheduling="on"))
    try:
        llm.load_lora_adapter("c", adapters["c"])  # after start: rank 1 reads it when a step first needs it
        assert _greedy(llm, ps, NAMES) == expected
        assert llm.engine.adapters.num_loads > 2  # three adapters took turns in two slots
        assert llm.engine.kv.num_free_blocks() == llm.engine.kv.num_blocks
    finally:
        llm.engine.shutdown()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (the H200 run)")
def test_cuda_graphs_triton_kernels_and_async_loads_equal_peft(reference):
    """On the GPU in float32: decode steps replay CUDA graphs holding the LoRA kernels (counted), adapters
    move into their slots on a side stream, with and without async scheduling, with few slots and with
    speculative decoding's verify steps: the greedy outputs equal PEFT's."""
    base, adapters, ps, expected = reference
    common = dict(device="cuda", max_num_seqs=8, kv_cache_memory_gib=0.25)
    runs = [dict(async_scheduling="off"), dict(async_scheduling="on"),
            dict(async_scheduling="on", max_loras=1, max_cpu_loras=1, max_num_batched_tokens=16),
            dict(plugins=["spec_decode"], plugin_options={"spec_decode": {"num_speculative_tokens": 3,
                                                                          "prompt_lookup_min": 1}})]
    for options in runs:
        llm = _llm(base, adapters, **common, **options)
        runner = llm.engine.runner
        assert runner.graphs
        replays = []
        replay = runner._replay
        runner._replay = lambda seqs: replays.append(len(seqs)) or replay(seqs)
        assert _greedy(llm, ps, NAMES) == expected, options
        assert replays, options
        assert llm.engine.kv.num_free_blocks() == llm.engine.kv.num_blocks


def test_adapters_on_a_hybrid_kv_cache_family_equal_peft(tmp_path):
    """Gemma 3 (sandwich and q/k norms, sliding layers in their own KV block group): three adapters and the
    base in one batch, chunked, then again from the prefix cache (each group's blocks keyed by adapter)."""
    base = make_tiny_model(tmp_path / "base", "gemma3_text")
    adapters = make_adapters(base, tmp_path)
    ps = prompts()
    expected = peft_greedy(base, adapters, ps, NAMES, MAX_NEW)
    assert expected[1] != peft_greedy(base, adapters, [ps[1]], [None], MAX_NEW)[0]
    llm = _llm(base, adapters, plugins=["prefix_cache"], max_num_batched_tokens=16, block_size=8,
               num_kv_blocks=200)
    assert llm.engine.kv_layout.hybrid  # the sliding layers' blocks are a group of their own
    assert _greedy(llm, ps, NAMES) == expected
    hits = llm.engine.scheduler.prefix_cache_hits
    assert _greedy(llm, ps, NAMES) == expected
    assert llm.engine.scheduler.prefix_cache_hits > hits
