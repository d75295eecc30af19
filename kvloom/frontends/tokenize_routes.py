"""vLLM's /tokenize and /detokenize: text or a chat (through the same template path as
/v1/chat/completions) to token ids, and token ids back to text, in vLLM's request and response shapes."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from msgspec import Struct
from starlette.requests import Request

from kvloom.frontends import openai_protocol as api
from kvloom.frontends.asgi import json_response
from kvloom.frontends.errors import RequestError
from kvloom.frontends.openai_requests import chat_messages, chat_template_options
from kvloom.frontends.request_fields import CHAT_RULES
from kvloom.frontends.tool_parsers import plan_tools

if TYPE_CHECKING:
    from kvloom.frontends.api_server import OpenAIServer


class TokenizeRequest(Struct, kw_only=True):
    """Either ``prompt`` (text) or ``messages`` (a chat, rendered by the chat template)."""

    model: str | None = None
    prompt: str | None = None
    messages: list[api.ChatMessageIn] | None = None
    add_special_tokens: bool | None = None  # default: true for a prompt; a chat's template places them
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template: str | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    tools: list[Any] | None = None  # rendered by the chat template, as in a chat request
    return_token_strs: bool = False


class TokenizeResponse(Struct):
    count: int
    max_model_len: int
    tokens: list[int]
    token_strs: list[str] | None = None


class DetokenizeRequest(Struct, kw_only=True):
    tokens: list[int]
    model: str | None = None


class DetokenizeResponse(Struct):
    prompt: str


_TOKENIZE_RULES = {"mm_processor_kwargs": CHAT_RULES["mm_processor_kwargs"]}


async def _parse(server: "OpenAIServer", request: Request, typ: type):
    req = await server._parse(request, typ, _TOKENIZE_RULES)
    core, _ = await server.resolve(req.model)  # each served model has its own tokenizer (its adapters share it)
    return req, core


async def tokenize(server: "OpenAIServer", request: Request) -> TokenizeResponse:
    req, core = await _parse(server, request, TokenizeRequest)
    tokenizer = core.tokenizer
    if (req.prompt is None) == (req.messages is None):
        raise RequestError(400, "give either 'prompt' (text) or 'messages' (a chat)", "prompt")
    if req.prompt is not None:
        add_special = True if req.add_special_tokens is None else req.add_special_tokens
        ids = tokenizer.encode(req.prompt, add_special_tokens=add_special)
    else:
        if req.add_special_tokens:
            raise RequestError(400, "add_special_tokens=true is not supported with messages: the chat template "
                               "places the special tokens", "add_special_tokens")
        options = chat_template_options(req, server.chat_template)
        if req.tools:
            tools = plan_tools(req.tools, "none", None, None, False).tools  # checked as a chat request's
            options["chat_template_kwargs"] = {**(options["chat_template_kwargs"] or {}), "tools": tools}
        ids = await core.tokenize_chat(chat_messages(req.messages), **options)
    strs = tokenizer.convert_ids_to_tokens(ids) if req.return_token_strs else None
    return TokenizeResponse(len(ids), core.max_model_len, list(ids), strs)


async def detokenize(server: "OpenAIServer", request: Request) -> DetokenizeResponse:
    req, core = await _parse(server, request, DetokenizeRequest)
    ids = core.check_token_ids(req.tokens, "tokens")
    return DetokenizeResponse(core.tokenizer.decode(ids, skip_special_tokens=False))


def routes(server: "OpenAIServer") -> list:
    from starlette.routing import Route

    async def tokenize_endpoint(request: Request):
        return json_response(await tokenize(server, request))

    async def detokenize_endpoint(request: Request):
        return json_response(await detokenize(server, request))

    return [Route("/tokenize", server._endpoint(tokenize_endpoint), methods=["POST"]),
            Route("/detokenize", server._endpoint(detokenize_endpoint), methods=["POST"])]
