"""Speculative decoding (the ``spec_decode`` plugin): greedy outputs equal the outputs without it token
for token, in every composition that must not change them; sampling keeps the target distribution
(chi-square tests at a stated significance level); the n-gram proposer, the rollback of rejected
drafts, the adaptive policy, the figures and the start-up errors."""

from __future__ import annotations

import json

import random

import pytest
import torch

from kvloom import LLM, SamplingParams
from kvloom.core.config import ConfigError
from kvloom.core.engine.step import RunnerOutput
from kvloom.core.sampling_params import SamplingParams as SP
from kvloom.core.worker import rejection_sampler
from kvloom.core.worker.ngram_proposer import propose_ngram
from kvloom.plugins.builtin.fcfs import FCFSPolicy
from tests.plugins.scheduler_sim import add, make_scheduler

MAX_NEW = 24
SCHEDULERS = ["fcfs", "priority", "sjf"]
ALPHA_Z = 3.0902  # the standard normal's 0.999 quantile: every test below is at significance 0.001


def chi2_critical(df: int) -> float:
    """The chi-square quantile at 0.999 (Wilson-Hilferty; within 2% of the exact value for df >= 3)."""
    return df * (1 - 2 / (9 * df) + ALPHA_Z * (2 / (9 * df)) ** 0.5) ** 3


def _prompts() -> list[list[int]]:
    """A batch of mixed lengths; most repeat themselves, so n-gram lookup finds drafts."""
    rng = random.Random(0)
    phrase = [rng.randrange(3, 384) for _ in range(9)]
    return [phrase * 4, [5, 6, 7] * 7 + [8], [rng.randrange(3, 384) for _ in range(17)], [9],
            phrase * 2 + [rng.randrange(3, 384) for _ in range(40)] + phrase[:5]]


def _spec(k: int = 3, **extra) -> dict:
    return {"spec_decode": {"num_speculative_tokens": k, "prompt_lookup_min": 1, **extra}}


def _greedy(llm: LLM, prompts, max_tokens: int = MAX_NEW, **params) -> list[list[int]]:
    sp = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, **params)
    return [o.token_ids for o in llm.generate(prompts, sp, use_tqdm=False)]


@pytest.fixture(scope="module")
def family_reference(tiny_model):
    prompts = _prompts()
    return tiny_model, prompts, _greedy(LLM(str(tiny_model)), prompts)


@pytest.mark.parametrize("k", [1, 3, 5])
def test_greedy_outputs_equal_without_spec_decode(family_reference, k):
    path, prompts, expected = family_reference
    llm = LLM(str(path), plugins=["spec_decode"], plugin_options=_spec(k))
    assert _greedy(llm, prompts) == expected
    stats = llm.engine.stats()
    assert stats.spec_decode_num_drafts > 0 and stats.spec_decode_num_accepted > 0  # drafts were verified
    assert llm.engine.kv.num_free_blocks() == llm.engine.kv.num_blocks  # rejected drafts' blocks came back


@pytest.fixture(scope="module")
def llama_reference(tiny_llama):
    prompts = _prompts()
    return tiny_llama, prompts, _greedy(LLM(str(tiny_llama)), prompts)


@pytest.mark.parametrize("scheduler", SCHEDULERS)
@pytest.mark.parametrize("k", [1, 3, 5])
def test_greedy_with_chunked_prefill_preemption_and_prefix_cache(llama_reference, scheduler, k):
    path, prompts, expected = llama_reference
    # 16 blocks of 8 tokens cannot hold every sequence (preemption), 9 tokens a step split the prompts
    # (chunked prefill, and drafts cut short by the budget), and the second pass hits the prefix cache.
    llm = LLM(str(path), plugins=["spec_decode", "prefix_cache", scheduler], plugin_options=_spec(k),
              block_size=8, num_kv_blocks=16, max_num_batched_tokens=9)
    assert _greedy(llm, prompts) == expected
    assert _greedy(llm, prompts) == expected
    stats = llm.engine.stats()
    assert stats.num_preemptions > 0
    assert stats.prefix_cache_hits > 0
    assert stats.spec_decode_num_accepted > 0
    assert llm.engine.kv.num_free_blocks() == 16


def test_greedy_with_async_scheduling_and_adaptive_batch_limit(llama_reference):
    path, prompts, expected = llama_reference
    # max_batch_size=2: while five requests run, steps overlap as plain async steps; once three have
    # finished (max_tokens 8), the two left synchronise and speculate.
    llm = LLM(str(path), plugins=["spec_decode"], plugin_options=_spec(3, max_batch_size=2), async_scheduling="on")
    lengths = [MAX_NEW, 8, 8, 8, MAX_NEW]
    params = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True) for n in lengths]
    got = [o.token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    assert got == [e[:n] for e, n in zip(expected, lengths)]
    assert llm.engine.stats().spec_decode_num_accepted > 0
    assert llm.engine.kv.num_free_blocks() == llm.engine.kv.num_blocks


def test_stop_tokens_penalties_min_tokens_and_logprobs_see_only_accepted_tokens(llama_reference):
    path, prompts, _ = llama_reference
    plain, spec = LLM(str(path)), LLM(str(path), plugins=["spec_decode"], plugin_options=_spec(4))
    first = _greedy(plain, prompts[:2])
    for extra in ({"stop_token_ids": [first[0][5], first[1][3]]}, {"repetition_penalty": 1.5},
                  {"frequency_penalty": 1.0, "presence_penalty": 0.5}, {"min_tokens": 10, "stop_token_ids": [first[1][2]]}):
        assert _greedy(spec, prompts, **extra) == _greedy(plain, prompts, **extra), extra
    sp = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, logprobs=2)
    want, got = plain.generate(prompts, sp, use_tqdm=False), spec.generate(prompts, sp, use_tqdm=False)
    for w, g in zip(want, got):
        assert g.token_ids == w.token_ids
        wl, gl = w.outputs[0].logprobs, g.outputs[0].logprobs
        assert [lp.token_id for lp in gl] == g.token_ids
        torch.testing.assert_close([lp.logprob for lp in gl], [lp.logprob for lp in wl], atol=1e-4, rtol=1e-4)
        assert [[t.token_id for t in lp.top] for lp in gl] == [[t.token_id for t in lp.top] for lp in wl]


def test_acceptance_figures_per_request_and_for_the_engine(tiny_llama):
    llm = LLM(str(tiny_llama), plugins=["spec_decode"], plugin_options=_spec(4))
    prompt = [5, 6, 7, 8] * 8
    # Greedy on a random model soon repeats itself, and the prompt is one long repetition.
    out = llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True), use_tqdm=False)[0]
    stats = llm.engine.stats()
    assert out.metrics.num_draft_tokens == stats.spec_decode_num_drafts > 0
    assert out.metrics.num_accepted_tokens == stats.spec_decode_num_accepted > 0
    assert 0.0 < stats.spec_decode_acceptance_rate <= 1.0
    assert 1.0 < stats.spec_decode_mean_acceptance_length <= 5.0
    # Fewer steps than tokens: the point of speculation.
    assert stats.spec_decode_num_steps < 40


# --- sampling keeps the target distribution --------------------------------------------------------
def _chi_square_same(a: list[int], b: list[int]) -> tuple[float, int]:
    """Two-sample chi-square statistic over the categories seen (rare ones pooled) and its df."""
    from collections import Counter

    ca, cb = Counter(a), Counter(b)
    cats = sorted(set(ca) | set(cb), key=lambda t: -(ca[t] + cb[t]))
    na, nb = len(a), len(b)
    rows, rest = [], [0, 0]
    for t in cats:
        if (ca[t] + cb[t]) * min(na, nb) / (na + nb) >= 5:
            rows.append((ca[t], cb[t]))
        else:
            rest[0] += ca[t]
            rest[1] += cb[t]
    if sum(rest):
        rows.append(tuple(rest))
    stat = 0.0
    for x, y in rows:
        tot = x + y
        ex, ey = tot * na / (na + nb), tot * nb / (na + nb)
        stat += (x - ex) ** 2 / ex + (y - ey) ** 2 / ey
    return stat, len(rows) - 1


def test_rejection_sampler_keeps_the_target_distribution():
    """One row verifying a fixed draft against a known p: the kept-or-replaced token is distributed as p
    (chi-square goodness of fit, significance 0.001), and the draft is kept with probability p(d)."""
    gen = torch.Generator().manual_seed(0)
    p = torch.tensor([0.05, 0.4, 0.25, 0.2, 0.1])
    n = 20000
    params = [SP(temperature=1.0)] * n
    probs = p.repeat(n, 1)
    drafts = torch.full((n,), 2)
    noise = torch.empty(n, 5).exponential_(generator=gen)
    uniform = torch.rand(n, generator=gen)
    tokens, accepted = rejection_sampler.verify(probs.log(), probs, drafts, noise, uniform, params)
    out = torch.where(accepted, drafts, tokens)
    counts = torch.bincount(out, minlength=5).float()
    stat = ((counts - n * p) ** 2 / (n * p)).sum().item()
    assert stat < chi2_critical(4)
    assert abs(accepted.float().mean().item() - 0.25) < 0.02
    # A replacement is never the rejected draft.
    assert not (tokens[~accepted] == 2).any()


class _ModeProposer:
    """Drafts the most frequent tokens that plain sampling produced at the next positions: accepted
    often enough and rejected often enough to exercise both paths of the rejection sampler."""

    name = "modes"

    def __init__(self, prompt_len: int, modes: list[int], k: int) -> None:
        self.prompt_len, self.modes, self.num_speculative_tokens = prompt_len, modes, k

    def propose(self, requests):
        return {r.request_id: self.modes[r.num_tokens - self.prompt_len: r.num_tokens - self.prompt_len + 3]
                for r in requests}


def test_sampling_with_spec_decode_keeps_the_distribution(tiny_llama):
    """At temperature 1 with top-p and top-k: each of the first four generated tokens has the same
    distribution with drafts verified by rejection sampling as without speculation (two-sample
    chi-square per position, significance 0.001 each, fixed seeds)."""
    from collections import Counter

    prompt, n = [5, 6, 7, 8, 9], 1200
    sp = [SamplingParams(temperature=1.0, top_p=0.9, top_k=40, max_tokens=5, ignore_eos=True, seed=s)
          for s in range(n)]
    plain = [o.token_ids for o in LLM(str(tiny_llama)).generate([prompt] * n, sp, use_tqdm=False)]
    modes = [Counter(o[i] for o in plain).most_common(1)[0][0] for i in range(5)]
    llm = LLM(str(tiny_llama), plugins=["spec_decode"], plugin_options=_spec(3, adaptive=False))
    llm.engine.speculator.proposer = _ModeProposer(len(prompt), modes, 3)
    sp2 = [SamplingParams(temperature=1.0, top_p=0.9, top_k=40, max_tokens=5, ignore_eos=True, seed=10_000 + s)
           for s in range(n)]
    spec = [o.token_ids for o in llm.generate([prompt] * n, sp2, use_tqdm=False)]
    stats = llm.engine.stats()
    assert stats.spec_decode_num_accepted > 40  # drafts were kept ...
    assert stats.spec_decode_num_drafts - stats.spec_decode_num_accepted > 200  # ... and rejected
    for i in range(1, 5):
        stat, df = _chi_square_same([o[i] for o in plain], [o[i] for o in spec])
        assert stat < chi2_critical(df), (i, stat, df)


# --- the pieces ---------------------------------------------------------------------------------
def test_ngram_proposes_the_continuation_of_the_longest_most_recent_match():
    seqs = [[1, 2, 3, 4, 9, 9, 1, 2, 3],  # tail 1 2 3 occurred at the start: propose 4 9 9
            [5, 6, 7],  # no earlier occurrence of any tail n-gram
            [1, 2, 8, 2, 1, 2],  # tail "1 2" at 0 (then 8 2 1); tail "2" alone would match at 3 too
            [4, 4, 4, 4]]  # the tail matches itself shifted: propose more 4s (up to the end)
    assert propose_ngram(seqs, 3, 1, 3) == [[4, 9, 9], [], [8, 2, 1], [4]]
    assert propose_ngram([[1, 2, 3, 7, 1, 2, 3]], 2, 4, 4) == [[]]  # no 4-gram repeats
    assert propose_ngram([[1, 2, 3, 7, 1, 2, 3]], 2, 1, 1) == [[7, 1]]  # "3" last seen at 2


def test_rejected_drafts_roll_back_computed_tokens_and_free_their_blocks():
    sched = make_scheduler(FCFSPolicy(), num_blocks=16, block_size=4)
    req = add(sched, "r", 6, max_tokens=20)
    plan = sched.schedule()
    sched.update(plan, RunnerOutput({"r": [11]}))  # the prompt, then its first token
    free_before = sched.kv.num_free_blocks()
    req.spec_token_ids = [12, 13, 14, 15, 16, 17]  # positions 7..12 reach a fourth block
    plan = sched.schedule()
    (seq,) = plan.seqs
    assert seq.token_ids == [11, 12, 13, 14, 15, 16, 17] and seq.draft_token_ids == [12, 13, 14, 15, 16, 17]
    assert seq.num_sample_rows == 7 and len(req.block_ids) == 4
    updates = sched.update(plan, RunnerOutput({"r": [12, 99]}))  # one draft kept, then the target's 99
    assert updates[0].new_token_ids == [12, 99]
    assert req.all_token_ids == [5] * 6 + [11, 12, 99]
    assert req.num_computed_tokens == 8  # the prompt, 11 and 12; 99 is fed next step
    assert len(req.block_ids) == 3  # the block that only rejected drafts reached is free again
    assert sched.kv.num_free_blocks() == free_before - 1  # only the block the accepted 12 and 99 need
    assert (req.num_draft_tokens, req.num_accepted_tokens) == (6, 1)
    assert sched.schedule().seqs[0].token_ids == [99]


# --- start-up errors -----------------------------------------------------------------------------
@pytest.mark.parametrize("options,needle", [
    ({"num_speculative_tokens": 0}, "num_speculative_tokens=0 must be in [1, 16]"),
    ({"prompt_lookup_min": 4, "prompt_lookup_max": 2}, "prompt_lookup_min=4 and prompt_lookup_max=2"),
    ({"method": "draft"}, "method='draft' needs draft_model"),
    ({"method": "draft", "draft_model": "/no/such/model"}, "model '/no/such/model' not found"),
    ({"draft_model": "/some/model"}, "draft_model='/some/model' cannot be used with method='ngram'"),
    ({"method": "nope"}, "option method='nope' of plugin 'spec_decode' is not one of"),
])
def test_combinations_that_cannot_work_fail_at_start_up(tiny_llama, options, needle):
    with pytest.raises(ConfigError) as err:
        LLM(str(tiny_llama), plugins=["spec_decode"], plugin_options={"spec_decode": options})
    assert needle in str(err.value)


# --- the verify path CUDA graphs replay, and the adaptive policy's back-off --------------------------
@pytest.mark.parametrize("k", [1, 5])
def test_verify_steps_as_single_query_rows_give_the_same_greedy_outputs(family_reference, monkeypatch, k):
    """The layout in which CUDA graphs replay verify steps (one single-query row per token, its causal
    prefix as its sequence length) run eagerly on the CPU: outputs equal those without speculation."""
    path, prompts, expected = family_reference
    llm = LLM(str(path), plugins=["spec_decode"], plugin_options=_spec(k))
    runner = llm.engine.runner
    runner.verify_as_decodes = True
    calls = []  # verify steps laid out as single-query rows (eager on the CPU, graph replays on CUDA)
    rows = runner._decode_rows
    monkeypatch.setattr(runner, "_decode_rows", lambda seqs: calls.append(
        sum(len(s.draft_token_ids) for s in seqs)) or rows(seqs))
    assert _greedy(llm, prompts) == expected
    assert sum(calls) and llm.engine.stats().spec_decode_num_accepted > 0


def test_single_query_rows_with_chunked_prefill_and_preemption(llama_reference):
    path, prompts, expected = llama_reference
    llm = LLM(str(path), plugins=["spec_decode", "prefix_cache"], plugin_options=_spec(3),
              block_size=8, num_kv_blocks=16, max_num_batched_tokens=9)
    llm.engine.runner.verify_as_decodes = True
    assert _greedy(llm, prompts) == expected
    assert llm.engine.stats().num_preemptions > 0
    assert llm.engine.kv.num_free_blocks() == 16


def test_graph_sizes_cover_verify_batches():
    from kvloom.core.engine.step import ScheduledSeq
    from kvloom.core.worker.model_runner import decode_layout, graph_batch_sizes

    assert graph_batch_sizes(8) == [1, 2, 4, 8]
    assert graph_batch_sizes(8, 5, 32) == [1, 2, 4, 5, 8, 10, 20, 40]  # b * (k + 1) for b up to 8
    assert graph_batch_sizes(64, 4, 16)[-1] == 64 and 16 * 4 in graph_batch_sizes(64, 4, 16)

    def seq(n, rows):
        return ScheduledSeq("r", [1] * n, 10, [0, 1], rows, SP())
    assert decode_layout([seq(1, 1), seq(4, 4), seq(1, 0)])  # decodes, a verify, a one-token chunk
    assert not decode_layout([seq(1, 1), seq(4, 1)])  # a prefill chunk needs the prefill kernel


class _WrongProposer:
    """Always proposes k drafts the target never takes (its own next greedy token plus one)."""

    name = "wrong"

    def __init__(self, expected: list[int], prompt_len: int, k: int) -> None:
        self.expected, self.prompt_len, self.num_speculative_tokens = expected, prompt_len, k
        self.calls = 0

    def propose(self, requests):
        self.calls += 1
        return {r.request_id: [(self.expected[r.num_tokens - self.prompt_len] + 1) % 384] * self.num_speculative_tokens
                for r in requests}


def test_adaptive_policy_backs_off_to_plain_overlapped_steps_and_probes_rarely(llama_reference, monkeypatch):
    """With drafts that are never accepted, a request stops proposing after four misses, then probes
    on steps 16, 32 and 64 (the period doubles after each miss); every other step overlaps the previous
    one (async scheduling), and the output is unchanged."""
    path, prompts, _ = llama_reference
    prompt, n = prompts[2], 100
    plain = _greedy(LLM(str(path)), [prompt], n)[0]
    llm = LLM(str(path), plugins=["spec_decode"], plugin_options=_spec(3), async_scheduling="on")
    proposer = _WrongProposer(plain, len(prompt), 3)
    llm.engine.speculator.proposer = proposer
    overlapped = []
    can_overlap = llm.engine._can_overlap
    monkeypatch.setattr(llm.engine, "_can_overlap", lambda: overlapped.append(can_overlap()) or overlapped[-1])
    assert _greedy(llm, [prompt], n)[0] == plain
    stats = llm.engine.stats()
    assert stats.spec_decode_num_accepted == 0
    assert stats.spec_decode_num_steps == proposer.calls == 4 + 3
    assert sum(overlapped) >= n - 2 * proposer.calls - 2


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (the H200 run)")
@pytest.mark.parametrize("k", [1, 3, 5])
def test_verify_steps_replay_cuda_graphs_with_greedy_parity(tiny_model, monkeypatch, k):
    """On the GPU in float32: verify steps of decodes replay captured graphs (counted), and the greedy
    outputs equal the ones without speculation, with and without async scheduling."""
    prompts = _prompts()
    common = dict(dtype="float32", device="cuda", max_num_seqs=8, kv_cache_memory_gib=0.25)
    expected = _greedy(LLM(str(tiny_model), **common), prompts)
    for mode in ("on", "off"):
        llm = LLM(str(tiny_model), plugins=["spec_decode"], plugin_options=_spec(k), async_scheduling=mode, **common)
        runner = llm.engine.runner
        assert any(size % (k + 1) == 0 and size > 8 for size in runner.graphs) or k == 1
        verified = []
        replay = runner._replay
        monkeypatch.setattr(runner, "_replay", lambda seqs: verified.append(
            sum(len(s.draft_token_ids) for s in seqs)) or replay(seqs))
        assert _greedy(llm, prompts) == expected, mode
        assert sum(verified) > 0 and llm.engine.stats().spec_decode_num_accepted > 0


# --- the draft-model proposer --------------------------------------------------------------------
def _make_draft(path, family: str, **changes):
    """A smaller random model of the family (one layer, narrower MLP) with the targets' vocabulary."""
    import transformers

    from tests.conftest import TINY_COMMON, TINY_FAMILIES, make_tokenizer

    cls_name, arch, extra = TINY_FAMILIES[family]
    options = {**TINY_COMMON, **extra, "num_hidden_layers": 1, "intermediate_size": 64, **changes}
    if "layer_types" in options:  # one layer: the first of the family's pattern
        options["layer_types"] = options["layer_types"][:1]
    config = getattr(transformers, cls_name)(**options, architectures=[arch])
    torch.manual_seed(7)
    getattr(transformers, arch)(config).eval().save_pretrained(str(path), safe_serialization=True)
    make_tokenizer(path)
    return path


def _family(path) -> str:
    import json

    return json.loads((path / "config.json").read_text())["model_type"]


@pytest.fixture(scope="module")
def family_draft(family_reference, tmp_path_factory):
    path, prompts, expected = family_reference
    vocab = json.loads((path / "config.json").read_text())["vocab_size"]  # a family's variants may differ in it
    return path, _make_draft(tmp_path_factory.mktemp("draft"), _family(path), vocab_size=vocab), prompts, expected


@pytest.mark.parametrize("k", [1, 3, 5])
def test_draft_model_greedy_outputs_equal_without_spec_decode(family_draft, k):
    path, draft, prompts, expected = family_draft
    llm = LLM(str(path), plugins=["spec_decode"], plugin_options=_spec(k, method="draft", draft_model=str(draft),
                                                                       adaptive=False))
    assert _greedy(llm, prompts) == expected
    assert llm.engine.stats().spec_decode_num_drafts > 0
    assert llm.engine.kv.num_free_blocks() == llm.engine.kv.num_blocks


def test_target_as_its_own_draft_is_always_accepted(family_reference):
    path, prompts, expected = family_reference
    llm = LLM(str(path), plugins=["spec_decode"], plugin_options=_spec(3, method="draft", draft_model=str(path)))
    assert _greedy(llm, prompts) == expected
    stats = llm.engine.stats()
    assert stats.spec_decode_num_drafts > 0 and stats.spec_decode_num_accepted == stats.spec_decode_num_drafts
    assert stats.spec_decode_mean_acceptance_length > 3.0


@pytest.mark.parametrize("scheduler", SCHEDULERS)
def test_draft_model_with_chunked_prefill_preemption_prefix_cache_and_async(llama_reference, scheduler):
    path, prompts, expected = llama_reference
    # The target as its own draft: every draft is accepted, so a wrong draft KV (a block table shared
    # wrongly, a rollback missed after preemption) would show as a rejected draft.
    llm = LLM(str(path), plugins=["spec_decode", "prefix_cache", scheduler],
              plugin_options=_spec(3, method="draft", draft_model=str(path)),
              block_size=8, num_kv_blocks=12, max_num_batched_tokens=9, async_scheduling="on")
    assert _greedy(llm, prompts) == expected
    assert _greedy(llm, prompts) == expected
    stats = llm.engine.stats()
    assert stats.num_preemptions > 0 and stats.prefix_cache_hits > 0
    assert stats.spec_decode_num_drafts > 0 and stats.spec_decode_num_accepted == stats.spec_decode_num_drafts
    assert llm.engine.kv.num_free_blocks() == 12


def test_draft_model_prefills_long_prompts_in_chunks_of_the_step_budget(tiny_llama):
    """Long prompts reach the draft model in chunks of max_num_batched_tokens, as the target's prefill
    does (never one forward over a whole prompt), and the outputs stay those without speculation."""
    rng = random.Random(3)
    phrase = [rng.randrange(3, 384) for _ in range(30)]
    prompts = [phrase * 10, [rng.randrange(3, 384) for _ in range(200)] + phrase, [4, 5, 6] * 3]
    budget = dict(max_num_batched_tokens=32, dtype="float32")  # on a GPU too: bf16 ties flip between layouts
    expected = _greedy(LLM(str(tiny_llama), **budget), prompts)
    # The target as its own draft: a draft KV written wrongly by a chunk would show as a rejected draft.
    llm = LLM(str(tiny_llama), plugins=["spec_decode"], **budget,
              plugin_options=_spec(3, method="draft", draft_model=str(tiny_llama), adaptive=False))
    runner = llm.engine.proposer.runner
    forwards = []
    execute = runner.execute
    runner.execute = lambda plan: forwards.append((plan.num_tokens, sum(s.num_sample_rows for s in plan.seqs))) \
        or execute(plan)
    assert _greedy(llm, prompts) == expected
    assert max(tokens for tokens, _ in forwards) <= 32
    # 300 + 230 prompt tokens went through the draft, most of them in chunks that sample nothing.
    assert sum(tokens for tokens, rows in forwards if rows == 0) >= 300 + 230 - 3 * 32
    stats = llm.engine.stats()
    assert stats.spec_decode_num_drafts > 0 and stats.spec_decode_num_accepted == stats.spec_decode_num_drafts


def test_draft_model_shares_the_kv_budget_and_rejects_another_vocabulary(tiny_llama, tmp_path):
    plain = LLM(str(tiny_llama), kv_cache_memory_gib=0.01)
    draft = _make_draft(tmp_path / "small", "llama")
    llm = LLM(str(tiny_llama), kv_cache_memory_gib=0.01, plugins=["spec_decode"],
              plugin_options=_spec(3, method="draft", draft_model=str(draft)))
    # Target 2 layers + draft 1 layer of the same width: two thirds of the blocks.
    assert llm.engine.kv.num_blocks == plain.engine.kv.num_blocks * 2 // 3
    other = _make_draft(tmp_path / "other", "llama", vocab_size=400)
    with pytest.raises(ConfigError) as err:
        LLM(str(tiny_llama), plugins=["spec_decode"], plugin_options=_spec(3, method="draft", draft_model=str(other)))
    assert "vocab_size=400 but the target model has vocab_size=384" in str(err.value)


# --- the real model ------------------------------------------------------------------------------
@pytest.mark.slow
def test_smollm2_greedy_outputs_equal_without_spec_decode_in_one_mixed_batch():
    """SmolLM2-135M-Instruct in float32: a batch of mixed lengths (a copy-heavy chat over this
    repository's README, which ngram drafts well, and short free-form prompts) gives the same tokens with
    ngram speculation as without."""
    from kvloom.frontends.text import apply_chat_template

    plain = LLM(dtype="float32", kv_cache_memory_gib=0.25)  # two SmolLM2 engines: a small cache each
    # The policy off: every step verifies drafts, so the parity below covers verification throughout
    # (with it on, the free-form prompts' misses can stop drafting before the copy starts).
    spec = LLM(dtype="float32", kv_cache_memory_gib=0.25, plugins=["spec_decode"],
               plugin_options={"spec_decode": {"num_speculative_tokens": 4, "adaptive": False}})
    # A fixed passage (after README's opening), not a live docs file: an edit to the docs must not change what
    # the model copies. SmolLM2 copies it nearly verbatim, which ngram drafts.
    passage = ("A pure-PyTorch LLM inference engine built from plugins. It serves open models to many concurrent "
               "users, with a paged KV cache, continuous batching and chunked prefill, through an OpenAI-compatible "
               "HTTP API, a ZeroMQ gateway for non-HTTP services, and an offline batch API.")
    tok = plain.tokenizer
    prompts = [apply_chat_template(tok, [{"role": "user", "content": "Repeat this passage exactly:\n\n" + passage}], True),
               tok.encode("The capital of Italy is"), tok.encode("def fibonacci(n):"),
               apply_chat_template(tok, [{"role": "user", "content": "Count from 1 to 20."}], True)]
    assert _greedy(spec, prompts, 40) == _greedy(plain, prompts, 40)
    stats = spec.engine.stats()
    assert stats.spec_decode_num_accepted > 20  # the copy was drafted and accepted
