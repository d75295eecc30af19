"""Reasoning models' thinking split from their answer: the ``<think>...</think>`` block of Qwen3 and
DeepSeek-R1 read from a completion's text, whole or as it streams (``--reasoning-parser``)."""

from __future__ import annotations

REASONING_PARSERS = ("qwen3", "deepseek_r1")
START, END = "<think>", "</think>"


def starts_in_reasoning(parser: str, prompt_tail: str, constrained: bool) -> bool:
    """Whether a completion's first token is already reasoning. DeepSeek-R1's template opens the block in
    the prompt, so its output may lack ``<think>``; a Qwen3 output is reasoning from the start when the
    prompt ends inside an open block (thinking-only templates). A constrained output (a grammar writes it
    all) is reasoning only if it opens the block itself."""
    if constrained:
        return False
    if parser == "deepseek_r1":
        return True
    return prompt_tail.rfind(START) > prompt_tail.rfind(END)


def grammar_waits_for_reasoning(prompt_tail: str) -> bool:
    """Whether a structured output should start after the output's ``</think>``: unless the prompt has
    closed a block already (Qwen3's ``enable_thinking: false``), the model may reason first."""
    return prompt_tail.rfind(END) < prompt_tail.rfind(START) or END not in prompt_tail


def _held(text: str, marker: str) -> int:
    """How many characters at the end of ``text`` may be the start of ``marker``."""
    for k in range(min(len(marker) - 1, len(text)), 0, -1):
        if marker.startswith(text[-k:]):
            return k
    return 0


class ReasoningSplitter:
    """One completion's text in, ``(reasoning, content)`` out. Text that may still be part of a marker is
    held back, so streamed pieces always add up to the whole split."""

    def __init__(self, in_reasoning: bool) -> None:
        self.state = "reasoning" if in_reasoning else "opening"  # opening: the output may still open a block
        self.reasoned = in_reasoning  # False: no reasoning at all (the field stays null)
        self._at_start = True  # a block's first text: a <think> the model writes itself is dropped
        self._buf = ""

    def feed(self, text: str) -> tuple[str, str]:
        self._buf += text
        reasoning = ""
        while True:
            if self.state == "content":
                content, self._buf = self._buf, ""
                return reasoning, content
            head = self._buf.lstrip()
            if self.state == "opening" or self._at_start:
                if head.startswith(START):
                    self._buf = head[len(START):]
                    self.state, self.reasoned, self._at_start = "reasoning", True, False
                    continue
                if START.startswith(head):
                    return reasoning, ""  # perhaps a block opening: wait for more
                if self.state == "opening":
                    self.state = "content"
                    continue
                self._at_start = False
            at = self._buf.find(END)
            if at >= 0:
                reasoning += self._buf[:at]
                self._buf = self._buf[at + len(END):]
                self.state = "content"
                continue
            keep = _held(self._buf, END)
            reasoning += self._buf[:len(self._buf) - keep]
            self._buf = self._buf[len(self._buf) - keep:]
            return reasoning, ""

    def finish(self) -> tuple[str, str]:
        """What was held back, once the output is complete: an unclosed block is all reasoning."""
        rest, self._buf = self._buf, ""
        return (rest, "") if self.state == "reasoning" else ("", rest)


def split_reasoning(text: str, in_reasoning: bool) -> tuple[str | None, str]:
    """A whole output as ``(reasoning, content)``; reasoning is None when the output has none."""
    splitter = ReasoningSplitter(in_reasoning)
    r1, c1 = splitter.feed(text)
    r2, c2 = splitter.finish()
    return (r1 + r2 if splitter.reasoned else None), c1 + c2
