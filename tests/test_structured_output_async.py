"""Structured outputs under async scheduling: the grammar takes the token of the step in flight only when
the next step's masks are filled, so constrained steps overlap like free ones. Greedy outputs equal the
same batch scheduled step by step (every kind of constraint beside free requests, a request that ends
mid-batch, n=2, preemption, an abort whose id comes back, spec decoding), and the engine reports that its
constrained steps did overlap."""

from __future__ import annotations

import re

import pytest

from kvloom import LLM, SamplingParams
from kvloom.core.messages import AddRequest
from kvloom.core.sampling_params import StructuredOutputSpec
from tests.test_structured_output_spec import MAX_NEW, SPECS
from tests.test_structured_output_spec import _satisfies as satisfies

# The constraints and their checks are the spec-decoding tests': the same languages, run under async here.
PROMPTS = ["The quick brown fox", "Paris is the capital", "Numbers: 0 1 2", "Once upon a time", "abc 12, de 3"]


def _batch():
    """Each constraint kind on two prompts, free requests between them, one ending after 3 tokens, and a
    constrained request with n=2 (greedy: both completions the same)."""
    prompts, params, kinds = [], [], []
    for i, (kind, spec) in enumerate(SPECS.items()):
        for p in (PROMPTS[i], PROMPTS[i + 1]):
            prompts.append(p)
            params.append(SamplingParams(temperature=0.0, max_tokens=MAX_NEW, structured=spec))
            kinds.append(kind)
        prompts.append(PROMPTS[i])
        params.append(SamplingParams(temperature=0.0, max_tokens=3 if i == 1 else 20, ignore_eos=True))
        kinds.append(None)
    prompts.append(PROMPTS[4])
    params.append(SamplingParams(temperature=0.0, max_tokens=MAX_NEW, n=2, structured=SPECS["json_schema"]))
    kinds.append("json_schema")
    return prompts, params, kinds


@pytest.fixture(scope="module")
def step_by_step(tiny_llama):
    prompts, params, kinds = _batch()
    outs = LLM(str(tiny_llama), dtype="float32", async_scheduling="off").generate(prompts, params, use_tqdm=False)
    return prompts, params, kinds, outs


def _tokens(outs):
    return [[c.token_ids for c in o.outputs] for o in outs]


def _check(kinds, outs):
    for kind, o in zip(kinds, outs):
        for c in o.outputs:
            if kind is not None:
                assert c.finish_reason == "stop" and satisfies(kind, c.text), (kind, c.text)


@pytest.mark.parametrize("options", [{}, {"num_kv_blocks": 14, "block_size": 8}, {"max_num_batched_tokens": 9}],
                         ids=["plain", "preempting", "chunked"])
def test_async_greedy_constrained_outputs_equal_step_by_step(step_by_step, tiny_llama, options):
    prompts, params, kinds, want = step_by_step
    llm = LLM(str(tiny_llama), dtype="float32", async_scheduling="on", **options)
    engine = llm.engine
    got = llm.generate(prompts, params, use_tqdm=False)
    assert _tokens(got) == _tokens(want)
    _check(kinds, got)
    assert [len(c.token_ids) for c in got[5].outputs] == [3]  # the free request that ends mid-batch
    assert got[-1].outputs[0].token_ids == got[-1].outputs[1].token_ids  # n=2, greedy
    if "num_kv_blocks" in options:
        assert engine.scheduler.num_preemptions > 0  # preempted between a step and the one after it
    # Constrained steps overlapped the one before: the grammar took the token in flight at the fill.
    assert engine.num_overlapped_steps > 0 and engine.structured.num_deferred_accepts > 0


def test_constrained_steps_overlap_like_free_ones(tiny_llama):
    llm = LLM(str(tiny_llama), dtype="float32", async_scheduling="on")
    engine = llm.engine
    params = [SamplingParams(temperature=0.0, max_tokens=MAX_NEW, structured=spec) for spec in SPECS.values()]
    start = engine.num_overlapped_steps
    outs = llm.generate(PROMPTS[:4], params, use_tqdm=False)
    _check(list(SPECS), outs)
    decode_steps = max(len(o.outputs[0].token_ids) for o in outs) - 1
    # Every step after the first (the prefill) runs while the one before it is in flight, and each one
    # took that step's tokens into the grammars just before sampling.
    assert engine.num_overlapped_steps - start >= decode_steps
    assert engine.structured.num_deferred_accepts >= decode_steps - 1


def test_an_abort_while_a_step_is_in_flight_and_a_reused_id(tiny_llama):
    # The aborted request's token is still in flight when its id is admitted again: the new request's
    # grammar must start fresh. Had it taken the old request's digit, it would write one digit too few.
    llm = LLM(str(tiny_llama), dtype="float32", async_scheduling="on")
    engine = llm.engine
    prompt = llm.tokenizer.encode(PROMPTS[2])
    sp = SamplingParams(temperature=0.0, max_tokens=MAX_NEW, structured=StructuredOutputSpec(kind="regex",
                                                                                             spec="[0-9]{8}"))
    alone = llm.generate([prompt], sp, use_tqdm=False)[0].outputs[0]
    assert re.fullmatch("[0-9]{8}", alone.text)
    for rid in ("x", "y"):
        engine.add_request(AddRequest(request_id=rid, prompt_token_ids=prompt, sampling=sp))
    got: dict[str, list[int]] = {"x": [], "y": []}
    aborted = False
    while engine.has_unfinished():
        for d in engine.step():
            got[d.request_id] += d.new_token_ids
        if not aborted and len(got["x"]) >= 2 and engine._in_flight is not None:
            assert "x" in [s.request_id for s in engine._in_flight[0].seqs]
            engine.abort_requests(["x"])
            engine.add_request(AddRequest(request_id="x", prompt_token_ids=prompt, sampling=sp))
            got["x"], aborted = [], True
    assert aborted and got["x"] == alone.token_ids and got["y"] == alone.token_ids


def test_spec_decoding_with_async_scheduling_keeps_constrained_outputs(step_by_step, tiny_llama):
    prompts, params, kinds, want = step_by_step
    llm = LLM(str(tiny_llama), dtype="float32", async_scheduling="on", plugins=["spec_decode"], plugin_options={
        "spec_decode": {"num_speculative_tokens": 3, "prompt_lookup_min": 1}})
    got = llm.generate(prompts, params, use_tqdm=False)
    assert _tokens(got) == _tokens(want)
    _check(kinds, got)
