"""Structured outputs apply to the answer, not the reasoning: with a reasoning parser the grammar starts
after the output's ``</think>`` (the engine holds it back until that token), unless the prompt has closed
the block already (``enable_thinking: false``) or the server lets grammars constrain the reasoning too.
A tiny random model whose tokenizer has ``<think>``/``</think>`` as tokens of their own, steered by
``logit_bias`` to a token the grammar forbids and to ``</think>``."""

from __future__ import annotations

import shutil

import openai
import pytest

from tests.server_utils import EngineServer

SERVED = "thinker"
ASK = [{"role": "user", "content": "Yes or no?"}]
CHOICE = {"structured_outputs": {"choice": ["yes", "no"]}}
TEMPLATE = ("{% for m in messages %}<s>{{ m['role'] }}: {{ m['content'] }}</s>{% endfor %}"
            "{% if add_generation_prompt %}<s>assistant:{% if enable_thinking is defined and not enable_thinking %}"
            "<think></think>{% else %}<think>{% endif %}{% endif %}")


@pytest.fixture(scope="module")
def thinker(tiny_llama, tmp_path_factory):
    from transformers import AutoTokenizer

    path = tmp_path_factory.mktemp("thinker") / "model"
    shutil.copytree(tiny_llama, path)
    tok = AutoTokenizer.from_pretrained(str(path))
    tok.add_tokens(["<think>", "</think>"])  # one token each, as in Qwen3's vocabulary
    tok.save_pretrained(str(path))
    (path.parent / "think.jinja").write_text(TEMPLATE)
    return path, tok


@pytest.fixture(scope="module")
def server(thinker, tmp_path_factory):
    path, _ = thinker
    srv = EngineServer(["--model", str(path), "--num-kv-blocks", "64", "--served-model-name", SERVED,
                        "--chat-template", str(path.parent / "think.jinja"), "--reasoning-parser", "qwen3"],
                       tmp_path_factory.mktemp("thinker-server"))
    with srv:
        yield srv


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=120)


def ask(client, bias: dict[int, float], max_tokens: int, **extra):
    return client.chat.completions.create(model=SERVED, messages=ASK, temperature=0, max_tokens=max_tokens,
                                          logit_bias={str(t): b for t, b in bias.items()},
                                          extra_body={**CHOICE, **extra})


def streamed(client, bias: dict[int, float], max_tokens: int) -> tuple[str, str]:
    reasoning = content = ""
    for chunk in client.chat.completions.create(model=SERVED, messages=ASK, temperature=0, max_tokens=max_tokens,
                                                logit_bias={str(t): b for t, b in bias.items()}, stream=True,
                                                extra_body=CHOICE):
        delta = chunk.choices[0].delta
        reasoning += getattr(delta, "reasoning_content", None) or ""
        content += delta.content or ""
    return reasoning, content


def test_the_grammar_leaves_the_reasoning_free(client, thinker):
    _, tok = thinker
    word = tok.encode("fox")[0]  # no choice starts with it: a grammar applied from the first token forbids it
    out = ask(client, {word: 100}, 6)
    message = out.choices[0].message
    assert out.choices[0].finish_reason == "length"
    assert message.reasoning_content == tok.decode([word]) * 6 and not message.content
    assert streamed(client, {word: 100}, 6) == (message.reasoning_content, "")


def test_the_grammar_starts_after_the_end_of_reasoning(client, thinker):
    _, tok = thinker
    end = tok.convert_tokens_to_ids("</think>")
    out = ask(client, {end: 100}, 10)  # </think> first (free), then the choice (the grammar masks </think>)
    message = out.choices[0].message
    assert out.choices[0].finish_reason == "stop"
    assert message.content in ("yes", "no") and not message.reasoning_content
    assert streamed(client, {end: 100}, 10) == ("", message.content)


def test_a_block_closed_in_the_prompt_leaves_the_whole_output_to_the_grammar(client, thinker):
    _, tok = thinker
    end = tok.convert_tokens_to_ids("</think>")
    out = ask(client, {end: 100}, 10, chat_template_kwargs={"enable_thinking": False})
    assert out.choices[0].finish_reason == "stop"
    assert out.choices[0].message.content in ("yes", "no")
    assert getattr(out.choices[0].message, "reasoning_content", None) is None


# --- the engine's bookkeeping, with drafts ---------------------------------------------------------------
def test_drafts_that_cross_the_marker_are_masked_from_the_token_after_it(tiny_llama):
    """Speculative decoding: rows before the marker's last draft stay free, the rows after it get the
    grammar's masks as it stands after each later draft; once the step's tokens are taken, the matcher
    starts after the marker."""
    from types import SimpleNamespace

    from kvloom import LLM, SamplingParams
    from kvloom.core.engine.step import ScheduledSeq
    from kvloom.core.engine.structured_output import StructuredOutputManager
    from kvloom.core.sampling_params import StructuredOutputSpec

    tok = LLM(str(tiny_llama)).tokenizer
    b, a, one, two = (tok.convert_tokens_to_ids(t) for t in ("b", "a", "1", "2"))
    mgr = StructuredOutputManager(str(tiny_llama), None, 384, [2])
    try:
        spec = StructuredOutputSpec(kind="regex", spec="[0-9]+", after=(a,))  # "a" stands for </think>
        for rid in ("crossing", "free"):
            mgr.submit(SimpleNamespace(request_id=rid, sampling=SimpleNamespace(structured=spec)))
        ready: list = []
        while len(ready) < 2:
            got, failed = mgr.take_compiled(wait_s=5.0)
            assert not failed
            ready += got

        def allowed(seq, row, token) -> bool:
            return bool((seq.token_bitmask[row, token // 32] >> (token % 32)) & 1)

        crossing = ScheduledSeq("crossing", [b, b, a, one, two], 0, [0], 5, SamplingParams(temperature=0.0),
                                draft_token_ids=[b, a, one, two])
        free = ScheduledSeq("free", [b, b, b], 0, [0], 3, SamplingParams(temperature=0.0), draft_token_ids=[b, b])
        mgr.fill_bitmasks([crossing, free])
        assert free.token_bitmask is None  # no marker in sight: nothing is masked
        assert allowed(crossing, 0, b) and allowed(crossing, 1, b)  # reasoning rows: free
        assert not allowed(crossing, 2, b) and allowed(crossing, 2, one)  # the first token after the marker
        assert not allowed(crossing, 3, b) and allowed(crossing, 3, two) and allowed(crossing, 4, one)
        mgr.accept_step(1, {"crossing": [b, a, one], "free": [b, b, b]})
        assert "crossing" not in mgr._awaited and "free" in mgr._awaited
        matcher = mgr._matchers["crossing"]
        assert not matcher.accept_token(b) and matcher.accept_token(two)  # it took "1" after the marker
    finally:
        mgr.close()
