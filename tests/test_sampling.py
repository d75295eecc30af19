"""Sampling parameters end to end on a tiny model: seeds, validation, stop conditions, logprobs."""

from __future__ import annotations

import pytest
import torch

from kvloom import LLM, SamplingParams

PROMPTS = ["The quick brown fox", "Paris is the capital", "Numbers: 0 1 2"]


@pytest.fixture(scope="module", params=["off", "on"], ids=["sync", "async"])
def llm(request, tiny_llama):
    # With async scheduling, tokens reach the host a step late: every behaviour below must hold anyway.
    return LLM(str(tiny_llama), async_scheduling=request.param)


def _texts(llm, params):
    return [o.text for o in llm.generate(PROMPTS, params, use_tqdm=False)]


def test_seeded_sampling_is_reproducible_and_seed_dependent(llm):
    a = _texts(llm, SamplingParams(temperature=1.0, seed=1234, max_tokens=24, ignore_eos=True))
    b = _texts(llm, SamplingParams(temperature=1.0, seed=1234, max_tokens=24, ignore_eos=True))
    c = _texts(llm, SamplingParams(temperature=1.0, seed=99, max_tokens=24, ignore_eos=True))
    assert a == b
    assert a != c


def test_seeded_output_does_not_depend_on_batch_company(llm):
    params = SamplingParams(temperature=0.8, top_p=0.9, seed=7, max_tokens=16, ignore_eos=True)
    alone = llm.generate([PROMPTS[0]], params, use_tqdm=False)[0].token_ids
    together = llm.generate(PROMPTS, params, use_tqdm=False)[0].token_ids
    assert alone == together


def test_top_k_one_equals_greedy(llm):
    greedy = _texts(llm, SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True))
    top1 = _texts(llm, SamplingParams(temperature=1.5, top_k=1, max_tokens=12, ignore_eos=True))
    assert greedy == top1


def test_max_tokens_and_finish_reason(llm):
    outs = llm.generate(PROMPTS, SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True), use_tqdm=False)
    assert all(len(o.token_ids) == 5 and o.finish_reason == "length" for o in outs)


def test_stop_token_ids_end_the_request(llm):
    first = llm.generate([PROMPTS[1]], SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True),
                         use_tqdm=False)[0].token_ids
    stop_at = first[3]
    out = llm.generate([PROMPTS[1]], SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True,
                                                     stop_token_ids=[stop_at]), use_tqdm=False)[0]
    assert out.finish_reason == "stop"
    assert out.token_ids == first[: first.index(stop_at) + 1]
    assert out.outputs[0].stop_reason == stop_at


def test_min_tokens_blocks_stop_tokens(llm):
    first = llm.generate([PROMPTS[1]], SamplingParams(temperature=0.0, max_tokens=1), use_tqdm=False)[0].token_ids
    out = llm.generate([PROMPTS[1]], SamplingParams(temperature=0.0, max_tokens=6, min_tokens=4,
                                                     stop_token_ids=[first[0]]), use_tqdm=False)[0]
    assert len(out.token_ids) >= 4
    assert first[0] not in out.token_ids[:4]


def test_stop_strings_truncate_text(llm):
    full = llm.generate([PROMPTS[1]], SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True),
                        use_tqdm=False)[0].text
    # A two-letter stop string that first occurs after the start of the text.
    start = next(i for i in range(1, len(full) - 1) if full[i : i + 2].isascii() and full[i : i + 2].isalpha())
    stop = full[start : start + 2]
    out = llm.generate([PROMPTS[1]], SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True, stop=[stop]),
                       use_tqdm=False)[0]
    assert out.finish_reason == "stop"
    assert out.text == full[: full.index(stop)]
    assert out.outputs[0].stop_reason == stop


def test_penalties_change_greedy_output(llm):
    base = _texts(llm, SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True))
    rep = _texts(llm, SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True, repetition_penalty=2.0))
    freq = _texts(llm, SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True, frequency_penalty=2.0))
    assert rep != base
    assert freq != base


def test_logprobs_are_returned_per_token(llm):
    out = llm.generate([PROMPTS[0]], SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True, logprobs=3),
                       use_tqdm=False)[0]
    lps = out.outputs[0].logprobs
    assert len(lps) == 4
    for tok, lp in zip(out.token_ids, lps):
        assert lp.token_id == tok and len(lp.top) == 3
        assert lp.top[0].token_id == tok  # greedy: the chosen token is the most likely one
        assert lp.logprob <= 0.0 and lp.top[0].logprob >= lp.top[1].logprob >= lp.top[2].logprob


def test_n_returns_distinct_samples(llm):
    out = llm.generate([PROMPTS[0]], SamplingParams(n=3, temperature=1.0, seed=5, max_tokens=16, ignore_eos=True),
                       use_tqdm=False)[0]
    assert len(out.outputs) == 3
    assert len({tuple(c.token_ids) for c in out.outputs}) > 1


@pytest.mark.parametrize("field,value,needle", [
    ("temperature", -0.5, "temperature=-0.5 must be in [0.0, 100.0]"),
    ("top_p", 0.0, "top_p=0.0 must be in (0, 1]"),
    ("top_k", -2, "top_k=-2"),
    ("min_p", 1.5, "min_p=1.5 must be in [0.0, 1.0]"),
    ("max_tokens", 0, "max_tokens=0 must be >= 1"),
    ("presence_penalty", 3.0, "presence_penalty=3.0 must be in [-2.0, 2.0]"),
    ("repetition_penalty", 0.0, "repetition_penalty=0.0"),
    ("logprobs", 21, "logprobs=21 must be in [0, 20]"),
    ("n", 0, "n=0"),
])
def test_invalid_sampling_values_name_the_value_and_range(field, value, needle):
    with pytest.raises(ValueError) as err:
        SamplingParams(**{field: value})
    assert needle in str(err.value)


def test_prompt_over_the_context_is_rejected_before_any_work(llm):
    limit = llm.engine.max_model_len
    # The message HTTP and the gateway give too (frontends/validation.py).
    with pytest.raises(ValueError, match=rf"maximum context length is {limit} tokens"):
        llm.generate([[5] * (limit - 3), [5, 6]], SamplingParams(max_tokens=10), use_tqdm=False)
    assert not llm.engine.has_unfinished()  # the valid prompt of the same call was not left behind


def test_request_larger_than_the_whole_kv_cache_is_rejected(tiny_llama):
    small = LLM(str(tiny_llama), num_kv_blocks=4, block_size=8)
    with pytest.raises(ValueError, match=r"needs 5 KV blocks .* whole cache has 4 blocks"):
        small.generate([[5] * 30], SamplingParams(max_tokens=10), use_tqdm=False)


def test_incremental_text_is_exact_across_multibyte_characters(llm):
    from kvloom.frontends.text import IncrementalText

    text = "Unicode: café, naïve, 東京, 🚀 and plain words."
    ids = llm.tokenizer.encode(text, add_special_tokens=False)
    inc = IncrementalText(llm.tokenizer)
    pieces = [inc.add_tokens([t], final=i == len(ids) - 1) for i, t in enumerate(ids)]
    assert "".join(pieces) == text
    assert all("\ufffd" not in p for p in pieces)  # never a half character on the wire


def test_stop_string_split_across_tokens_is_never_streamed(llm):
    from kvloom.frontends.text import IncrementalText

    text = "alpha beta STOPWORD gamma"
    ids = llm.tokenizer.encode(text, add_special_tokens=False)
    inc = IncrementalText(llm.tokenizer, stop=["STOPWORD"])
    streamed = "".join(inc.add_tokens([t]) for t in ids)
    assert inc.stopped_by == "STOPWORD"
    assert streamed == "alpha beta "


def test_cpu_greedy_argmax_takes_the_first_maximum_and_nan_as_argmax_does():
    from kvloom.kernels import ops

    g = torch.Generator().manual_seed(0)
    logits = torch.randint(-3, 3, (16, 1000), generator=g).float()  # many ties
    logits[2, 500] = logits[2, 900] = float("nan")  # NaN wins, the first of them
    logits[3] = float("-inf")
    logits[4, 10] = logits[4, 999] = 50.0
    for x in (logits, logits[:, :1], logits[:, :37], logits[:0], logits.bfloat16(), logits[:, 3:]):
        assert torch.equal(ops.greedy_argmax(x), x.argmax(dim=-1))
    assert ops.greedy_argmax(logits)[2] == 500 and ops.greedy_argmax(logits)[4] == 10


def test_the_cpu_argmax_kernel_is_torch_max_s_index_for_every_tail_and_tie():
    from kvloom.kernels import cpu_argmax

    if not cpu_argmax.available():
        pytest.skip("no C++ compiler: torch's max serves")
    g = torch.Generator().manual_seed(1)
    for n in (1, 15, 16, 17, 33, 49152):
        x = torch.randint(-2, 2, (9, n), generator=g).float()  # ties in every lane
        x[1] = float("-inf")
        x[2, n // 2] = float("nan")
        x[3, -1] = float("nan")  # a NaN in the tail
        x[4, -1] = 99.0  # the maximum in the tail
        assert cpu_argmax.serves(x)
        assert torch.equal(cpu_argmax.argmax_rows(x), x.max(dim=-1).indices), n
