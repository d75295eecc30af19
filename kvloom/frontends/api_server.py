"""The HTTP frontend (Starlette on uvicorn): OpenAI's /v1/completions, /v1/chat/completions and
/v1/responses, Anthropic's /v1/messages, /v1/models (served models and their LoRA adapters),
/v1/load_lora_adapter, /v1/unload_lora_adapter, /health, /version, /metrics. Run as a process by the
``engine`` launcher; several of them may share one listening socket and one engine. This file holds
the routes, the chat pipeline every chat-shaped API runs through, and the process entry; HTTP plumbing
is in ``asgi``, request translation in ``openai_requests``, chat/completions response building in
``openai_responses``, the other APIs' translators in ``responses_api`` and ``anthropic_api``."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import os
import signal
import socket
import sys
import uuid
from dataclasses import dataclass, replace
from typing import Any, AsyncIterator, Awaitable, Callable

import msgspec
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.middleware import Middleware
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

import kvloom
from kvloom.core.config import EngineConfig
from kvloom.core.sampling_params import StructuredOutputSpec
from kvloom.frontends import anthropic_api, pooling_api, responses_api
from kvloom.frontends import openai_protocol as api
from kvloom.frontends.access_log import AccessLog, note_model, track_tokens
from kvloom.frontends.admission import KeyRing, check_timeout, parse_api_keys, replace_prepared
from kvloom.frontends.asgi import (
    ClientGone,
    EventStream,
    cancel_on_disconnect,
    decode_body,
    error_response,
    json_response,
    prepend,
)
from kvloom.frontends.chat_output import ChatReading
from kvloom.frontends.config import ServerConfig
from kvloom.frontends.engine_client import EngineUnavailable
from kvloom.frontends.frontend_core import FrontendCore, PreparedRequest, RequestError, merge_streams
from kvloom.frontends.metrics import EngineSample, FrontendMetrics
from kvloom.frontends.lora_routes import routes as lora_routes
from kvloom.frontends.model_cores import close_cores, core_for, resolve_model, start_model_cores
from kvloom.frontends.openai_requests import (
    chat_messages,
    chat_template_options,
    check_echo,
    echoed_message,
    prompt_logprobs,
    sampling_params,
    split_prompts,
    structured_output,
    truncate_prompt,
)
from kvloom.frontends.openai_responses import ChatPrompt, CompletionEcho, ResponseBuilder, UsageCounter
from kvloom.frontends.output import TextDelta, coalesce, fan_out
from kvloom.frontends.reasoning import END as THINK_END
from kvloom.frontends.reasoning import grammar_waits_for_reasoning, starts_in_reasoning
from kvloom.frontends.request_fields import CHAT_RULES, COMPLETION_RULES, check_fields
from kvloom.frontends.responses_store import open_response_store
from kvloom.frontends.text import load_chat_template
from kvloom.frontends.tokenize_routes import routes as tokenize_routes
from kvloom.frontends.tool_parsers import ToolPlan, plan_tools

logger = logging.getLogger("kvloom.api")
PROMPT_TAIL_TOKENS = 16  # enough of a prompt's end to see whether it leaves a <think> block open


@dataclass
class ChatPlan:
    """A chat request checked, rendered and tokenized: its engine requests (one per choice), the builder
    of its model's responses, its usage counter and how its outputs are read."""

    core: FrontendCore
    builder: ResponseBuilder
    prepared: list[PreparedRequest]
    prompt_text: str  # the chat as the template rendered it
    prompt_token_ids: list[int]
    usage: UsageCounter
    reading: ChatReading


class OpenAIServer:
    def __init__(self, config: ServerConfig) -> None:
        self.config = config
        self.core: FrontendCore | None = None  # the first (or only) model's
        self.cores: dict[str, FrontendCore] = {}  # every served model's, by name
        self.builders: dict[str, ResponseBuilder] = {}
        self.metrics = FrontendMetrics()
        self.responses: ResponseBuilder | None = None  # once the engine has said which model it serves
        self.keys = KeyRing(parse_api_keys(config.api_keys, config.api_key))
        self.response_store = open_response_store(config.responses_store_path, config.responses_store_max_entries,
                                                  config.responses_store_max_mb, config.responses_store_max_age)
        # --chat-template: read once here; the launcher has checked it already
        self.chat_template = load_chat_template(config.chat_template) if config.chat_template else None

    @property
    def model_name(self) -> str:
        return self.core.ready.model_name

    def routes(self) -> list[Route]:
        return [
            self.route("/v1/completions", self.completions, ["POST"]),
            self.route("/v1/chat/completions", self.chat_completions, ["POST"]),
            self.route("/v1/models", self.models, ["GET"]),
            self.route("/v1/models/{model:path}", self.model_card, ["GET"]),
            self.route("/health", self.health, ["GET"], public=True),
            self.route("/version", self.version, ["GET"], public=True),
            self.route("/metrics", self.metrics_endpoint, ["GET"], public=True),
            self.route("/reset_prefix_cache", self.reset_prefix_cache, ["POST"]),
            *tokenize_routes(self),
            *lora_routes(self),
            *responses_api.routes(self),
            *anthropic_api.routes(self),
            *pooling_api.routes(self),
        ]

    # --- plumbing ----------------------------------------------------------------------------------
    def route(self, path: str, handler: Callable[[Request], Awaitable[Any]], methods: list[str],
              public: bool = False, errors: Callable[..., Response] = error_response) -> Route:
        """A route whose handler runs through ``_endpoint``; its metrics label is ``path`` (the template,
        so ids in URLs do not make a series each)."""
        return Route(path, self._endpoint(handler, public, errors, path), methods=methods)

    def _endpoint(self, handler: Callable[[Request], Awaitable[Any]], public: bool = False,
                  errors: Callable[..., Response] = error_response, path: str | None = None):
        """Wrap a handler: API-key check (unless public), errors in its API's shape (``errors``: OpenAI's
        unless told), request metrics."""

        async def endpoint(request: Request):
            request.state.api_key = None
            request.state.model = None  # the served model the request goes to, once known: its metrics label
            try:
                if not public:
                    request.state.api_key = self.keys.authenticate_headers(request.headers)
                response = await handler(request)
            except RequestError as e:
                key = request.state.api_key
                self.metrics.count_rejection(e.reason, key.name if key else "", request.state.model)
                response = errors(e.status, e.message, e.param, e.headers)
            except ClientGone:
                response = Response(status_code=499)
            except Exception as e:  # noqa: BLE001 - a bug must still answer in its API's error shape
                logger.exception("Unhandled error in %s", request.url.path)
                response = errors(500, f"internal error: {e!r}")
            self.metrics.count_request(path or request.url.path, getattr(response, "status_code", 200),
                                       request.state.model)
            return response

        endpoint.__name__ = handler.__name__
        return endpoint

    async def _parse(self, request: Request, typ: type, rules: dict | None = None, api_name: str | None = None):
        """The body decoded as ``typ``; with ``rules``, its fields checked by ``check_fields`` too
        (``api_name``: whose request it is, for the unknown-field message)."""
        req, body = await decode_body(request, typ, self.config.max_request_body_bytes,
                                      self.config.http_body_timeout)
        if rules is not None:
            check_fields(msgspec.json.decode(body), typ, rules, *([api_name] if api_name else []))
        return req

    async def _parse_generation(self, request: Request, typ: type, rules: dict | None = None):
        """A generating request's body, checked; notes its model (metrics) and ``timeout`` (admission)."""
        if rules is None:
            rules = CHAT_RULES if typ is api.ChatCompletionRequest else COMPLETION_RULES
        req = await self._parse(request, typ, rules)
        await self.note_request(request, req.model, req.timeout)
        return req

    async def note_request(self, request: Request, model: str | None, timeout: float | None) -> None:
        """Note a generating request's served model and LoRA adapter (a 404 for neither), the name its
        metrics and access-log line carry (the adapter's, if it names one), and its ``timeout`` (admission)."""
        core, lora = await self.resolve(model)
        request.state.core, request.state.lora = core, lora
        request.state.model = lora or core.ready.model_name
        note_model(request.scope, request.state.model)
        request.state.timeout = timeout

    async def resolve(self, model: str | None) -> tuple[FrontendCore, str]:
        """The served model and LoRA adapter (empty for none) a request's ``model`` names, or a 404."""
        return await resolve_model(self.cores, model)

    def builder(self, core: FrontendCore, lora: str) -> ResponseBuilder:
        """The response builder of a served model or of one of its adapters (responses name the adapter)."""
        base = self.builders[core.ready.model_name]
        if not lora:
            return base
        builder = self.builders.get(lora)
        if builder is None or builder.tokenizer is not core.tokenizer:
            builder = self.builders[lora] = base.named(lora)
        return builder

    def core_for(self, model: str | None) -> FrontendCore:
        """The served model a request names (no name: the first model), or 404 naming those served."""
        return core_for(self.cores, model)

    def _request_id(self, request: Request, prefix: str, given: str | None = None) -> str:
        """The header's X-Request-Id, else the body's request_id (vLLM's field), else a new one. Echoed
        back only: the engine gets ids this frontend makes, so a reused id cannot mix outputs."""
        return request.headers.get("x-request-id") or given or f"{prefix}-{uuid.uuid4().hex}"

    def _start(self, core: FrontendCore, prepared: list[PreparedRequest], model: str
               ) -> AsyncIterator[tuple[int, TextDelta]]:
        self.metrics.count_prompt_tokens(sum(len(p.prompt_token_ids) for p in prepared), model)
        merged = merge_streams([self.metrics.observe(core.generate(p), model) for p in prepared])
        prompts: dict[int, int] = {}  # the n choices of one prompt share its token list
        groups = [prompts.setdefault(id(p.prompt_token_ids), len(prompts)) for p in prepared]
        return self.metrics.observe_prompts(merged, groups, model)

    async def _respond(self, request: Request, core: FrontendCore, prepared: list[PreparedRequest], stream: bool,
                       rid: str, collect: Callable, events: Callable, stream_interval: int | None = None) -> Any:
        key, given = request.state.api_key, request.state.timeout
        timeout = check_timeout(given, self.config.request_timeout)
        prepared = [replace_prepared(p, key, timeout, given is not None) for p in prepared]
        admission = core.admit(len(prepared))  # held until the response ends
        # n choices of one prompt share its token list: the log counts each prompt once, as usage does.
        prompts = {id(p.prompt_token_ids): p.prompt_token_ids for p in prepared}
        prompt_tokens = sum(len(ids) for ids in prompts.values())
        merged = track_tokens(request.scope, prompt_tokens, self._start(core, prepared, request.state.model))
        if key is not None:
            merged = self.metrics.count_key_usage(key.name, prompt_tokens, merged, request.state.model)
        headers = {"x-request-id": rid}
        if not stream:
            try:
                body = await cancel_on_disconnect(request.receive, collect(merged))
            finally:
                await merged.aclose()
                admission.release()
            return json_response(body, headers=headers)
        if stream_interval is not None and stream_interval > 1:
            merged = coalesce(merged, stream_interval)
        try:
            # Wait for the first output before answering, so a rejected request still gets its status.
            first = await cancel_on_disconnect(request.receive, anext(merged))
        except BaseException:
            await merged.aclose()
            admission.release()
            raise
        return EventStream(events(prepend(first, merged)), headers, on_close=admission.release)

    # --- /v1/completions ---------------------------------------------------------------------------
    async def completions(self, request: Request):
        req: api.CompletionRequest = await self._parse_generation(request, api.CompletionRequest)
        core, lora = request.state.core, request.state.lora
        responses = self.builder(core, lora)
        texts = split_prompts(req.prompt)
        special = req.add_special_tokens is not False
        truncating = req.truncate_prompt_tokens is not None
        prompts = [truncate_prompt(core.check_token_ids(p) if isinstance(p, list) else
                                   await core.tokenize_text(p, add_special_tokens=special, truncated=truncating),
                                   req, core.max_model_len) for p in texts]
        check_echo(req)
        # max_tokens=0 (echo only): the engine generates one token, which the response leaves out.
        sp = sampling_params(req, 1 if req.max_tokens == 0 else req.max_tokens, req.logprobs,
                             prompt_logprobs=prompt_logprobs(req))
        prepared = [core.prepare(ids, choice, priority=req.priority, lora_name=lora)
                    for ids in prompts for choice in fan_out(sp, req.n)]
        echo = None
        if req.echo or req.prompt_logprobs is not None:
            shown = [(t if isinstance(t, str) and not truncating else
                      responses.tokenizer.decode(ids, skip_special_tokens=False), ids) for t, ids in zip(texts, prompts)]
            echo = CompletionEcho([p for p in shown for _ in range(req.n)], req.echo, req.logprobs,
                                  req.prompt_logprobs, generate=req.max_tokens != 0)
        rid = self._request_id(request, "cmpl", req.request_id)
        responses = responses.view(req.return_tokens_as_token_ids)
        usage = UsageCounter([len(p) for p in prompts], req.n)
        token_ids = [p for p in prompts for _ in range(req.n)] if req.return_token_ids else None
        return await self._respond(request, core, prepared, req.stream, rid,
                                   lambda merged: responses.collect_completion(rid, merged, usage, len(prepared), echo,
                                                                               token_ids),
                                   lambda merged: responses.completion_events(req, rid, merged, usage, echo, token_ids),
                                   req.stream_interval)

    # --- /v1/chat/completions ----------------------------------------------------------------------
    async def chat_completions(self, request: Request):
        req: api.ChatCompletionRequest = await self._parse_generation(request, api.ChatCompletionRequest)
        plan = await self.plan_chat(req)
        builder, usage = plan.builder.view(req.return_tokens_as_token_ids), plan.usage
        reading = replace(plan.reading, cut_calls=True)  # as vLLM: a named call cut short is a call
        rid = self._request_id(request, "chatcmpl", req.request_id)
        shown = ChatPrompt(echoed_message(req), plan.prompt_token_ids if req.return_token_ids else None,
                           plan.prompt_text if req.return_prompt_text else None, req.prompt_logprobs)
        return await self.respond(request, plan, req.stream, rid,
                                  lambda merged: builder.collect_chat(rid, merged, usage, req.n, reading, shown),
                                  lambda merged: builder.chat_events(req, rid, merged, usage, reading, shown),
                                  req.stream_interval)

    async def plan_chat(self, req: api.ChatCompletionRequest, messages: list[dict[str, Any]] | None = None, *,
                        prompt_param: str = "messages", max_tokens_param: str | None = None) -> ChatPlan:
        """A chat request, or another API's request translated into one, checked, rendered and tokenized:
        the one pipeline of every chat-shaped API. ``messages``: the chat as templates take it, when the
        translator has built it already; the params name the caller's fields in errors."""
        core, lora = await self.resolve(req.model)
        tools, constraint, text, ids = await self._render_chat(core, req, messages, prompt_param)
        max_tokens = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
        if max_tokens_param is None:
            max_tokens_param = "max_completion_tokens" if req.max_completion_tokens is not None else "max_tokens"
        sp = sampling_params(req, max_tokens, (req.top_logprobs or 0) if req.logprobs else None, constraint,
                             prompt_logprobs=req.prompt_logprobs)
        prepared = [core.prepare(ids, choice, priority=req.priority, max_tokens_param=max_tokens_param,
                                 prompt_param=prompt_param, lora_name=lora)
                    for choice in fan_out(sp, req.n)]
        # A grammar that waits for </think> leaves the reasoning to the model, as without one.
        reading = self._reading(core, ids, tools, constrained=constraint is not None and not constraint.after,
                                show=req.include_reasoning)
        return ChatPlan(core, self.builder(core, lora), prepared, text, ids,
                        UsageCounter([len(ids)], req.n), reading)

    async def render_chat(self, req: api.ChatCompletionRequest, messages: list[dict[str, Any]] | None = None,
                          prompt_param: str = "messages"
                          ) -> tuple[FrontendCore, ToolPlan | None, StructuredOutputSpec | None, str, list[int]]:
        """The served model, tool plan, output constraint, rendered prompt and prompt tokens of a chat request."""
        core, _ = await self.resolve(req.model)
        return (core, *await self._render_chat(core, req, messages, prompt_param))

    async def _render_chat(self, core: FrontendCore, req: api.ChatCompletionRequest,
                           messages: list[dict[str, Any]] | None, prompt_param: str
                           ) -> tuple[ToolPlan | None, StructuredOutputSpec | None, str, list[int]]:
        tools = plan_tools(req.tools, req.tool_choice, req.parallel_tool_calls, self.config.tool_call_parser,
                           self.config.enable_auto_tool_choice)
        options = chat_template_options(req, self.chat_template)
        constraint = structured_output(req)
        if tools is not None:
            # The template shows the model its tools; a required or named call is forced by the grammar.
            options["chat_template_kwargs"] = {**(options["chat_template_kwargs"] or {}), "tools": tools.tools}
            if tools.schema is not None:
                if constraint is not None:
                    raise RequestError(400, f"tool_choice={req.tool_choice!r} forces the output's shape, so it "
                                       "cannot be combined with response_format or guided_* fields", "tool_choice")
                # Compact JSON: a call's arguments never wander into whitespace until max_tokens.
                constraint = StructuredOutputSpec(kind="json", spec=msgspec.json.encode(tools.schema).decode(),
                                                  any_whitespace=False)
        if messages is None:
            messages = chat_messages(req.messages)
        text = await core.render_chat(messages, prompt_param, **options)
        ids = await core.encode_chat(text, prompt_param, add_special_tokens=bool(req.add_special_tokens),
                                     truncated=req.truncate_prompt_tokens is not None)
        ids = truncate_prompt(ids, req, core.max_model_len)
        if (constraint is not None and self.config.reasoning_parser
                and not self.config.structured_outputs_in_reasoning):
            tail = core.tokenizer.decode(ids[-PROMPT_TAIL_TOKENS:], skip_special_tokens=False)
            if grammar_waits_for_reasoning(tail):  # structured outputs apply to the answer, not the reasoning
                constraint = msgspec.structs.replace(
                    constraint, after=tuple(core.tokenizer.encode(THINK_END, add_special_tokens=False)))
        return tools, constraint, text, ids

    def _reading(self, core: FrontendCore, ids: list[int], tools: ToolPlan | None, constrained: bool,
                 show: bool) -> ChatReading:
        parser = self.config.reasoning_parser
        in_reasoning = False
        if parser is not None:
            tail = core.tokenizer.decode(ids[-PROMPT_TAIL_TOKENS:], skip_special_tokens=False)
            in_reasoning = starts_in_reasoning(parser, tail, constrained)
        return ChatReading(tools, self.config.tool_call_parser, parser is not None, in_reasoning, show)

    async def respond(self, request: Request, plan: ChatPlan, stream: bool, rid: str, collect: Callable,
                      events: Callable, stream_interval: int | None = None) -> Any:
        """Run a planned chat through admission and the engine; ``collect`` makes the whole response,
        ``events`` the stream (each in its API's shape)."""
        return await self._respond(request, plan.core, plan.prepared, stream, rid, collect, events, stream_interval)

    # --- the rest ----------------------------------------------------------------------------------
    async def models(self, request: Request):
        cards = []
        for name, core in self.cores.items():
            await core.refresh_adapters()
            cards.append(api.ModelCard(name, core.max_model_len, root=name))
            cards += [self._adapter_card(core, adapter) for adapter in core.adapters]
        return json_response(api.ModelList(cards))

    async def model_card(self, request: Request):
        name = request.path_params["model"]
        core, lora = await self.resolve(name)
        return json_response(self._adapter_card(core, lora) if lora else api.ModelCard(name, core.max_model_len,
                                                                                        root=name))

    @staticmethod
    def _adapter_card(core: FrontendCore, name: str) -> api.ModelCard:
        """A LoRA adapter as vLLM lists it: its folder as ``root``, its base model as ``parent``."""
        return api.ModelCard(name, core.max_model_len, root=core.adapters[name]["path"], parent=core.ready.model_name)

    async def health(self, request: Request):
        if len(self.cores) == 1 and len(self.core.client.replicas) == 1:
            client = self.core.client
            if not client.healthy:
                raise RequestError(503, f"the engine is unavailable: {client.unavailable_reason}")
            return json_response({"status": "ok"})
        # Several engines: 503 only when none serves; with some out, 200 "degraded" saying which.
        if not any(core.client.healthy for core in self.cores.values()):
            reasons = "; ".join(f"{name}: {core.client.unavailable_reason}" for name, core in self.cores.items())
            raise RequestError(503, f"the engine is unavailable: {reasons}")
        models = {name: {"healthy": core.client.healthy, "replicas": core.client.replica_states()}
                  for name, core in self.cores.items()}
        degraded = any(not r["healthy"] for m in models.values() for r in m["replicas"])
        body: dict[str, Any] = {"status": "degraded" if degraded else "ok"}
        if len(models) == 1:
            body["replicas"] = next(iter(models.values()))["replicas"]
        else:
            body["models"] = models
        return json_response(body)

    async def version(self, request: Request):
        return json_response({"version": kvloom.__version__})

    async def metrics_endpoint(self, request: Request):
        # Every engine of every model, asked here at scrape time: served once, whichever worker answers.
        per_model = await asyncio.gather(*(core.client.replica_stats(timeout=5.0) for core in self.cores.values()))
        engines = [EngineSample(name, replica, healthy, stats)
                   for name, replicas in zip(self.cores, per_model) for replica, healthy, stats in replicas]
        body, content_type = self.metrics.render(engines)
        return Response(body, media_type=content_type)

    async def reset_prefix_cache(self, request: Request):
        for core in self.cores.values():
            core.check_available(0)
        try:
            for core in self.cores.values():
                await core.client.utility("reset_prefix_cache")
        except RuntimeError as e:
            raise RequestError(400, str(e)) from None
        return json_response({"status": "ok"})


# --- process ---------------------------------------------------------------------------------------
def build_app(engine_address: str | list[str], engine_config: EngineConfig, server_config: ServerConfig,
              engine_secret: str | None = None, models: list[dict[str, Any]] | None = None) -> Starlette:
    """``models``: several served models (``{"name", "engine", "addresses"}`` each), else the one engine
    (or replicas) at ``engine_address``."""
    server = OpenAIServer(server_config)

    @contextlib.asynccontextmanager
    async def lifespan(app):
        try:
            server.cores = await start_model_cores(engine_address, engine_config, server_config, engine_secret,
                                                   models)
            server.core = core_for(server.cores, None)
        except EngineUnavailable as e:
            # The engine has logged why (e.g. max_model_len over the model's); a traceback from each
            # worker would only bury that line. The launcher sees this exit and stops the server.
            logger.error("%s", e)
            logging.shutdown()
            os._exit(3)
        server.metrics.set_model(server.core.ready.model_name, list(server.cores))
        server.responses = ResponseBuilder(server.core.tokenizer, server.core.ready.model_name)
        server.builders = {name: ResponseBuilder(core.tokenizer, name) for name, core in server.cores.items()}
        try:
            yield
        finally:
            await close_cores(server.cores)

    async def http_error(request: Request, exc: HTTPException) -> Response:
        return error_response(exc.status_code, f"{request.method} {request.url.path}: {exc.detail}")

    app = Starlette(routes=server.routes(), lifespan=lifespan,
                    exception_handlers={404: http_error, 405: http_error},
                    middleware=[Middleware(AccessLog, enabled=server_config.log_requests)])
    app.state.server = server
    return app


def run_server(engine_address: str | list[str], engine_config: EngineConfig, server_config: ServerConfig,
               sock: socket.socket | None = None, log_level: str = "info", engine_secret: str | None = None,
               models: list[dict[str, Any]] | None = None) -> int:
    import uvicorn

    from kvloom.frontends.uvicorn_server import DRAIN_GRACE_S, DrainingServer, header_timeout_protocol

    app = build_app(engine_address, engine_config, server_config, engine_secret, models)
    try:
        import uvloop  # noqa: F401
        loop = "uvloop"
    except ImportError:
        loop = "asyncio"
    config = uvicorn.Config(app, host=server_config.host, port=server_config.port, loop=loop, lifespan="on",
                            log_level=log_level, access_log=False,
                            timeout_graceful_shutdown=int(server_config.drain_timeout) + DRAIN_GRACE_S,
                            http=header_timeout_protocol(server_config.http_header_timeout),
                            timeout_keep_alive=server_config.http_keep_alive_timeout,
                            limit_concurrency=server_config.http_limit_concurrency)
    server = DrainingServer(config, app.state.server, server_config.drain_timeout)
    # uvicorn re-raises the signal that stopped it once it has drained; by then there is nothing left
    # to do, so exit normally instead of dying from it.
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda signum, frame: None)
    server.run(sockets=[sock] if sock is not None else None)
    return 0 if server.started else 3


def main(argv: list[str] | None = None) -> int:
    """``python -m kvloom.frontends.api_server --engine-address ADDR [--fd N]``, settings as JSON on stdin."""
    from kvloom.launch.child_process import start_child

    parser = argparse.ArgumentParser(prog="kvloom-api-server")
    parser.add_argument("--engine-address", required=True, action="append",
                        help="An engine to feed; repeated for data-parallel replicas.")
    parser.add_argument("--fd", type=int, help="An inherited, bound socket to listen on.")
    args, engine, server = start_child(parser, argv)
    sock = socket.socket(fileno=args.fd) if args.fd is not None else None
    return run_server(args.engine_address, engine, server, sock, args.log_level, args.engine_secret, args.models)


if __name__ == "__main__":
    sys.exit(main())
