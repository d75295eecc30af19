"""OpenAI's Responses API (``POST /v1/responses``, ``GET``/``DELETE /v1/responses/{id}``) as a translator
over the chat pipeline: ``input`` items and ``instructions`` become a chat (after the stored conversation
of ``previous_response_id``), the output comes back as reasoning, message and function_call items, whole
or as the typed event stream the ``openai`` client parses."""

from __future__ import annotations

import itertools
import time
import uuid
from typing import TYPE_CHECKING, Annotated, Any

import msgspec
from msgspec import Meta, Struct
from starlette.requests import Request
from starlette.responses import Response

from kvloom.frontends import openai_protocol as api
from kvloom.frontends.asgi import ERROR_TYPES, json_response
from kvloom.frontends.errors import RequestError
from kvloom.frontends.output import TextDelta
from kvloom.frontends.request_fields import RESPONSES_RULES
from kvloom.frontends.responses_store import StoredResponse
from kvloom.frontends.tool_parsers import ToolCall, template_messages_tool_calls

if TYPE_CHECKING:
    from kvloom.frontends.api_server import ChatPlan, OpenAIServer

API = "OpenAI's or vLLM's Responses"


class ResponsesRequest(Struct, kw_only=True):
    model: str | None = None
    input: str | list[dict[str, Any]]
    instructions: str | None = None
    max_output_tokens: Annotated[int, Meta(ge=1)] | None = None
    temperature: float | None = None  # sampling values are checked by the one validation (validation.py)
    top_p: float | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    text: dict[str, Any] | None = None
    stream: bool = False
    store: bool = True
    previous_response_id: str | None = None
    metadata: dict[str, str] | None = None
    user: str | None = None
    # vLLM's sampling extensions, as on chat completions
    top_k: int = 0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    seed: int | None = None
    stop: str | list[str] | None = None
    structured_outputs: dict[str, Any] | None = None  # vLLM's constraints (regex, choice, grammar, json)
    chat_template_kwargs: dict[str, Any] | None = None
    priority: int = 0
    timeout: float | None = None


# --- request -> chat --------------------------------------------------------------------------------
def _text(content: Any, where: str, kinds: tuple[str, ...]) -> str:
    """A string, or the text of a list of text parts of ``kinds``."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise RequestError(400, f"{where} must be a string or a list of content parts", where)
    out = []
    for j, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind not in kinds or not isinstance(part.get("text"), str):
            raise RequestError(400, f"{where}[{j}]: content part type {kind!r} is not supported (kvloom takes "
                               f"{', '.join(kinds)} parts with a 'text' string)", f"{where}[{j}]")
        out.append(part["text"])
    return "".join(out)


def _string(item: dict[str, Any], name: str, where: str) -> str:
    value = item.get(name)
    if not isinstance(value, str):
        raise RequestError(400, f"{where}.{name} must be a string", f"{where}.{name}")
    return value


def input_messages(items: str | list[dict[str, Any]]) -> list[dict[str, Any]]:
    """``input`` as chat messages: messages, function calls (joined to the assistant turn before them),
    their outputs (tool messages) and reasoning items (the next assistant turn's reasoning_content)."""
    if isinstance(items, str):
        return [{"role": "user", "content": items}]
    out: list[dict[str, Any]] = []
    reasoning: str | None = None

    def assistant(content: str) -> dict[str, Any]:
        nonlocal reasoning
        message: dict[str, Any] = {"role": "assistant", "content": content}
        if reasoning is not None:
            message["reasoning_content"], reasoning = reasoning, None
        out.append(message)
        return message

    for i, item in enumerate(items):
        where = f"input[{i}]"
        if not isinstance(item, dict):
            raise RequestError(400, f"{where} must be an object (a message or an item)", where)
        kind = item.get("type", "message")
        if kind == "message":
            role = item.get("role")
            if role not in ("user", "assistant", "system", "developer"):
                raise RequestError(400, f"{where}.role={role!r} must be 'user', 'assistant', 'system' or "
                                   "'developer'", f"{where}.role")
            text = _text(item.get("content"), f"{where}.content", ("input_text", "output_text", "text"))
            if role == "assistant":
                assistant(text)
            else:
                out.append({"role": "system" if role == "developer" else role, "content": text})
        elif kind == "function_call":
            call = {"id": _string(item, "call_id", where), "type": "function",
                    "function": {"name": _string(item, "name", where),
                                 "arguments": _string(item, "arguments", where)}}
            last = out[-1] if out and out[-1]["role"] == "assistant" and reasoning is None else assistant("")
            last.setdefault("tool_calls", []).extend(template_messages_tool_calls([call], i))
        elif kind == "function_call_output":
            out.append({"role": "tool", "tool_call_id": _string(item, "call_id", where),
                        "content": _text(item.get("output"), f"{where}.output", ("input_text", "output_text"))})
        elif kind == "reasoning":
            parts = item.get("content") or item.get("summary") or []
            reasoning = (reasoning or "") + _text(parts, f"{where}.content", ("reasoning_text", "summary_text"))
        else:
            raise RequestError(400, f"{where}.type={kind!r} is not supported (kvloom takes message, function_call, "
                               "function_call_output and reasoning items)", f"{where}.type")
    return out


def chat_tools(req: ResponsesRequest) -> tuple[list[dict[str, Any]] | None, Any]:
    tools = None
    if req.tools:
        tools = []
        for i, tool in enumerate(req.tools):
            kind = tool.get("type") if isinstance(tool, dict) else None
            if kind != "function":
                raise RequestError(400, f"tools[{i}].type={kind!r}: only function tools are supported (no hosted "
                                   "tools)", f"tools[{i}].type")
            function = {k: tool[k] for k in ("name", "description", "parameters") if tool.get(k) is not None}
            tools.append({"type": "function", "function": function})
    choice = req.tool_choice
    if isinstance(choice, dict):
        if choice.get("type") != "function":
            raise RequestError(400, f"tool_choice.type={choice.get('type')!r}: only a function ({{'type': "
                               "'function', 'name': ...}) can be forced", "tool_choice.type")
        choice = {"type": "function", "function": {"name": choice.get("name")}}
    return tools, choice


def response_format(text: dict[str, Any] | None) -> dict[str, Any] | None:
    """``text.format`` as chat's response_format (the structured-output engine forces it)."""
    text = text or {}
    unknown = sorted(set(text) - {"format", "verbosity"})
    if unknown:
        raise RequestError(400, f"unknown field 'text.{unknown[0]}'", f"text.{unknown[0]}")
    if text.get("verbosity") is not None:
        raise RequestError(400, "'text.verbosity' is not supported", "text.verbosity")
    fmt = text.get("format")
    if fmt is None:
        return None
    kind = fmt.get("type") if isinstance(fmt, dict) else None
    if kind in ("text", "json_object"):
        return {"type": kind}
    if kind == "json_schema":
        if not isinstance(fmt.get("schema"), dict):
            raise RequestError(400, "text.format.schema must be a JSON Schema object", "text.format.schema")
        return {"type": "json_schema", "json_schema": {"name": fmt.get("name"), "schema": fmt["schema"],
                                                       "strict": fmt.get("strict")}}
    raise RequestError(400, f"text.format.type={kind!r} must be 'text', 'json_object' or 'json_schema'",
                       "text.format.type")


def chat_request(req: ResponsesRequest) -> api.ChatCompletionRequest:
    tools, tool_choice = chat_tools(req)
    return api.ChatCompletionRequest(
        model=req.model, messages=[], max_tokens=req.max_output_tokens, temperature=req.temperature,
        top_p=req.top_p, top_k=req.top_k, min_p=req.min_p, repetition_penalty=req.repetition_penalty,
        presence_penalty=req.presence_penalty, frequency_penalty=req.frequency_penalty, seed=req.seed,
        stop=req.stop, stream=req.stream, tools=tools, tool_choice=tool_choice,
        parallel_tool_calls=req.parallel_tool_calls, response_format=response_format(req.text),
        structured_outputs=req.structured_outputs, chat_template_kwargs=req.chat_template_kwargs, user=req.user,
        priority=req.priority, timeout=req.timeout)


# --- chat output -> Responses ----------------------------------------------------------------------
def _id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


class ResponseDraft:
    """What one response says about itself beside its output, and its output items as they are made."""

    def __init__(self, req: ResponsesRequest, plan: "ChatPlan") -> None:
        self.id = _id("resp")
        self.req = req
        self.plan = plan
        self.created_at = int(time.time())

    def body(self, status: str, output: list[dict[str, Any]], usage: dict[str, Any] | None = None) -> dict[str, Any]:
        req = self.req
        fmt = (req.text or {}).get("format") or {"type": "text"}
        return {
            "id": self.id, "object": "response", "created_at": self.created_at, "status": status,
            "background": False, "error": None,
            "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete" else None,
            "instructions": req.instructions, "max_output_tokens": req.max_output_tokens,
            "model": self.plan.builder.model_name, "output": output,
            "parallel_tool_calls": req.parallel_tool_calls is not False,
            "previous_response_id": req.previous_response_id, "reasoning": {"effort": None, "summary": None},
            "store": req.store, "temperature": req.temperature, "text": {"format": fmt},
            "tool_choice": req.tool_choice if req.tool_choice is not None else "auto", "tools": req.tools or [],
            "top_p": req.top_p, "truncation": "disabled", "usage": usage, "user": req.user,
            "metadata": req.metadata or {},
        }

    def usage(self, reasoning: str | None) -> dict[str, Any]:
        info = self.plan.usage.info()
        # Reasoning tokens: the reasoning text encoded again (the split can fall inside a token).
        thought = len(self.plan.core.tokenizer.encode(reasoning, add_special_tokens=False)) if reasoning else 0
        cached = info.prompt_tokens_details.cached_tokens if info.prompt_tokens_details else 0
        return {"input_tokens": info.prompt_tokens, "input_tokens_details": {"cached_tokens": cached},
                "output_tokens": info.completion_tokens, "output_tokens_details": {"reasoning_tokens": thought},
                "total_tokens": info.total_tokens}


def reasoning_item(text: str, status: str = "completed", rid: str | None = None) -> dict[str, Any]:
    content = [{"type": "reasoning_text", "text": text}] if status == "completed" else []
    return {"id": rid or _id("rs"), "type": "reasoning", "summary": [], "content": content, "status": status}


def text_part(text: str) -> dict[str, Any]:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}


def message_item(text: str | None, status: str, mid: str | None = None) -> dict[str, Any]:
    content = [text_part(text)] if text is not None else []
    return {"id": mid or _id("msg"), "type": "message", "role": "assistant", "status": status, "content": content}


def call_item(call: ToolCall, arguments: str, status: str, fid: str | None = None) -> dict[str, Any]:
    return {"id": fid or _id("fc"), "type": "function_call", "call_id": call.id, "name": call.name,
            "arguments": arguments, "status": status}


def _status(delta: TextDelta) -> str:
    return "incomplete" if delta.finish_reason == "length" else "completed"


def assistant_turn(reasoning: str | None, content: str | None, calls: list[ToolCall]) -> dict[str, Any]:
    """The output as the next request's chat reads it (previous_response_id)."""
    message: dict[str, Any] = {"role": "assistant", "content": content or ""}
    if calls:
        message["tool_calls"] = template_messages_tool_calls(
            [{"id": c.id, "function": {"name": c.name, "arguments": c.arguments}} for c in calls], 0)
    if reasoning is not None:
        message["reasoning_content"] = reasoning
    return message


async def _store(server: "OpenAIServer", request: Request, draft: ResponseDraft, body: dict[str, Any],
                 conversation: list[dict[str, Any]]) -> None:
    if draft.req.store:
        await server.response_store.put(draft.id, _owner(request), StoredResponse(
            msgspec.json.encode(body), msgspec.json.encode(conversation)))


async def collect(server: "OpenAIServer", request: Request, draft: ResponseDraft, merged,
                  conversation: list[dict[str, Any]]) -> dict[str, Any]:
    text, final = "", None
    async for index, delta in merged:
        text += delta.text
        if delta.finish_reason is not None:
            final = delta
            draft.plan.usage.add(index, delta)
    reasoning, content, calls = draft.plan.reading.whole(text)
    status = _status(final)
    output = [reasoning_item(reasoning)] if reasoning else []
    if content or not calls:  # a text answer always has its message, empty or not
        output.append(message_item(content or "", status))
    output += [call_item(c, c.arguments, "completed") for c in calls]
    body = draft.body(status, output, draft.usage(reasoning))
    await _store(server, request, draft, body, conversation + [assistant_turn(reasoning, content, calls)])
    return body


def events(server: "OpenAIServer", request: Request, draft: ResponseDraft, merged,
           conversation: list[dict[str, Any]]):
    """The typed stream: created, in_progress, per output item its added/delta/done events, then
    completed (or incomplete at max_output_tokens); an engine failure mid-stream is an error event."""
    seq = itertools.count()
    output: list[dict[str, Any]] = []
    out = draft.plan.reading.stream()
    opened: dict[str, Any] = {}  # the item being streamed: kind, id, text

    def event(kind: str, **body: Any) -> str:
        data = msgspec.json.encode({"type": kind, "sequence_number": next(seq), **body}).decode()
        return f"event: {kind}\ndata: {data}\n\n"

    def where() -> dict[str, Any]:
        return {"item_id": opened["id"], "output_index": len(output), "content_index": 0}

    def open_item(kind: str):
        yield from close_item("completed")
        opened.update(kind=kind, id=_id("rs" if kind == "reasoning" else "msg"), text="")
        if kind == "reasoning":
            item, part = reasoning_item("", "in_progress", opened["id"]), {"type": "reasoning_text", "text": ""}
        else:
            item, part = message_item(None, "in_progress", opened["id"]), text_part("")
        yield event("response.output_item.added", output_index=len(output), item=item)
        yield event("response.content_part.added", **where(), part=part)

    def close_item(status: str):
        if not opened:
            return
        text = opened["text"]
        if opened["kind"] == "reasoning":
            part, item = {"type": "reasoning_text", "text": text}, reasoning_item(text, "completed", opened["id"])
            yield event("response.reasoning_text.done", **where(), text=text)
        else:
            part, item = text_part(text), message_item(text, status, opened["id"])
            yield event("response.output_text.done", **where(), text=text, logprobs=[])
        yield event("response.content_part.done", **where(), part=part)
        yield event("response.output_item.done", output_index=len(output), item=item)
        output.append(item)
        opened.clear()

    def pieces(reasoning: str, content: str):
        if reasoning:
            if opened.get("kind") != "reasoning":
                yield from open_item("reasoning")
            opened["text"] += reasoning
            yield event("response.reasoning_text.delta", **where(), delta=reasoning)
        if content:
            if opened.get("kind") != "message":
                yield from open_item("message")
            opened["text"] += content
            yield event("response.output_text.delta", **where(), delta=content, logprobs=[])

    async def stream():
        reasoning_text: str | None = "" if draft.plan.reading.reasoning else None
        try:
            yield event("response.created", response=draft.body("in_progress", []))
            yield event("response.in_progress", response=draft.body("in_progress", []))
            async for index, delta in merged:
                reasoning, content = out.feed(delta.text)
                for e in pieces(reasoning, content):
                    yield e
                if reasoning_text is not None:
                    reasoning_text += reasoning
                if delta.finish_reason is None:
                    continue
                draft.plan.usage.add(index, delta)
                status = _status(delta)
                reasoning, content, calls = out.finish()
                for e in pieces(reasoning, content):
                    yield e
                if reasoning_text is not None:
                    reasoning_text += reasoning
                if not calls and not any(item["type"] == "message" for item in output) \
                        and opened.get("kind") != "message":
                    for e in open_item("message"):  # a text answer always has its message, empty or not
                        yield e
                for e in close_item(status):
                    yield e
                for call in calls:
                    fid = _id("fc")
                    yield event("response.output_item.added", output_index=len(output),
                                item=call_item(call, "", "in_progress", fid))
                    at = {"item_id": fid, "output_index": len(output)}
                    yield event("response.function_call_arguments.delta", **at, delta=call.arguments)
                    yield event("response.function_call_arguments.done", **at, arguments=call.arguments)
                    item = call_item(call, call.arguments, "completed", fid)
                    yield event("response.output_item.done", output_index=len(output), item=item)
                    output.append(item)
                thought = reasoning_text if any(item["type"] == "reasoning" for item in output) else None
                message = next((item["content"][0]["text"] for item in output if item["type"] == "message"), None)
                body = draft.body(status, output, draft.usage(thought))
                await _store(server, request, draft, body, conversation + [assistant_turn(thought, message, calls)])
                yield event("response.completed" if status == "completed" else "response.incomplete", response=body)
        except RequestError as e:
            yield event("error", code=ERROR_TYPES.get(e.status, "server_error"), message=e.message, param=e.param)

    return stream()


# --- routes ----------------------------------------------------------------------------------------
def _owner(request: Request) -> str:
    key = request.state.api_key
    return key.name if key is not None else ""


async def create(server: "OpenAIServer", request: Request):
    req: ResponsesRequest = await server._parse(request, ResponsesRequest, RESPONSES_RULES, API)
    await server.note_request(request, req.model, req.timeout)
    history: list[dict[str, Any]] = []
    if req.previous_response_id is not None:
        stored = await server.response_store.get(req.previous_response_id, _owner(request))
        if stored is None:
            raise RequestError(404, f"previous response {req.previous_response_id!r} was not found (never stored, "
                               "expired, deleted, or stored under another API key)", "previous_response_id")
        history = msgspec.json.decode(stored.conversation)
    conversation = history + input_messages(req.input)
    system = [{"role": "system", "content": req.instructions}] if req.instructions is not None else []
    plan = await server.plan_chat(chat_request(req), system + conversation, prompt_param="input",
                                  max_tokens_param="max_output_tokens")
    draft = ResponseDraft(req, plan)
    return await server.respond(request, plan, req.stream, server._request_id(request, "resp"),
                                lambda merged: collect(server, request, draft, merged, conversation),
                                lambda merged: events(server, request, draft, merged, conversation))


def _not_found(rid: str) -> RequestError:
    return RequestError(404, f"response {rid!r} was not found (never stored, expired, deleted, or stored under "
                        "another API key)", "response_id")


async def retrieve(server: "OpenAIServer", request: Request):
    rid = request.path_params["response_id"]
    if request.query_params.get("stream") not in (None, "false"):
        raise RequestError(400, "streaming a stored response again (stream=true) is not supported", "stream")
    stored = await server.response_store.get(rid, _owner(request))
    if stored is None:
        raise _not_found(rid)
    return Response(stored.response, media_type="application/json")


async def delete(server: "OpenAIServer", request: Request):
    rid = request.path_params["response_id"]
    if not await server.response_store.delete(rid, _owner(request)):
        raise _not_found(rid)
    return json_response({"id": rid, "object": "response.deleted", "deleted": True})


def routes(server: "OpenAIServer") -> list:
    async def create_endpoint(request: Request):
        return await create(server, request)

    async def retrieve_endpoint(request: Request):
        return await retrieve(server, request)

    async def delete_endpoint(request: Request):
        return await delete(server, request)

    return [server.route("/v1/responses", create_endpoint, ["POST"]),
            server.route("/v1/responses/{response_id}", retrieve_endpoint, ["GET"]),
            server.route("/v1/responses/{response_id}", delete_endpoint, ["DELETE"])]
