"""The compiled CPU steps (``kvloom.core.worker.cpu_compile``): greedy tokens equal transformers' (float32)
with one, three and seven requests decoding together, on a plain family and on ones with sliding windows,
soft-capped scores, q/k norms and a hybrid KV cache, and with twelve (the three variants compiled at start-up);
the decode steps really run compiled; steps holding prompt rows (whole prompts, chunks after a cached part, and
decode rows beside them) run compiled too and give the same tokens; ``enforce_eager`` and what cannot compile
stay eager.

The rest of the suite runs engines eagerly (tests/conftest.py); these tests turn compiling back on."""

from __future__ import annotations

import random

import pytest
import torch

from kvloom import LLM, SamplingParams

from tests.conftest import hf_greedy, make_tiny_model

NEW_TOKENS = 12


@pytest.fixture
def compiling():
    # torch's config module, not monkeypatch: undoing a module attribute pytest did not find in the module's
    # dict deletes it, and with it the option
    with torch._dynamo.config.patch(disable=False):
        yield


def _counting(llm: LLM, which: str = "compiled_decode") -> list[int]:
    """Counts the steps handed to the runner's compiled decode (or prompt) steps; a decode step counted ran
    compiled (at the thread count compiled for)."""
    compiled = getattr(llm.engine.runner, which)
    assert compiled is not None
    calls = [0]
    inner = compiled.compiled

    def counted(*args):
        calls[0] += 1
        return inner(*args)

    compiled.compiled = counted
    return calls


def _eager_steps(llm: LLM) -> list[int]:
    """Counts the steps whose layers run eagerly: the final norm's hook runs only outside compiled code (hooks
    added after compiling are not traced in)."""
    calls = [0]
    llm.engine.runner.model.norm.register_forward_pre_hook(lambda module, args: calls.__setitem__(0, calls[0] + 1))
    return calls


@pytest.mark.parametrize("family", ["llama", "gemma2", "gemma3_text"])
def test_compiled_prompt_steps_equal_transformers(family, compiling, tmp_path):
    """Prompts longer than a step's token budget: steps hold whole prompts, chunks after a cached part, and
    decode rows beside them, all compiled (the token count varies step to step, one compiled variant)."""
    path = make_tiny_model(tmp_path / family, family)
    rng = random.Random(4)
    prompts = [[rng.randrange(3, 380) for _ in range(rng.randrange(12, 70))] for _ in range(6)]
    expected = hf_greedy(path, prompts, NEW_TOKENS)
    llm = LLM(str(path), dtype="float32", max_num_seqs=8, max_model_len=128, threads=1,
              max_num_batched_tokens=48)
    assert llm.engine.runner.compiled_prompts is not None
    eager = _eager_steps(llm)
    sp = SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True)
    assert [o.outputs[0].token_ids for o in llm.generate(prompts, sp, use_tqdm=False)] == expected
    # every step held more than the 4-bit cut's rows or was decode-only: none ran eagerly
    assert eager[0] == 0


def test_compiled_steps_with_drafts_and_a_prefix_cache(compiling, tiny_llama):
    """n-gram drafts verified in steps beside prompt chunks, and a second pass whose prompts hit the prefix cache
    (chunks after a cached part): the same greedy tokens as transformers, steps holding prompts compiled."""
    rng = random.Random(6)
    phrase = [rng.randrange(3, 380) for _ in range(9)]
    prompts = [phrase * 4, phrase * 2 + [rng.randrange(3, 380) for _ in range(30)] + phrase[:5],
               [rng.randrange(3, 380) for _ in range(25)]]
    expected = hf_greedy(tiny_llama, prompts, NEW_TOKENS)
    llm = LLM(str(tiny_llama), dtype="float32", max_num_seqs=8, max_model_len=128, threads=1,
              max_num_batched_tokens=24, plugins=["spec_decode", "prefix_cache"],
              plugin_options={"spec_decode": {"num_speculative_tokens": 3, "prompt_lookup_min": 1}})
    calls = _counting(llm, "compiled_prompts")
    sp = SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True)
    for _ in range(2):
        assert [o.outputs[0].token_ids for o in llm.generate(prompts, sp, use_tqdm=False)] == expected
    stats = llm.engine.stats()
    assert stats.spec_decode_num_accepted > 0 and stats.prefix_cache_hits > 0
    assert calls[0] > 0


def test_bf16_compiled_prompt_step_matches_eager(compiling, tiny_llama):
    """One step of two whole prompts and a chunk after 40 cached positions beside three decode rows, bf16,
    compiled and eager on the same cache: logits differ by bf16 rounding only."""
    from kvloom.core.model.attention.base import AttentionMetadata

    llm = LLM(str(tiny_llama), dtype="bfloat16", max_num_seqs=8, max_model_len=128, threads=1)
    runner = llm.engine.runner
    bs = runner.block_size
    torch.manual_seed(0)
    for k, v in runner.kv_caches:  # a history to attend to
        k.normal_()
        v.normal_()
    query_lens, seq_lens = [1, 1, 1, 20, 13, 9], [41, 30, 17, 20, 13, 49]
    blocks = -(-max(seq_lens) // bs)
    table = torch.arange(len(seq_lens) * blocks, dtype=torch.int32).view(len(seq_lens), blocks)
    slots = torch.tensor([int(table[i, p // bs]) * bs + p % bs
                          for i, (q, s) in enumerate(zip(query_lens, seq_lens)) for p in range(s - q, s)])
    with torch.inference_mode():  # as the runner's inputs are (the compiled code's guards check it)
        positions = torch.cat([torch.arange(s - q, s) for q, s in zip(query_lens, seq_lens)])
        ids = torch.randint(3, 380, positions.shape)
        keep = torch.cumsum(torch.tensor(query_lens), 0) - 1

    def meta():
        return AttentionMetadata(
            slot_mapping=slots, block_tables=table, seq_lens=torch.tensor(seq_lens, dtype=torch.int32),
            query_start_loc=torch.cat([torch.zeros(1, dtype=torch.int32),
                                       torch.cumsum(torch.tensor(query_lens, dtype=torch.int32), 0)]),
            num_decodes=3, max_query_len=max(query_lens), max_seq_len=max(seq_lens), query_lens_cpu=query_lens,
            seq_lens_cpu=seq_lens)

    eager_steps = _eager_steps(llm)
    threads = torch.get_num_threads()
    torch.set_num_threads(runner.compiled_prompts.threads)  # the count it compiled for (else it runs eagerly)
    with torch.inference_mode():
        eager = runner.model.compute_logits(runner.model(ids, positions, meta(), runner.kv_caches, keep=keep))
        assert eager_steps[0] == 1
        compiled = runner.model.compute_logits(runner.compiled_prompts(ids, positions, meta(), keep))
    torch.set_num_threads(threads)
    assert eager_steps[0] == 1  # the second ran compiled
    assert compiled.shape == eager.shape == (len(seq_lens), eager.shape[-1])
    scale = eager.abs().max()
    assert (compiled - eager).abs().max() <= 0.03 * scale, ((compiled - eager).abs().max(), scale)
    assert (compiled.argmax(-1) == eager.argmax(-1)).sum() >= 5


@pytest.mark.parametrize("family", ["llama", "gemma2", "gemma3_text"])
def test_compiled_decode_equals_transformers(family, compiling, tmp_path):
    path = make_tiny_model(tmp_path / family, family)
    rng = random.Random(3)
    prompts = [[rng.randrange(3, 380) for _ in range(rng.randrange(5, 40))] for _ in range(7)]
    expected = hf_greedy(path, prompts, NEW_TOKENS)
    # one thread: no governor changing the count the step was compiled for on a busy machine
    llm = LLM(str(path), dtype="float32", max_num_seqs=8, max_model_len=128, threads=1)
    calls = _counting(llm)
    sp = SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True)
    got = []
    for batch in (prompts[:1], prompts[1:4], prompts):  # 1, 3, then 7 rows a decode step
        got.append([o.outputs[0].token_ids for o in llm.generate(batch, sp, use_tqdm=False)])
    assert got[0] == expected[:1]
    assert got[1] == expected[1:4]
    assert got[2] == expected
    assert calls[0] >= 3 * (NEW_TOKENS - 1)  # every decode step of the three runs, none eager


def _peak_rss_growth(run) -> int:
    """Bytes the process's peak resident memory rose by while ``run()`` ran (the peak reset first)."""
    def status(key: str) -> int:
        return next(int(x.split()[1]) for x in open("/proc/self/status") if x.startswith(key)) * 1024

    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # the peak back to the current resident size
    before = status("VmRSS:")
    run()
    return status("VmHWM:") - before


@pytest.mark.parametrize("shared", [True, False])
def test_a_hybrid_cache_is_written_in_place_by_compiled_steps(shared, compiling, tmp_path, monkeypatch):
    """Gemma 3's hybrid cache: layers of different groups write the same cache tensors in one step. Traced as
    index_copy_, each such write made the compiled code copy the whole tensor (its pages resident, 7x the step's
    time on Gemma 3 270M); written by the opaque op, the step's peak memory stays far below one cache tensor.
    (``shared`` False: the traced write, to show the check sees the copies.)"""
    from kvloom.core.worker import cpu_compile

    shares_pages = cpu_compile.shares_pages
    if not shared:
        monkeypatch.setattr(cpu_compile, "shares_pages", lambda kv_caches: False)
    path = make_tiny_model(tmp_path / "gemma3", "gemma3_text")
    llm = LLM(str(path), dtype="float32", max_num_seqs=4, max_model_len=128, threads=1, kv_cache_memory_gib=1.0)
    runner = llm.engine.runner
    assert shares_pages(runner.kv_caches)  # layers share cache tensors
    assert runner.compiled_decode.shared_pages is shared and runner.compiled_prompts.shared_pages is shared
    page = runner.kv_caches[0][0]
    calls = _counting(llm)
    rng = random.Random(5)
    prompts = [[rng.randrange(3, 380) for _ in range(20)] for _ in range(3)]
    sp = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    growth = _peak_rss_growth(lambda: llm.generate(prompts, sp, use_tqdm=False))
    assert calls[0] >= 5
    size = page.numel() * page.element_size()
    if shared:
        assert growth < size // 4, (growth, size)
    else:
        assert growth > size // 2, (growth, size)


def test_steps_of_more_rows_than_the_4bit_cut_run_compiled(compiling, tiny_llama):
    """The third variant: decode steps of more rows than ``INT4_MAX_ROWS`` (the attention's and the 4-bit
    matmuls' cut) run compiled too, and a request alone afterwards still takes the one-row variant."""
    from kvloom.core.model.cpu_packing import INT4_MAX_ROWS

    rng = random.Random(5)
    rows = INT4_MAX_ROWS + 4
    prompts = [[rng.randrange(3, 380) for _ in range(rng.randrange(5, 30))] for _ in range(rows)]
    expected = hf_greedy(tiny_llama, prompts, NEW_TOKENS)
    llm = LLM(str(tiny_llama), dtype="float32", max_num_seqs=rows, max_model_len=128, threads=1)
    calls = _counting(llm)
    sp = SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True)
    assert [o.outputs[0].token_ids for o in llm.generate(prompts, sp, use_tqdm=False)] == expected
    assert calls[0] >= NEW_TOKENS - 1  # every decode step had INT4_MAX_ROWS + 4 rows
    before = calls[0]
    assert [o.outputs[0].token_ids for o in llm.generate(prompts[:1], sp, use_tqdm=False)] == expected[:1]
    assert calls[0] - before >= NEW_TOKENS - 1


def test_bf16_compiled_step_matches_eager(compiling, tiny_llama):
    """bf16: the compiler fuses the elementwise work in float32 and rounds once where the eager ops round each
    time, so a step's logits differ by bf16 rounding only: one decode step of 5 rows over 40 cached positions,
    compiled and eager, on the same cache."""
    llm = LLM(str(tiny_llama), dtype="bfloat16", max_num_seqs=8, max_model_len=128, threads=1)
    runner = llm.engine.runner
    torch.manual_seed(0)
    for k, v in runner.kv_caches:  # a history to attend to
        k.normal_()
        v.normal_()
    ids, pos = torch.randint(3, 380, (5,)), torch.full((5,), 40)
    with torch.inference_mode():
        eager = runner.model.compute_logits(runner.model(ids, pos, runner._scratch_meta(5, 41), runner.kv_caches))
        compiled = runner.model.compute_logits(runner.compiled_decode(ids, pos, runner._scratch_meta(5, 41)))
    scale = eager.abs().max()
    assert (compiled - eager).abs().max() <= 0.03 * scale, ((compiled - eager).abs().max(), scale)
    assert (compiled.argmax(-1) == eager.argmax(-1)).sum() >= 4


def test_what_cannot_compile_stays_eager(compiling, tiny_llama):
    from kvloom.core.worker.cpu_compile import compile_refusal

    llm = LLM(str(tiny_llama), dtype="float32", max_model_len=128, threads=1, kv_cache_dtype="fp8",
              max_num_seqs=2)
    runner = llm.engine.runner
    assert runner.compiled_decode is None
    backend = runner.model.layers[0].self_attn.backend
    assert "KV cache dtype" in compile_refusal(runner.model, backend, runner.kv_caches, None)
    assert "LoRA" in compile_refusal(runner.model, backend, runner.kv_caches, lora=object())
    out = llm.generate([[5, 6, 7]], SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True), use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == 4


def test_prompt_steps_that_fail_to_compile_stay_eager(compiling, tiny_llama, monkeypatch, caplog):
    """A model whose prompt steps fail to compile still starts: the warning names the error, decode steps stay
    compiled, and prompt steps run eagerly with the same tokens."""
    from kvloom.core.worker import cpu_compile

    def failing(self, *args):
        raise RuntimeError("no graph for you")

    monkeypatch.setattr(cpu_compile.CompiledPrompts, "warm_up", failing)
    prompts = [[5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16], [20, 21, 22]]
    expected = hf_greedy(tiny_llama, prompts, 4)
    with caplog.at_level("WARNING", logger="kvloom"):
        llm = LLM(str(tiny_llama), dtype="float32", max_num_seqs=2, max_model_len=128, threads=1)
    assert llm.engine.runner.compiled_prompts is None and llm.engine.runner.compiled_decode is not None
    assert "no graph for you" in caplog.text
    sp = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    assert [o.outputs[0].token_ids for o in llm.generate(prompts, sp, use_tqdm=False)] == expected
