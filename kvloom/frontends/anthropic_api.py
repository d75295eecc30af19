"""Anthropic's Messages API (``POST /v1/messages``, ``/v1/messages/count_tokens``) as a translator over
the chat pipeline: a request becomes a chat request (system, text, tool_use and tool_result blocks,
tools), its output comes back as content blocks or Anthropic's stream events, errors in its shape."""

from __future__ import annotations

import json
import uuid
from typing import TYPE_CHECKING, Annotated, Any

import msgspec
from msgspec import Meta, Struct
from starlette.requests import Request
from starlette.responses import Response

from kvloom.frontends import openai_protocol as api
from kvloom.frontends.asgi import json_response
from kvloom.frontends.chat_output import ChatReading
from kvloom.frontends.errors import RequestError
from kvloom.frontends.openai_responses import UsageCounter
from kvloom.frontends.output import TextDelta
from kvloom.frontends.request_fields import ANTHROPIC_RULES
from kvloom.frontends.tool_parsers import ToolCall, template_messages_tool_calls
from kvloom.frontends.validation import MAX_STOP_STRINGS

if TYPE_CHECKING:
    from kvloom.frontends.api_server import OpenAIServer

API = "Anthropic's Messages"
ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
               404: "not_found_error", 408: "timeout_error", 413: "request_too_large", 429: "rate_limit_error",
               503: "overloaded_error"}


class MessageIn(Struct, kw_only=True):
    role: str
    content: str | list[dict[str, Any]]


class CountTokensRequest(Struct, kw_only=True):
    """What decides a prompt's tokens: ``/v1/messages/count_tokens`` takes this much."""

    model: str | None = None
    messages: Annotated[list[MessageIn], Meta(min_length=1)]
    system: str | list[dict[str, Any]] | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: dict[str, Any] | None = None
    thinking: dict[str, Any] | None = None
    output_config: dict[str, Any] | None = None
    chat_template_kwargs: dict[str, Any] | None = None  # vLLM's extension, as on chat completions


class MessagesRequest(CountTokensRequest, kw_only=True):
    max_tokens: Annotated[int, Meta(ge=1)]
    stop_sequences: Annotated[list[str], Meta(max_length=MAX_STOP_STRINGS)] | None = None
    stream: bool = False
    temperature: Annotated[float, Meta(ge=0.0, le=1.0)] | None = None
    top_p: Annotated[float, Meta(gt=0.0, le=1.0)] | None = None
    top_k: Annotated[int, Meta(ge=0)] | None = None
    metadata: dict[str, Any] | None = None
    service_tier: str | None = None
    # kvloom's admission extensions, as on the OpenAI routes
    priority: int = 0
    timeout: float | None = None


# --- request -> chat --------------------------------------------------------------------------------
def _text_of(blocks: str | list[Any] | None, where: str) -> str:
    """The text of a string or a list of text blocks (a system prompt, a tool result)."""
    if blocks is None or isinstance(blocks, str):
        return blocks or ""
    if not isinstance(blocks, list):
        raise RequestError(400, f"{where} must be a string or a list of text blocks", where)
    out = []
    for i, block in enumerate(blocks):
        kind = block.get("type") if isinstance(block, dict) else None
        if kind != "text" or not isinstance(block.get("text"), str):
            raise RequestError(400, f"{where}[{i}]: block type {kind!r} is not supported here (only 'text' "
                               "blocks with a 'text' string)", f"{where}[{i}]")
        out.append(block["text"])
    return "".join(out)


def _block(block: Any, where: str, kinds: tuple[str, ...]) -> tuple[str, dict[str, Any]]:
    kind = block.get("type") if isinstance(block, dict) else None
    if kind not in kinds:
        raise RequestError(400, f"{where}: content block type {kind!r} is not supported in this message (kvloom "
                           f"takes {', '.join(kinds)})", where)
    return kind, block


def _field(block: dict[str, Any], name: str, typ: type, where: str) -> Any:
    value = block.get(name)
    if not isinstance(value, typ):
        raise RequestError(400, f"{where}.{name} must be a {typ.__name__}", f"{where}.{name}")
    return value


def _assistant(blocks: list[Any], i: int) -> dict[str, Any]:
    text, calls, thinking = [], [], None
    for j, raw in enumerate(blocks):
        where = f"messages[{i}].content[{j}]"
        kind, block = _block(raw, where, ("text", "tool_use", "thinking"))
        if kind == "text":
            text.append(_field(block, "text", str, where))
        elif kind == "thinking":
            thinking = (thinking or "") + _field(block, "thinking", str, where)
        else:
            calls.append({"id": _field(block, "id", str, where), "type": "function", "function": {
                "name": _field(block, "name", str, where), "arguments": _field(block, "input", dict, where)}})
    message: dict[str, Any] = {"role": "assistant", "content": "".join(text)}
    if calls:
        message["tool_calls"] = template_messages_tool_calls(calls, i)
    if thinking is not None:
        message["reasoning_content"] = thinking
    return message


def _user(blocks: list[Any], i: int) -> list[dict[str, Any]]:
    """A user turn: its tool results become tool messages, its text a user message, in their order."""
    out: list[dict[str, Any]] = []
    text: list[str] = []
    for j, raw in enumerate(blocks):
        where = f"messages[{i}].content[{j}]"
        kind, block = _block(raw, where, ("text", "tool_result"))
        if kind == "text":
            text.append(_field(block, "text", str, where))
            continue
        if text:
            out.append({"role": "user", "content": "".join(text)})
            text = []
        result = _text_of(block.get("content"), f"{where}.content")
        if block.get("is_error"):
            result = f"Error: {result}"  # the chat templates have no error flag: the model reads it here
        out.append({"role": "tool", "tool_call_id": _field(block, "tool_use_id", str, where), "content": result})
    if text or not out:
        out.append({"role": "user", "content": "".join(text)})
    return out


def chat_messages(req: CountTokensRequest) -> list[dict[str, Any]]:
    """The conversation as chat templates read it."""
    messages: list[dict[str, Any]] = []
    if req.system:
        messages.append({"role": "system", "content": _text_of(req.system, "system")})
    for i, m in enumerate(req.messages):
        blocks = [{"type": "text", "text": m.content}] if isinstance(m.content, str) else m.content
        if m.role == "assistant":
            messages.append(_assistant(blocks, i))
        elif m.role == "user":
            messages.extend(_user(blocks, i))
        elif m.role == "system":  # not Anthropic's, but vLLM takes it: a system message where it stands
            messages.append({"role": "system", "content": _text_of(m.content, f"messages[{i}].content")})
        else:
            raise RequestError(400, f"messages[{i}].role={m.role!r} must be 'user' or 'assistant' (the system "
                               "prompt goes in 'system')", f"messages[{i}].role")
    return messages


def chat_tools(req: CountTokensRequest) -> tuple[list[dict[str, Any]] | None, Any, bool | None]:
    """``tools``, ``tool_choice`` and ``parallel_tool_calls`` of the equivalent chat request."""
    tools = None
    if req.tools:
        tools = []
        for i, tool in enumerate(req.tools):
            if not isinstance(tool, dict) or tool.get("type", "custom") != "custom":
                kind = tool.get("type") if isinstance(tool, dict) else None
                raise RequestError(400, f"tools[{i}].type={kind!r}: only client tools (a name and an input_schema) "
                                   "are supported, not Anthropic's server tools", f"tools[{i}].type")
            schema = tool.get("input_schema")
            if not isinstance(schema, dict):
                raise RequestError(400, f"tools[{i}].input_schema must be a JSON Schema object",
                                   f"tools[{i}].input_schema")
            function = {"name": tool.get("name"), "parameters": schema}
            if tool.get("description") is not None:
                function["description"] = tool["description"]
            tools.append({"type": "function", "function": function})
    choice, parallel = req.tool_choice, None
    if choice is None:
        return tools, None, None
    kind = choice.get("type")
    if choice.get("disable_parallel_tool_use"):
        parallel = False
    if kind == "auto":
        return tools, "auto", parallel
    if kind == "any":
        return tools, "required", parallel
    if kind == "none":
        return tools, "none", parallel
    if kind == "tool":
        return tools, {"type": "function", "function": {"name": choice.get("name")}}, parallel
    raise RequestError(400, f"tool_choice.type={kind!r} must be 'auto', 'any', 'tool' or 'none'", "tool_choice.type")


def template_kwargs(req: CountTokensRequest) -> tuple[dict[str, Any] | None, bool]:
    """The chat template's kwargs: ``chat_template_kwargs`` with ``thinking`` as the templates of thinking
    models take it (``enable_thinking``); and whether the thinking is shown (``display``)."""
    thinking, kwargs = req.thinking, req.chat_template_kwargs
    if thinking is None:
        return kwargs, True
    kind = thinking.get("type")
    if kind not in ("enabled", "adaptive", "disabled"):
        raise RequestError(400, f"thinking.type={kind!r} must be 'enabled', 'adaptive' or 'disabled'",
                           "thinking.type")
    if thinking.get("budget_tokens") is not None:
        raise RequestError(400, "thinking.budget_tokens is not supported: kvloom bounds thinking only by "
                           "max_tokens; send thinking {'type': 'adaptive'}", "thinking.budget_tokens")
    display = thinking.get("display")
    if display not in (None, "summarized", "omitted"):
        raise RequestError(400, f"thinking.display={display!r} must be 'summarized' or 'omitted'",
                           "thinking.display")
    return {**(kwargs or {}), "enable_thinking": kind != "disabled"}, display != "omitted"


def response_format(req: CountTokensRequest) -> dict[str, Any] | None:
    """``output_config.format`` (structured outputs) as chat's response_format."""
    config = req.output_config or {}
    unknown = sorted(set(config) - {"format", "effort"})
    if unknown:
        raise RequestError(400, f"unknown field 'output_config.{unknown[0]}'", f"output_config.{unknown[0]}")
    if config.get("effort") is not None:
        raise RequestError(400, "output_config.effort is not supported", "output_config.effort")
    fmt = config.get("format")
    if fmt is None:
        return None
    if not isinstance(fmt, dict) or fmt.get("type") != "json_schema" or not isinstance(fmt.get("schema"), dict):
        raise RequestError(400, "output_config.format must be {'type': 'json_schema', 'schema': {...}}",
                           "output_config.format")
    return {"type": "json_schema", "json_schema": {"name": "output", "schema": fmt["schema"], "strict": True}}


def chat_request(req: CountTokensRequest) -> api.ChatCompletionRequest:
    """The chat request that ``req`` is (its messages come from ``chat_messages``)."""
    tools, tool_choice, parallel = chat_tools(req)
    kwargs, show_thinking = template_kwargs(req)
    common = dict(model=req.model, messages=[], tools=tools, tool_choice=tool_choice, chat_template_kwargs=kwargs,
                  response_format=response_format(req), include_reasoning=show_thinking)
    if not isinstance(req, MessagesRequest):
        return api.ChatCompletionRequest(**common)
    user = (req.metadata or {}).get("user_id")
    return api.ChatCompletionRequest(
        **common, max_tokens=req.max_tokens, temperature=req.temperature, top_p=req.top_p, top_k=req.top_k or 0,
        stop=req.stop_sequences, stream=req.stream, parallel_tool_calls=parallel,
        user=user if isinstance(user, str) else None, priority=req.priority, timeout=req.timeout)


# --- chat output -> Anthropic ----------------------------------------------------------------------
def error_response(status: int, message: str, param: str | None = None,
                   headers: dict[str, str] | None = None) -> Response:
    return json_response(_error(status, message), status, headers)


def _error(status: int, message: str) -> dict[str, Any]:
    return {"type": "error", "error": {"type": ERROR_TYPES.get(status, "api_error"), "message": message}}


def stop_reason(delta: TextDelta, calls: list[ToolCall]) -> tuple[str, str | None]:
    """Anthropic's ``stop_reason`` and ``stop_sequence`` for how a completion ended."""
    if calls:
        return "tool_use", None
    if delta.finish_reason == "length":
        return "max_tokens", None
    if isinstance(delta.stop_reason, str):
        return "stop_sequence", delta.stop_reason
    return "end_turn", None


def usage(counter: UsageCounter) -> dict[str, int]:
    # Anthropic counts prefix-cache reads apart from input_tokens (their sum is the prompt).
    info = counter.info()
    cached = info.prompt_tokens_details.cached_tokens if info.prompt_tokens_details else 0
    return {"input_tokens": info.prompt_tokens - cached, "output_tokens": info.completion_tokens,
            "cache_read_input_tokens": cached, "cache_creation_input_tokens": 0}


def _tool_use(call: ToolCall, input: dict[str, Any]) -> dict[str, Any]:
    return {"type": "tool_use", "id": "toolu_" + call.id.removeprefix("call_"), "name": call.name, "input": input}


def _message(mid: str, model: str, content: list[dict[str, Any]], reason: str | None, sequence: str | None,
             counts: dict[str, int]) -> dict[str, Any]:
    return {"id": mid, "type": "message", "role": "assistant", "model": model, "content": content,
            "stop_reason": reason, "stop_sequence": sequence, "usage": counts}


async def collect(mid: str, model: str, merged, counter: UsageCounter, reading: ChatReading) -> dict[str, Any]:
    text, final = "", None
    async for index, delta in merged:
        text += delta.text
        if delta.finish_reason is not None:
            final = delta
            counter.add(index, delta)
    reasoning, content, calls = reading.whole(text)
    blocks: list[dict[str, Any]] = []
    if reasoning is not None:
        blocks.append({"type": "thinking", "thinking": reasoning, "signature": ""})
    if content:
        blocks.append({"type": "text", "text": content})
    blocks += [_tool_use(c, json.loads(c.arguments)) for c in calls]
    reason, sequence = stop_reason(final, calls)
    return _message(mid, model, blocks, reason, sequence, usage(counter))


def _event(kind: str, body: dict[str, Any]) -> str:
    return f"event: {kind}\ndata: {msgspec.json.encode({'type': kind, **body}).decode()}\n\n"


async def events(mid: str, model: str, merged, counter: UsageCounter, reading: ChatReading):
    """Anthropic's stream: message_start, ping, each content block (start, deltas, stop), message_delta
    with the stop reason and usage, message_stop; an engine failure mid-stream is an error event."""
    out = reading.stream()
    open_kind: str | None = None  # the content block being streamed: thinking or text
    index = -1

    def switch(kind: str):
        nonlocal open_kind, index
        if open_kind is not None:
            yield _event("content_block_stop", {"index": index})
        index += 1
        open_kind = kind
        block = {"type": "thinking", "thinking": "", "signature": ""} if kind == "thinking" else \
            {"type": "text", "text": ""}
        yield _event("content_block_start", {"index": index, "content_block": block})

    def pieces(reasoning: str, content: str):
        if reasoning:
            if open_kind != "thinking":
                yield from switch("thinking")
            yield _event("content_block_delta", {"index": index, "delta": {"type": "thinking_delta",
                                                                           "thinking": reasoning}})
        if content:
            if open_kind != "text":
                yield from switch("text")
            yield _event("content_block_delta", {"index": index, "delta": {"type": "text_delta", "text": content}})

    try:
        yield _event("message_start", {"message": _message(mid, model, [], None, None, {**usage(counter)})})
        yield _event("ping", {})
        async for i, delta in merged:
            reasoning, content = out.feed(delta.text)
            for event in pieces(reasoning, content):
                yield event
            if delta.finish_reason is None:
                continue
            counter.add(i, delta)
            reasoning, content, calls = out.finish()
            for event in pieces(reasoning, content):
                yield event
            if open_kind is not None:
                yield _event("content_block_stop", {"index": index})
            for call in calls:
                index += 1
                yield _event("content_block_start", {"index": index, "content_block": _tool_use(call, {})})
                yield _event("content_block_delta", {"index": index, "delta": {"type": "input_json_delta",
                                                                               "partial_json": call.arguments}})
                yield _event("content_block_stop", {"index": index})
            reason, sequence = stop_reason(delta, calls)
            yield _event("message_delta", {"delta": {"stop_reason": reason, "stop_sequence": sequence},
                                           "usage": usage(counter)})
        yield _event("message_stop", {})
    except RequestError as e:
        yield _event("error", {"error": _error(e.status, e.message)["error"]})


# --- routes ----------------------------------------------------------------------------------------
async def _parse(server: "OpenAIServer", request: Request, typ: type):
    req = await server._parse(request, typ, ANTHROPIC_RULES, API)
    await server.note_request(request, req.model, getattr(req, "timeout", None))
    return req


async def messages(server: "OpenAIServer", request: Request):
    req: MessagesRequest = await _parse(server, request, MessagesRequest)
    chat = chat_request(req)
    plan = await server.plan_chat(chat, chat_messages(req))
    mid = f"msg_{uuid.uuid4().hex}"
    model = plan.builder.model_name  # a LoRA adapter's name where the request named one
    return await server.respond(request, plan, req.stream, server._request_id(request, "msg"),
                                lambda merged: collect(mid, model, merged, plan.usage, plan.reading),
                                lambda merged: events(mid, model, merged, plan.usage, plan.reading))


async def count_tokens(server: "OpenAIServer", request: Request):
    req: CountTokensRequest = await _parse(server, request, CountTokensRequest)
    chat = chat_request(req)
    if chat.tools and chat.tool_choice is None:
        chat.tool_choice = "none"  # counting renders the tools alike, and needs no auto tool choice
    *_, ids = await server.render_chat(chat, chat_messages(req))
    return json_response({"input_tokens": len(ids)})


def routes(server: "OpenAIServer") -> list:
    async def messages_endpoint(request: Request):
        return await messages(server, request)

    async def count_tokens_endpoint(request: Request):
        return await count_tokens(server, request)

    return [server.route("/v1/messages", messages_endpoint, ["POST"], errors=error_response),
            server.route("/v1/messages/count_tokens", count_tokens_endpoint, ["POST"], errors=error_response)]
