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
