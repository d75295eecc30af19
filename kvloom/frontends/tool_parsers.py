"""Tool calling in the chat API: the ``tools``/``tool_choice`` rules, the JSON Schemas that force a
required or named call through the structured-output engine, and the parsers that turn a model's
text into OpenAI ``tool_calls`` (Hermes/Qwen ``<tool_call>`` blocks, Llama-3 JSON), whole or as a
stream of deltas."""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass, field
from typing import Any

from kvloom.frontends.errors import RequestError

TOOL_CALL_PARSERS = ("hermes", "llama3_json")


@dataclass
class ToolCall:
    name: str
    arguments: str  # JSON text, as OpenAI sends it
    id: str = field(default_factory=lambda: f"call_{uuid.uuid4().hex[:24]}")


@dataclass
class ToolPlan:
    """What a chat request does with its tools: ``mode`` is none, auto, required or named."""

    mode: str
    tools: list[dict[str, Any]]
    name: str | None = None  # the forced function (named)
    parallel: bool = True

    @property
    def schema(self) -> dict[str, Any] | None:
        """The JSON Schema the output must follow (required/named), else None."""
        if self.mode == "named":
            return _parameters(next(t for t in self.tools if t["function"]["name"] == self.name))
        if self.mode == "required":
            calls = [{"type": "object", "properties": {"name": {"const": t["function"]["name"]},
                                                       "parameters": _parameters(t)},
                      "required": ["name", "parameters"], "additionalProperties": False} for t in self.tools]
            schema: dict[str, Any] = {"type": "array", "minItems": 1, "items": {"anyOf": calls}}
            if not self.parallel:
                schema["maxItems"] = 1
            return schema
        return None

    def forced_calls(self, text: str) -> list[ToolCall]:
        """The calls in a required/named output (which the grammar made valid JSON)."""
        if self.mode == "named":
            return [ToolCall(self.name, json.dumps(json.loads(text), ensure_ascii=False))]
        return [ToolCall(c["name"], json.dumps(c["parameters"], ensure_ascii=False)) for c in json.loads(text)]


def _parameters(tool: dict[str, Any]) -> dict[str, Any]:
    return tool["function"].get("parameters") or {"type": "object", "properties": {}}


def plan_tools(tools: list[Any] | None, tool_choice: Any, parallel_tool_calls: bool | None,
               parser: str | None, auto_enabled: bool) -> ToolPlan | None:
    """Check ``tools`` and ``tool_choice`` as OpenAI defines them; None when the request has no tools."""
    if tool_choice is not None and not tools and tool_choice != "none":
        raise RequestError(400, "tool_choice needs tools", "tool_choice")
    if not tools:
        return None
    for i, tool in enumerate(tools):
        fn = tool.get("function") if isinstance(tool, dict) else None
        if not isinstance(tool, dict) or tool.get("type", "function") != "function" or not isinstance(fn, dict):
            raise RequestError(400, f"tools[{i}] must be {{'type': 'function', 'function': {{...}}}}", f"tools[{i}]")
        if not isinstance(fn.get("name"), str) or not re.fullmatch(r"[A-Za-z0-9_.\-]{1,64}", fn["name"]):
            raise RequestError(400, f"tools[{i}].function.name must be 1-64 letters, digits, '_', '.' or '-'",
                               f"tools[{i}].function.name")
        params = fn.get("parameters")
        if params is not None and not isinstance(params, dict):
            raise RequestError(400, f"tools[{i}].function.parameters must be a JSON Schema object",
                               f"tools[{i}].function.parameters")
    names = [t["function"]["name"] for t in tools]
    parallel = parallel_tool_calls is not False
    choice = "auto" if tool_choice is None else tool_choice
    if choice == "none":
        return ToolPlan("none", tools, parallel=parallel)
    if choice == "auto":
        if not auto_enabled or parser is None:
            raise RequestError(400, "tool_choice='auto' needs the server started with --enable-auto-tool-choice "
                               "and --tool-call-parser (hermes or llama3_json); use tool_choice='required' or a "
                               "named function to force a call without them", "tool_choice")
        return ToolPlan("auto", tools, parallel=parallel)
    if choice == "required":
        return ToolPlan("required", tools, parallel=parallel)
    if isinstance(choice, dict) and choice.get("type") == "function" and isinstance(choice.get("function"), dict):
        name = choice["function"].get("name")
        if name not in names:
            raise RequestError(400, f"tool_choice names function {name!r}, which is not among tools {names}",
                               "tool_choice")
        return ToolPlan("named", tools, name=name, parallel=parallel)
    raise RequestError(400, "tool_choice must be 'none', 'auto', 'required' or "
                       "{'type': 'function', 'function': {'name': ...}}", "tool_choice")


# --- parsers of free (auto) output -----------------------------------------------------------------
class ToolParser:
    """Finds tool calls in a model's text. ``parse`` takes the whole output; ``feed`` takes it piece by
    piece and returns the content that is surely not part of a call, holding the rest back."""

    start: str = ""

    def __init__(self) -> None:
        self.text = ""
        self._sent = 0  # characters of text already returned as content
        self._in_call = False

    def parse(self, text: str) -> tuple[str | None, list[ToolCall]]:
        raise NotImplementedError

    def feed(self, delta: str) -> str:
        self.text += delta
        if self._in_call:
            return ""
        at = self.text.find(self.start, self._sent)
        if at >= 0:
            self._in_call, end = True, at
        else:  # hold back a tail that may be the start of the marker
            end = len(self.text)
            for k in range(min(len(self.start) - 1, len(self.text) - self._sent), 0, -1):
                if self.start.startswith(self.text[-k:]):
                    end -= k
                    break
        out = self.text[self._sent:end]
        self._sent = end
        return out

    def finish(self) -> tuple[str, list[ToolCall]]:
        """The content not yet returned and the calls, once the output is complete."""
        _, calls = self.parse(self.text)
        rest = "" if calls else self.text[self._sent:]
        self._sent = len(self.text)
        return rest, calls


class HermesToolParser(ToolParser):
    """Hermes and Qwen 2.5/3: ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>`` blocks after
    any content."""

    start = "<tool_call>"
    _BLOCK = re.compile(r"<tool_call>\s*(.*?)\s*(?:</tool_call>|$)", re.DOTALL)

    def parse(self, text: str) -> tuple[str | None, list[ToolCall]]:
        if self.start not in text:
            return text, []
        calls = []
        for body in self._BLOCK.findall(text):
            try:
                obj = json.loads(body)
            except ValueError:
                return text, []  # not a well-formed call: the text is the answer
            if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
                return text, []
            calls.append(ToolCall(obj["name"], json.dumps(obj.get("arguments", {}), ensure_ascii=False)))
        content = text[: text.index(self.start)].rstrip()
        return content or None, calls


class Llama3JsonToolParser(ToolParser):
    """Llama 3.x JSON calls: the output is ``{"name": ..., "parameters": {...}}`` (optionally after
    ``<|python_tag|>``, several separated by ``;``)."""

    start = "{"

    def feed(self, delta: str) -> str:
        # A call is the whole output, so nothing streams as content until the output is surely not one.
        self.text += delta
        if self._sent == 0:
            head = self.text.lstrip()
            if not head or "<|python_tag|>".startswith(head) or head.removeprefix("<|python_tag|>").lstrip()[:1] in ("", "{"):
                return ""
        out = self.text[self._sent:]
        self._sent = len(self.text)
        return out

    def parse(self, text: str) -> tuple[str | None, list[ToolCall]]:
        body = text.strip().removeprefix("<|python_tag|>").strip()
        if not body.startswith("{"):
            return text, []
        decoder = json.JSONDecoder()
        calls, i = [], 0
        while i < len(body):
            try:
                obj, end = decoder.raw_decode(body, i)
            except ValueError:
                return text, []
            if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
                return text, []
            args = obj.get("parameters", obj.get("arguments", {}))
            calls.append(ToolCall(obj["name"], json.dumps(args, ensure_ascii=False)))
            i = end
            while i < len(body) and body[i] in " \t\r\n;":
                i += 1
        return None, calls


def make_parser(name: str) -> ToolParser:
    if name == "hermes":
        return HermesToolParser()
    if name == "llama3_json":
        return Llama3JsonToolParser()
    raise ValueError(f"tool_call_parser={name!r} must be one of {list(TOOL_CALL_PARSERS)}")


def template_messages_tool_calls(tool_calls: list[dict[str, Any]], index: int) -> list[dict[str, Any]]:
    """An assistant message's ``tool_calls`` as chat templates read them: arguments as objects (Hermes,
    Qwen and Llama templates apply ``tojson`` to them), not JSON text."""
    out = []
    for j, call in enumerate(tool_calls):
        fn = call.get("function") if isinstance(call, dict) else None
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
            raise RequestError(400, f"messages[{index}].tool_calls[{j}] needs function.name",
                               f"messages[{index}].tool_calls")
        args = fn.get("arguments", "{}")
        if isinstance(args, str):
            try:
                args = json.loads(args) if args.strip() else {}
            except ValueError:
                raise RequestError(400, f"messages[{index}].tool_calls[{j}].function.arguments is not JSON",
                                   f"messages[{index}].tool_calls") from None
        out.append({"id": call.get("id"), "type": "function", "function": {"name": fn["name"], "arguments": args}})
    return out
