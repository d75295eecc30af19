"""Reasoning output (``--reasoning-parser qwen3|deepseek_r1``): the splitter on its own, whole and
streamed at every cut, and tool calls read from the answer only."""

from __future__ import annotations

import pytest

from kvloom.frontends.chat_output import ChatReading
from kvloom.frontends.reasoning import ReasoningSplitter, split_reasoning, starts_in_reasoning
from kvloom.frontends.tool_parsers import ToolPlan


# --- the splitter ------------------------------------------------------------------------------------
CASES = [
    ("<think>abc</think>answer", False, ("abc", "answer")),
    ("  <think>\nabc\n</think>\n\nans", False, ("\nabc\n", "\n\nans")),
    ("no block here", False, (None, "no block here")),
    ("a<think>b</think>c", False, (None, "a<think>b</think>c")),  # a block must open the output
    ("<think>cut short", False, ("cut short", "")),
    ("<thin", False, (None, "<thin")),
    ("abc</think>x", True, ("abc", "x")),  # the prompt opened the block
    ("<think>abc</think>x", True, ("abc", "x")),  # a model that writes <think> again
    ("never closed", True, ("never closed", "")),
    ("", True, ("", "")),
]


@pytest.mark.parametrize("text,in_reasoning,expected", CASES)
def test_split_whole_and_streamed_at_every_cut(text, in_reasoning, expected):
    assert split_reasoning(text, in_reasoning) == expected
    for size in (1, 2, 3, 5):
        splitter = ReasoningSplitter(in_reasoning)
        reasoning = content = ""
        for i in range(0, len(text), size):
            r, c = splitter.feed(text[i:i + size])
            reasoning, content = reasoning + r, content + c
        r, c = splitter.finish()
        assert ((reasoning + r) if splitter.reasoned else None, content + c) == expected


def test_where_reasoning_starts():
    assert starts_in_reasoning("deepseek_r1", "<s>assistant:", constrained=False)
    assert not starts_in_reasoning("deepseek_r1", "<s>assistant:", constrained=True)  # the grammar decides
    assert starts_in_reasoning("qwen3", "<|im_start|>assistant\n<think>\n", constrained=False)
    assert not starts_in_reasoning("qwen3", "assistant\n<think>\n\n</think>\n\n", constrained=False)
    assert not starts_in_reasoning("qwen3", "<|im_start|>assistant\n", constrained=False)


def test_tool_calls_are_read_from_the_answer_only():
    tool = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}
    reading = ChatReading(ToolPlan("auto", [tool]), "hermes", reasoning=True)
    text = '<think>maybe <tool_call>{"name": "g"}</tool_call></think>Sure.<tool_call>{"name": "f", "arguments": {}}' \
           '</tool_call>'
    reasoning, content, calls = reading.whole(text)
    assert reasoning == 'maybe <tool_call>{"name": "g"}</tool_call>' and content == "Sure."
    assert [c.name for c in calls] == ["f"]
    stream = reading.stream()
    pieces = [stream.feed(text[i:i + 4]) for i in range(0, len(text), 4)]
    more, rest, streamed_calls = stream.finish()
    assert "".join(r for r, _ in pieces) + more == reasoning and "".join(c for _, c in pieces) + rest == "Sure."
    assert [c.name for c in streamed_calls] == ["f"]
