"""Structured outputs together with speculative decoding: the target's verify rows are masked by the
grammar as it stands after each draft, so greedy outputs equal the same constrained requests without
``spec_decode`` token for token (ngram and the target as its own draft, every kind of constraint, in one
batch with unconstrained requests), a draft the grammar forbids is rejected, and sampled outputs still
satisfy their grammar."""

from __future__ import annotations

import json
import re
from types import SimpleNamespace

import jsonschema
import pytest
import torch

from kvloom import LLM, SamplingParams
from kvloom.core.engine.step import ScheduledSeq
from kvloom.core.engine.structured_output import StructuredOutputManager
from kvloom.core.sampling_params import StructuredOutputSpec
from kvloom.core.worker.sampler import Sampler

SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 8},
                                           "tags": {"type": "array", "items": {"enum": ["a", "b", "c"]},
                                                    "maxItems": 3}},
          "required": ["name", "tags"], "additionalProperties": False}
REGEX = r"([a-z]{2,5} [0-9]{1,3}, ){1,3}[a-z]{1,4}\."
CHOICES = ["the quick brown fox", "the lazy dog", "Paris is the capital"]
GRAMMAR = 'root ::= ("ab" | "cd" | " "){1,12} "."'
SPECS = {
    "json_schema": StructuredOutputSpec(kind="json", spec=json.dumps(SCHEMA), any_whitespace=False),
    "regex": StructuredOutputSpec(kind="regex", spec=REGEX),
    "choice": StructuredOutputSpec(kind="choice", spec=json.dumps(CHOICES)),
    "grammar": StructuredOutputSpec(kind="grammar", spec=GRAMMAR),
}
# Every language is finite, so greedy outputs end by their grammar within MAX_NEW tokens.
# Text that the constrained outputs copy from (n-gram lookup finds drafts in it), and a repetition for
# the unconstrained requests beside them.
SOURCE = '{"name":"abc","tags":["a","b"]} ab cd ab cd, the quick brown fox, the lazy dog. abc 12, de 3, '
MAX_NEW = 48


def _satisfies(kind: str, text: str) -> bool:
    if kind == "json_schema":
        # strict=False: xgrammar 0.2.9 writes a string with maxLength as [^"\\\r\n]{0,n}, which lets
        # control characters into it (a random model at temperature 1 picks them); the grammar holds.
        jsonschema.validate(json.loads(text, strict=False), SCHEMA)
        return True
    if kind == "regex":
        return re.fullmatch(REGEX, text) is not None
    if kind == "choice":
        return text in CHOICES
    return re.fullmatch(r"(ab|cd| ){1,12}\.", text) is not None


KV_GIB = 0.0625  # the tiny model's cache: over 60,000 tokens; the CPU default (1 GiB) only adds memory

def _spec(**extra) -> dict:
    return {"spec_decode": {"num_speculative_tokens": 3, "prompt_lookup_min": 1, "adaptive": False, **extra}}


@pytest.fixture(scope="module")
def batch(tiny_llama):
    """One batch: a request of each constraint kind and two unconstrained ones, and its outputs without
    speculation."""
    plain = LLM(str(tiny_llama), kv_cache_memory_gib=KV_GIB)
    prompt = plain.tokenizer.encode(SOURCE * 2)
    prompts = [prompt] * len(SPECS) + [[5, 6, 7, 8] * 6, prompt[:30]]
    params = [SamplingParams(temperature=0.0, max_tokens=MAX_NEW, structured=s) for s in SPECS.values()]
    params += [SamplingParams(temperature=0.0, max_tokens=MAX_NEW, ignore_eos=True)] * 2
    return prompts, params, plain.generate(prompts, params, use_tqdm=False)


@pytest.mark.parametrize("method", ["ngram", "own_draft"])
def test_greedy_constrained_outputs_equal_without_spec_decode(batch, tiny_llama, method):
    prompts, params, want = batch
    extra = {"method": "draft", "draft_model": str(tiny_llama)} if method == "own_draft" else {}
    llm = LLM(str(tiny_llama), kv_cache_memory_gib=KV_GIB, plugins=["spec_decode"], plugin_options=_spec(**extra))
    got = llm.generate(prompts, params, use_tqdm=False)
    assert [o.token_ids for o in got] == [o.token_ids for o in want]
    for kind, out in zip(SPECS, got):
        assert out.outputs[0].finish_reason == "stop" and _satisfies(kind, out.outputs[0].text), (kind, out.outputs[0].text)
    constrained = got[:len(SPECS)]
    # Drafts were verified for every constrained request, and some of them stayed.
    assert all(o.metrics.num_draft_tokens > 0 for o in constrained), [o.metrics.num_draft_tokens for o in constrained]
    assert sum(o.metrics.num_accepted_tokens for o in constrained) > 0
    if method == "own_draft":
        # The draft model writes what the unconstrained target would: wherever the grammar disagrees, the
        # masked target rejects it (the unconstrained requests keep all of theirs).
        assert sum(o.metrics.num_accepted_tokens for o in constrained) < sum(o.metrics.num_draft_tokens
                                                                              for o in constrained)
        free = got[len(SPECS):]
        assert all(o.metrics.num_accepted_tokens == o.metrics.num_draft_tokens > 0 for o in free)
    assert llm.engine.kv.num_free_blocks() == llm.engine.kv.num_blocks


def test_drafts_the_grammar_forbids_are_all_rejected(tiny_llama):
    # The prompt alternates digits and "a": n-gram lookup on a digit proposes "a" next, which "[0-9]+"
    # forbids, so under the grammar no draft of the prompt's survives, while without it they do.
    plain = LLM(str(tiny_llama), kv_cache_memory_gib=KV_GIB)
    tok = plain.tokenizer
    digits, letter = [tok.convert_tokens_to_ids(str(d)) for d in range(10)], tok.convert_tokens_to_ids("a")
    prompt = [t for d in digits for t in (d, letter)] * 2
    spec = StructuredOutputSpec(kind="regex", spec="[0-9]{1,6}")
    params = SamplingParams(temperature=0.0, max_tokens=8, structured=spec)
    want = plain.generate([prompt], params, use_tqdm=False)[0]
    llm = LLM(str(tiny_llama), kv_cache_memory_gib=KV_GIB, plugins=["spec_decode"],
              plugin_options=_spec(prompt_lookup_max=1))
    got = llm.generate([prompt], params, use_tqdm=False)[0]
    assert got.token_ids == want.token_ids and re.fullmatch("[0-9]{1,6}", got.outputs[0].text)
    assert got.metrics.num_draft_tokens > 0 and got.metrics.num_accepted_tokens == 0


@pytest.fixture(scope="module")
def manager(tiny_llama):
    mgr = StructuredOutputManager(str(tiny_llama), None, 384, [2])
    yield mgr
    mgr.close()


def _matched(mgr: StructuredOutputManager, rid: str, spec: StructuredOutputSpec) -> None:
    mgr.submit(SimpleNamespace(request_id=rid, sampling=SimpleNamespace(structured=spec)))
    ready: list = []
    while not ready:
        ready, failed = mgr.take_compiled(wait_s=5.0)
        assert not failed


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_a_forbidden_draft_is_rejected_at_its_row_and_the_matcher_is_left_as_it_was(manager, tiny_llama, temperature):
    tok = LLM(str(tiny_llama), kv_cache_memory_gib=KV_GIB).tokenizer  # the one the manager's masks were built from
    one, a, two = (tok.convert_tokens_to_ids(t) for t in ("1", "a", "2"))
    rid = f"forbidden-{temperature}"
    _matched(manager, rid, StructuredOutputSpec(kind="regex", spec="[0-9]+"))
    sampler = Sampler(torch.device("cpu"), seed=0)
    for trial in range(20):
        sp = SamplingParams(temperature=temperature, seed=trial)
        seq = ScheduledSeq(rid, [one, one, a, two], 0, [0], 4, sp, draft_token_ids=[one, a, two])
        manager.fill_bitmasks([seq])
        # The target strongly prefers each draft at its row: unmasked, every draft would be kept.
        logits = torch.zeros(4, 384)
        for row, t in enumerate([one, a, two, one]):
            logits[row, t] = 12.0
        logits[1, two] = 6.0  # the target's choice where "a" is not allowed
        sampled, _ = sampler.sample(logits, [seq]).fetch()
        tokens = sampled[rid]
        assert tokens[0] == one and len(tokens) == 2  # "1" kept, "a" rejected, nothing after it
        assert tokens[1] != a and re.fullmatch("[0-9]+", tok.decode(tokens, skip_special_tokens=True)), tokens
        assert tokens[1] == two or temperature > 0
    # The fill walked the drafts and rolled back: the matcher still stands at the start, where "a" is
    # forbidden and "1" allowed, and accepting the kept tokens moves it on.
    matcher = manager._matchers[rid]
    assert not matcher.accept_token(a) and matcher.accept_token(one)
    manager.remove([rid])


def test_rows_after_a_stop_token_draft_are_left_unconstrained(manager, tiny_llama):
    # A draft that completes the grammar and then its stop token: the row after the stop has no grammar
    # state to mask from (the request ends there if the stop is kept), and the matcher is rolled back.
    tok = LLM(str(tiny_llama), kv_cache_memory_gib=KV_GIB).tokenizer
    one, two = tok.convert_tokens_to_ids("1"), tok.convert_tokens_to_ids("2")
    _matched(manager, "stop", StructuredOutputSpec(kind="regex", spec="[0-9]{2}"))
    seq = ScheduledSeq("stop", [one, one, two, 2], 0, [0], 4, SamplingParams(temperature=0.0),
                       draft_token_ids=[one, two, 2])
    manager.fill_bitmasks([seq])
    allowed = [(seq.token_bitmask[r, t // 32] >> (t % 32)) & 1 for r, t in ((0, one), (1, two), (2, 2), (2, one))]
    assert [int(x) for x in allowed] == [1, 1, 1, 0]  # after "12" only the stop token is allowed
    assert bool((seq.token_bitmask[3] == -1).all())
    assert manager._matchers["stop"].accept_token(one)  # rolled back to the start
    manager.remove(["stop"])


@pytest.mark.parametrize("kind", ["json_schema", "regex"])
def test_sampled_constrained_outputs_with_spec_decode_satisfy_the_grammar(tiny_llama, kind):
    llm = LLM(str(tiny_llama), kv_cache_memory_gib=KV_GIB, plugins=["spec_decode"], plugin_options=_spec())
    prompt = llm.tokenizer.encode(SOURCE * 2)
    params = [SamplingParams(temperature=1.0, seed=seed, max_tokens=80, structured=SPECS[kind]) for seed in range(4)]
    outs = llm.generate([prompt] * 4, params, use_tqdm=False)
    for o in outs:
        assert o.outputs[0].finish_reason == "stop" and _satisfies(kind, o.outputs[0].text), o.outputs[0].text
    assert sum(o.metrics.num_draft_tokens for o in outs) > 0


# --- the server ------------------------------------------------------------------------------------
PERSON = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 20},
                                           "age": {"type": "integer", "minimum": 0, "maximum": 150}},
          "required": ["name", "age"], "additionalProperties": False}
# The example gives n-gram lookup something to copy: the keys and their punctuation.
PERSON_PROMPT = 'Describe a person as JSON, like {"name": "Ann", "age": 31}.'


@pytest.fixture(scope="module")
def spec_server(smollm2_path, tmp_path_factory):
    from tests.server_utils import EngineServer

    options = json.dumps({"spec_decode": {"num_speculative_tokens": 3, "prompt_lookup_min": 1}})
    srv = EngineServer(["--max-model-len", "1024", "--num-kv-blocks", "256", "--plugins", "spec_decode",
                        "--plugin-options", options], tmp_path_factory.mktemp("so-spec"))
    with srv:
        yield srv


@pytest.mark.slow
def test_server_with_spec_decode_serves_json_schema_strict(spec_server):
    import httpx
    import openai
    from prometheus_client.parser import text_string_to_metric_families

    from kvloom.core.config import DEFAULT_MODEL

    client = openai.OpenAI(base_url=spec_server.url + "/v1", api_key="unused", max_retries=0, timeout=120)
    fmt = {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON, "strict": True}}
    messages = [{"role": "user", "content": PERSON_PROMPT}]
    texts = {}
    for temperature, stream in ((0.0, False), (1.0, True)):
        out = client.chat.completions.create(model=DEFAULT_MODEL, messages=messages, response_format=fmt,
                                             temperature=temperature, seed=3, max_tokens=120, stream=stream)
        if stream:
            chunks = [c.choices[0] for c in out if c.choices]
            text, finish = "".join(c.delta.content or "" for c in chunks), chunks[-1].finish_reason
        else:
            text, finish = out.choices[0].message.content, out.choices[0].finish_reason
        assert finish == "stop", text
        jsonschema.validate(json.loads(text), PERSON)
        texts[temperature] = text
    # Greedy, the served output is the constrained output without speculation.
    spec = StructuredOutputSpec(kind="json", spec=json.dumps(PERSON), strict=True)
    plain = LLM(DEFAULT_MODEL, kv_cache_memory_gib=0.25).chat(  # beside the server: a small cache
        messages, SamplingParams(temperature=0.0, max_tokens=120, structured=spec), use_tqdm=False)[0]
    assert texts[0.0] == plain.outputs[0].text
    samples = {s.name: s.value for fam in text_string_to_metric_families(httpx.get(spec_server.url + "/metrics").text)
               for s in fam.samples}
    assert samples["kvloom_spec_decode_num_draft_tokens_total"] > 0
