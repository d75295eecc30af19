"""The no-regression policy of speculative decoding, decided from cost: with a step-time model that says
compute-bound, nothing is proposed; memory-bound with high acceptance, every draft; in between, the
number of drafts that gives the most expected tokens per second; a contested step budget goes to
prefill first. Driven by a scheduler without a model and a cost model fed exact step timings."""

from __future__ import annotations

import random

import pytest

from kvloom import LLM, SamplingParams
from kvloom.core.engine.speculation import SpeculationPolicy, Speculator, StepCostModel
from kvloom.plugins.builtin import spec_decode
from kvloom.plugins.builtin.fcfs import FCFSPolicy
from tests.plugins.scheduler_sim import add, make_scheduler, step

K = 4


class _FixedProposer:
    """Proposes k drafts for every request it is asked about, and counts the calls."""

    name = "fixed"
    num_speculative_tokens = K

    def __init__(self) -> None:
        self.calls = 0

    def propose(self, requests):
        self.calls += 1
        return {r.request_id: [7] * K for r in requests}


def _rate(alpha: float, k: int = K) -> float:
    """The share of k drafts accepted on average when each is accepted with ``alpha`` after the previous."""
    return sum(alpha ** j for j in range(1, k + 1)) / k


def _decoding(num: int, acceptance: float, *, budget: int = 64, waiting: int = 0):
    """A scheduler with ``num`` requests decoding (prompts of 6 tokens, prefilled by one step) whose recent
    acceptance is ``acceptance``, and a waiting request of ``waiting`` prompt tokens if > 0."""
    sched = make_scheduler(FCFSPolicy(), num_blocks=256, block_size=4, max_num_seqs=16, budget=budget)
    reqs = [add(sched, f"r{i}", 6, max_tokens=50) for i in range(num)]
    step(sched)
    assert len(sched.decoding()) == num
    for r in reqs:
        r.recent_acceptance = acceptance
    if waiting:
        add(sched, "w", waiting, max_tokens=4)
    return sched, reqs


def _speculator(a: float, b: float, policy: SpeculationPolicy | None = None) -> tuple[Speculator, _FixedProposer]:
    """A speculator whose cost model has seen steps of many sizes that took exactly a + b * tokens."""
    proposer = _FixedProposer()
    spec = Speculator(proposer, 100_000, policy or SpeculationPolicy())
    for tokens in [1, 8, 3, 40, 16, 64, 5, 24, 12, 32, 2, 48]:
        spec.observe(tokens, tokens, a + b * tokens)
    assert spec.cost.fit() == pytest.approx((a, b), rel=1e-4, abs=1e-9)
    return spec, proposer


def test_compute_bound_steps_propose_nothing():
    # 8 requests with 90% acceptance: the old rule (max_batch_size = 32) proposed for all of them. With a
    # token costing 10 ms beside a 1 ms step overhead, a verify row costs nearly a whole token's share of
    # the step, so even the likeliest draft loses, and the proposer is not even asked.
    sched, reqs = _decoding(8, 0.9)
    spec, proposer = _speculator(a=0.001, b=0.010)
    assert spec.propose(sched) == 0
    assert proposer.calls == 0
    assert not spec.wants_host_tokens(sched)  # so async scheduling keeps overlapping such steps
    plan = sched.schedule()
    assert plan.num_draft_tokens == 0 and plan.num_tokens == 8


def test_memory_bound_steps_with_high_acceptance_propose_every_draft():
    sched, reqs = _decoding(8, 0.9)
    spec, proposer = _speculator(a=0.050, b=0.0001)  # the weights' read dominates: extra rows are nearly free
    assert spec.propose(sched) == 8 * K
    assert spec.wants_host_tokens(sched)
    plan = sched.schedule()
    assert plan.num_draft_tokens == 8 * K and all(len(s.draft_token_ids) == K for s in plan.seqs)


def test_in_between_each_request_gets_the_number_of_drafts_that_pays_most():
    # One request, per-token acceptance 0.64: drafts are worth 0.64, 0.41, 0.26, 0.17 tokens. With a 30 ms
    # overhead and 10 ms a token, expected tokens per second peak at two drafts.
    alpha, a, b = 0.64, 0.030, 0.010
    sched, (req,) = _decoding(1, _rate(alpha))
    spec, _ = _speculator(a, b)

    def goodput(k):
        return (1 + sum(alpha ** j for j in range(1, k + 1))) / (a + b * (1 + k))
    best = max(range(K + 1), key=goodput)
    assert 0 < best < K
    assert spec.propose(sched) == best
    assert len(req.spec_token_ids) == best


def test_a_contested_budget_goes_to_prefill_first():
    # Memory-bound, every draft would pay: but 4 decodes and a 60-token prompt fill the 64-token budget.
    sched, reqs = _decoding(4, 0.9, waiting=60)
    spec, proposer = _speculator(a=0.050, b=0.0001)
    assert spec.propose(sched) == 0 and proposer.calls == 0
    plan = sched.schedule()
    chunks = {s.request_id: s.num_new_tokens for s in plan.seqs}
    assert chunks == {"r0": 1, "r1": 1, "r2": 1, "r3": 1, "w": 60}  # before: w got 44, drafts took 16

    # A 50-token prompt leaves 10 tokens: the drafts get those, the prompt all of its 50.
    sched, reqs = _decoding(4, 0.9, waiting=50)
    spec, _ = _speculator(a=0.050, b=0.0001)
    assert spec.propose(sched) == 10
    plan = sched.schedule()
    assert {s.request_id: s.num_new_tokens for s in plan.seqs}["w"] == 50
    assert plan.num_draft_tokens == 10 and plan.num_tokens == 64


def test_the_scheduler_gives_drafts_only_what_known_tokens_leave():
    # Drafts set by hand (as any proposer could) on a decoding request, and a waiting prompt that needs
    # all but 3 tokens of the budget: the prompt gets its whole chunk, the drafts the 3 left.
    sched, (req,) = _decoding(1, 0.9, budget=32, waiting=28)
    req.spec_token_ids = [7] * 8
    plan = sched.schedule()
    seqs = {s.request_id: s for s in plan.seqs}
    assert seqs["w"].num_new_tokens == 28
    assert seqs["r0"].draft_token_ids == [7, 7, 7] and seqs["r0"].num_sample_rows == 4
    assert plan.num_tokens == 32


def test_without_the_goodput_rule_the_old_rules_decide():
    sched, _ = _decoding(8, 0.9)
    spec, _ = _speculator(a=0.001, b=0.010, policy=SpeculationPolicy(goodput=False))
    assert spec.propose(sched) == 8 * K  # compute-bound, but only max_batch_size (32) could stop it
    sched, _ = _decoding(8, 0.9)
    spec, _ = _speculator(a=0.050, b=0.0001, policy=SpeculationPolicy(max_batch_size=4))
    assert spec.propose(sched) == 0  # memory-bound, but more running requests than max_batch_size


def test_the_cost_model_needs_evidence_before_it_stops_drafts():
    model = StepCostModel()
    for _ in range(20):
        model.observe(8, 8, 0.1)
    assert model.fit() is None  # every step one size: the slope is unknown, so drafts are allowed
    # Step times that do not depend on the size (noise of a shared machine): a slope the noise explains
    # is reported as 0, memory-bound, not as compute-bound.
    rng = random.Random(0)
    noisy = StepCostModel()
    for _ in range(40):
        noisy.observe(rng.choice([4, 20]), 4, rng.uniform(0.05, 0.5))
    assert noisy.fit()[1] == 0.0
    # A sampled row counts its LM head's work on top of the token.
    weighted = StepCostModel(logits_weight=0.25)
    assert weighted.size(10, 4) == 11.0


def test_the_goodput_option_reaches_the_policy():
    info = spec_decode.kvloom_plugin_info()
    options = {o.name: o.default for o in info.options}
    assert options["goodput"] is True
    proposer = spec_decode.kvloom_spec_proposer(None, None, {**options, "goodput": False})
    assert proposer.policy.goodput is False


def test_the_engine_feeds_its_step_timings_to_the_cost_model(tiny_llama):
    llm = LLM(str(tiny_llama), plugins=["spec_decode"], plugin_options={"spec_decode": {"prompt_lookup_min": 1}})
    out = llm.generate([[5, 6, 7] * 5], SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True),
                       use_tqdm=False)
    assert len(out[0].token_ids) == 12
    cost = llm.engine.speculator.cost
    assert cost.num_steps >= 2  # one per step; every one after the first (warm-up) is in the fit
