"""One chat choice's output text read as the chat APIs answer it: reasoning (``--reasoning-parser``),
content and tool calls, whole or as it streams. Every chat-shaped door (chat completions, Responses,
Anthropic messages) reads its choices through this, so they all split a given output alike."""

from __future__ import annotations

from dataclasses import dataclass

from kvloom.frontends.reasoning import ReasoningSplitter, split_reasoning
from kvloom.frontends.tool_parsers import ToolCall, ToolPlan, make_parser


class ToolOutput:
    """One choice's tool calls: read from its text (auto, by the server's parser) or the forced JSON
    (required, named). ``feed`` returns the content that can be streamed now. With ``cut_calls`` a named
    call cut short (max_tokens) is still a call, with the raw text so far as its arguments (as vLLM
    returns it), never content."""

    def __init__(self, plan: ToolPlan, parser: str | None, cut_calls: bool = False) -> None:
        self.plan = plan
        self.parser = make_parser(parser) if plan.mode == "auto" else None
        self.text = ""
        self.named = ToolCall(plan.name, "") if plan.mode == "named" else None  # its id, fixed from the start
        self.cut_calls = cut_calls

    def feed(self, text: str) -> str:
        self.text += text
        return self.parser.feed(text) if self.parser is not None else ""

    def finish(self) -> tuple[str, list[ToolCall]]:
        """Content not streamed yet, and the calls."""
        if self.parser is not None:
            return self.parser.finish()
        try:
            return "", self.plan.forced_calls(self.text)
        except (ValueError, KeyError, TypeError):  # cut short by max_tokens: not a whole call
            if self.named is not None and self.cut_calls:
                return "", [ToolCall(self.named.name, self.text, self.named.id)]
            return self.text, []

    def parse(self, text: str) -> tuple[str | None, list[ToolCall]]:
        if self.parser is not None:
            return self.parser.parse(text)
        self.text = text
        rest, calls = self.finish()
        return (rest or None) if calls else text, calls

    def finish_reason(self, reason: str | None, calls: list[ToolCall]) -> str | None:
        # OpenAI ends a call the model chose (auto, required) with "tool_calls", a named one with "stop".
        return "tool_calls" if calls and reason == "stop" and self.plan.mode != "named" else reason


@dataclass
class ChatReading:
    """How a chat request's outputs are read: its tools (None: no tool parsing), the server's tool-call
    parser, and whether reasoning is split off (``reasoning``) with the first token already inside it."""

    tools: ToolPlan | None = None
    tool_parser: str | None = None
    reasoning: bool = False
    in_reasoning: bool = False
    show_reasoning: bool = True  # False (include_reasoning=false): split off, then left out
    # Chat completions (as vLLM): a named call cut short by max_tokens is a call with the text so far as
    # its arguments. The other APIs keep such text as content: their call blocks need whole arguments.
    cut_calls: bool = False

    def tool_output(self) -> ToolOutput | None:
        tools = self.tools
        if tools is None or tools.mode == "none":
            return None
        return ToolOutput(tools, self.tool_parser, self.cut_calls)

    def whole(self, text: str) -> tuple[str | None, str | None, list[ToolCall]]:
        """A whole output as (reasoning, content, tool calls); reasoning None when there is none, content
        None when a call or the reasoning took it all."""
        reasoning, content = split_reasoning(text, self.in_reasoning) if self.reasoning else (None, text)
        calls: list[ToolCall] = []
        out = self.tool_output()
        if out is not None:
            content, calls = out.parse(content)
        if reasoning is not None and not content:
            content = None
        return reasoning if self.show_reasoning else None, content, calls

    def finish_reason(self, reason: str | None, calls: list[ToolCall]) -> str | None:
        out = self.tool_output()
        return out.finish_reason(reason, calls) if out is not None else reason

    def stream(self) -> "ChoiceStream":
        return ChoiceStream(self)


class ChoiceStream:
    """One choice's text pieces in, ``(reasoning, content)`` that can be shown now out; ``finish`` gives
    what was held back and the tool calls."""

    def __init__(self, reading: ChatReading) -> None:
        self.reading = reading
        self.splitter = ReasoningSplitter(reading.in_reasoning) if reading.reasoning else None
        self.tools = reading.tool_output()
        self.named = self.tools.named if self.tools is not None else None
        self._arguments_shown = 0

    def feed(self, text: str) -> tuple[str, str]:
        reasoning, content = self.splitter.feed(text) if self.splitter is not None else ("", text)
        return self._shown(reasoning), self.tools.feed(content) if self.tools is not None else content

    def finish(self) -> tuple[str, str, list[ToolCall]]:
        reasoning, content = self.splitter.finish() if self.splitter is not None else ("", "")
        reasoning = self._shown(reasoning)
        if self.tools is None:
            return reasoning, content, []
        shown = self.tools.feed(content)
        rest, calls = self.tools.finish()
        return reasoning, shown + rest, calls

    def finish_reason(self, reason: str | None, calls: list[ToolCall]) -> str | None:
        return self.tools.finish_reason(reason, calls) if self.tools is not None else reason

    def new_arguments(self) -> str:
        """A named call's arguments (the whole output) that came since the last ask: a stream can show
        them as they come, since the call's name is known from the start."""
        text = self.tools.text
        new, self._arguments_shown = text[self._arguments_shown:], len(text)
        return new

    def _shown(self, reasoning: str) -> str:
        return reasoning if self.reading.show_reasoning else ""
