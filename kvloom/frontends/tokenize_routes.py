"""vLLM's /tokenize, /detokenize and /tokenizer_info: text or a chat (through the same template path as
/v1/chat/completions) to token ids, token ids back to text, and the tokenizer's configuration (what
lm-eval's ``tokenizer_backend=remote`` reads), in vLLM's request and response shapes."""

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
    add_special_tokens: bool | None = None  # default: true for a prompt; false for a chat (its template places them)
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
        options = chat_template_options(req, server.chat_template)
        if req.tools:
            tools = plan_tools(req.tools, "none", None, None, False).tools  # checked as a chat request's
            options["chat_template_kwargs"] = {**(options["chat_template_kwargs"] or {}), "tools": tools}
        ids = await core.tokenize_chat(chat_messages(req.messages), add_special_tokens=bool(req.add_special_tokens),
                                       **options)
    strs = tokenizer.convert_ids_to_tokens(ids) if req.return_token_strs else None
    return TokenizeResponse(len(ids), core.max_model_len, list(ids), strs)


async def detokenize(server: "OpenAIServer", request: Request) -> DetokenizeResponse:
    req, core = await _parse(server, request, DetokenizeRequest)
    ids = core.check_token_ids(req.tokens, "tokens")
    return DetokenizeResponse(core.tokenizer.decode(ids, skip_special_tokens=False))


# Configuration keys that name files on the server's disk: not the client's business.
_PATH_KEYS = {"name_or_path", "vocab_file", "merges_file", "tokenizer_file", "special_tokens_map_file"}


def tokenizer_info(tokenizer, chat_template: str | None) -> dict[str, Any]:
    """vLLM's /tokenizer_info: the tokenizer's configuration as tokenizer_config.json holds it (special
    tokens as their text), its class, and the chat template the server renders chats with."""
    config = {k: _plain(v) for k, v in (getattr(tokenizer, "init_kwargs", None) or {}).items() if k not in _PATH_KEYS}
    for name in ("bos_token", "eos_token", "pad_token", "unk_token"):
        value = getattr(tokenizer, name, None)
        if config.get(name) is None and value is not None:
            config[name] = str(value)
    config["tokenizer_class"] = type(tokenizer).__name__
    template = chat_template or getattr(tokenizer, "chat_template", None)
    if template:
        config["chat_template"] = template
    return config


def _plain(value: Any) -> Any:
    """``value`` as JSON can carry it: AddedToken as its text, mapping keys as strings."""
    if hasattr(value, "content"):
        return value.content
    if isinstance(value, dict):
        return {str(k): _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    if isinstance(value, int) and not isinstance(value, bool) and abs(value) >= 2**63:
        return float(value)  # model_max_length "unlimited" is 1e30, past what a JSON encoder's int64 holds
    if value is None or isinstance(value, (str, bool, int, float)):
        return value
    return str(value)


def routes(server: "OpenAIServer") -> list:
    from starlette.routing import Route

    async def tokenize_endpoint(request: Request):
        return json_response(await tokenize(server, request))

    async def detokenize_endpoint(request: Request):
        return json_response(await detokenize(server, request))

    async def tokenizer_info_endpoint(request: Request):
        core, _ = await server.resolve(request.query_params.get("model"))  # an adapter has its model's tokenizer
        return json_response(tokenizer_info(core.tokenizer, server.chat_template))

    return [Route("/tokenize", server._endpoint(tokenize_endpoint), methods=["POST"]),
            Route("/detokenize", server._endpoint(detokenize_endpoint), methods=["POST"]),
            Route("/tokenizer_info", server._endpoint(tokenizer_info_endpoint), methods=["GET"])]
