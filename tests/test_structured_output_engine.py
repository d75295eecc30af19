"""Structured outputs and logit_bias in the engine, on a tiny random model through ``kvloom.LLM``: the
grammar holds whatever the model prefers, with synchronous and async scheduling, and a grammar that
cannot compile ends its request as rejected instead of stalling the loop."""

from __future__ import annotations

import json
import re

import jsonschema
import msgspec
import pytest
import torch

from kvloom import LLM, SamplingParams
from kvloom.core.engine.step import ScheduledSeq
from kvloom.core.engine.structured_output import choice_grammar
from kvloom.core.messages import AddRequest
from kvloom.core.sampling_params import StructuredOutputSpec
from kvloom.core.worker.sampler import Sampler

PROMPTS = ["The quick brown fox", "Paris is the capital", "Numbers: 0 1 2"]


@pytest.fixture(scope="module", params=["off", "on"], ids=["sync", "async"])
def llm(request, tiny_llama):
    return LLM(str(tiny_llama), async_scheduling=request.param)


def _gen(llm, prompts, **kw):
    return [o.outputs[0] for o in llm.generate(prompts, SamplingParams(**kw), use_tqdm=False)]


def test_regex_constraint_holds_for_a_random_model(llm):
    pattern = r"[a-z]{3,8}-\d{2}"
    outs = _gen(llm, PROMPTS, temperature=1.0, seed=3, max_tokens=40,
                structured=StructuredOutputSpec(kind="regex", spec=pattern))
    assert all(re.fullmatch(pattern, o.text) and o.finish_reason == "stop" for o in outs), [o.text for o in outs]
    free = _gen(llm, PROMPTS, temperature=1.0, seed=3, max_tokens=12)
    assert not any(re.fullmatch(pattern, o.text) for o in free)  # the model alone does not write this


def test_choice_and_json_schema_constraints(llm):
    outs = _gen(llm, PROMPTS, temperature=1.0, seed=1, max_tokens=20,
                structured=StructuredOutputSpec(kind="choice", spec=json.dumps(["café", "naïve", "a \"b\""])))
    assert {o.text for o in outs} <= {"café", "naïve", 'a "b"'}
    schema = {"type": "object", "properties": {"k": {"enum": ["x", "y"]}}, "required": ["k"],
              "additionalProperties": False}
    # Without any-whitespace freedom a random model cannot wander off: compact JSON comes back whole.
    spec = StructuredOutputSpec(kind="grammar", spec='root ::= "{\\"k\\":\\"" ("x" | "y") "\\"}"')
    for o in _gen(llm, PROMPTS, temperature=1.0, seed=2, max_tokens=20, structured=spec):
        jsonschema.validate(json.loads(o.text), schema)


def test_constrained_and_free_requests_share_a_batch(llm):
    spec = StructuredOutputSpec(kind="regex", spec="[0-9]{4}")
    free = _gen(llm, PROMPTS, temperature=0, max_tokens=8, ignore_eos=True)
    params = [SamplingParams(temperature=0, max_tokens=8, ignore_eos=True),
              SamplingParams(temperature=0, max_tokens=8, structured=spec),
              SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)]
    mixed = [o.outputs[0] for o in llm.generate(PROMPTS, params, use_tqdm=False)]
    assert re.fullmatch("[0-9]{4}", mixed[1].text)
    assert [mixed[0].token_ids, mixed[2].token_ids] == [free[0].token_ids, free[2].token_ids]


def test_a_grammar_that_does_not_compile_rejects_its_request(llm):
    engine = llm.engine
    bad = SamplingParams(max_tokens=4, structured=StructuredOutputSpec(kind="regex", spec="(("))
    engine.add_request(AddRequest(request_id="bad-grammar", prompt_token_ids=[5, 6, 7], sampling=bad))
    deltas = []
    while engine.has_unfinished():
        deltas += engine.step()
    (delta,) = [d for d in deltas if d.request_id == "bad-grammar"]
    assert delta.finish_reason == "error" and delta.error_kind == "rejected"
    assert "invalid regex" in delta.error and "parenthesis" in delta.error


def test_kvloom_llm_says_why_a_request_ended_with_an_error(llm):
    # Through the offline API the same refusal is an output with its reason, not an empty completion
    # with finish_reason "error" and nothing to say why; the good request beside it still completes.
    params = [SamplingParams(max_tokens=4, structured=StructuredOutputSpec(kind="regex", spec="((")),
              SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)]
    bad, good = [o.outputs[0] for o in llm.generate(PROMPTS[:2], params, use_tqdm=False)]
    assert bad.finish_reason == "error" and bad.text == "" and "invalid regex" in bad.error
    assert good.finish_reason == "length" and len(good.token_ids) == 4 and good.error is None


def test_logit_bias_forces_a_token_and_bans_the_greedy_one(llm):
    forced = _gen(llm, PROMPTS[:1], temperature=1.0, seed=0, max_tokens=6, ignore_eos=True, logit_bias={77: 100})
    assert forced[0].token_ids == [77] * 6
    greedy = _gen(llm, PROMPTS[:1], temperature=0, max_tokens=1, ignore_eos=True)[0].token_ids[0]
    banned = _gen(llm, PROMPTS[:1], temperature=0, max_tokens=1, ignore_eos=True, logit_bias={greedy: -100})
    assert banned[0].token_ids[0] != greedy


def test_sampling_params_with_constraints_cross_the_wire():
    sp = SamplingParams(logit_bias={3: -1.5}, structured=StructuredOutputSpec(kind="json", spec="{}", strict=False))
    assert msgspec.msgpack.decode(msgspec.msgpack.encode(sp), type=SamplingParams) == sp


@pytest.mark.parametrize("kw,needle", [
    (dict(logit_bias={3: 100.5}), "[-100, 100]"),
    (dict(logit_bias={-1: 1.0}), "token ids"),
    (dict(structured=StructuredOutputSpec(kind="xml", spec="x")), "must be one of"),
    (dict(structured=StructuredOutputSpec(kind="regex")), "needs a spec"),
])
def test_invalid_constraints_name_the_value(kw, needle):
    with pytest.raises(ValueError, match=re.escape(needle)):
        SamplingParams(**kw)


def test_bitmask_masks_rows_on_the_device_in_one_batch():
    # Row 0 allows tokens 1 and 40 only; row 1 is unconstrained: its argmax stays.
    vocab = 64
    mask = torch.zeros(1, 2, dtype=torch.int32)
    mask[0, 0] = 1 << 1
    mask[0, 1] = 1 << (40 - 32)
    sp = SamplingParams(temperature=0)
    seqs = [ScheduledSeq("a", [1], 0, [0], 1, sp, token_bitmask=mask), ScheduledSeq("b", [1], 0, [0], 1, sp)]
    logits = torch.zeros(2, vocab)
    logits[:, 7] = 5.0
    logits[0, 40] = 1.0
    tokens, _ = Sampler(torch.device("cpu")).sample(logits, seqs).fetch()
    assert tokens == {"a": [40], "b": [7]}


def test_choice_grammar_escapes_quotes():
    assert choice_grammar(['a"b', "c"]) == 'root ::= "a\\"b" | "c"'
