"""The OpenAI-compatible HTTP frontend (Starlette on uvicorn): /v1/completions, /v1/chat/completions,
/v1/models, /health, /version, /metrics. Run as a process by the ``engine`` launcher; several of
them may share one listening socket and one engine."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import hmac
import logging
import os
import re
import signal
import socket
import sys
import uuid
from typing import Any, AsyncIterator, Awaitable, Callable

import msgspec
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.middleware import Middleware
from starlette.requests import ClientDisconnect, Request
from starlette.responses import Response
from starlette.routing import Route

import kvloom
from kvloom.core.config import EngineConfig
from kvloom.core.messages import TokenLogprobs
from kvloom.core.sampling_params import SamplingParams
from kvloom.frontends import openai_protocol as api
from kvloom.frontends.access_log import AccessLog, track_tokens
from kvloom.frontends.config import ServerConfig
from kvloom.frontends.engine_client import EngineUnavailable
from kvloom.frontends.frontend_core import (
    FrontendCore,
    PreparedRequest,
    RequestError,
    TextDelta,
    merge_streams,
    start_frontend_core,
)
from kvloom.frontends.limits import check_json_depth, read_body
from kvloom.frontends.metrics import FrontendMetrics
from kvloom.frontends.request_fields import CHAT_RULES, COMPLETION_RULES, check_fields
from kvloom.frontends.text import load_chat_template, token_bytes
from kvloom.frontends.tokenize_routes import routes as tokenize_routes

logger = logging.getLogger("kvloom.api")

ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 404: "not_found_error",
               408: "timeout_error", 413: "invalid_request_error", 429: "rate_limit_error",
               503: "service_unavailable"}
_PARAM_AT = re.compile(r" - at `\$\.?([^`]*)`")
_MISSING = re.compile(r"missing required field `([^`]+)`")


class ClientGone(Exception):
    """The HTTP client disconnected before its response was ready."""


def json_response(body: Any, status: int = 200, headers: dict[str, str] | None = None) -> Response:
    return Response(msgspec.json.encode(body), status_code=status, media_type="application/json", headers=headers)


def error_response(status: int, message: str, param: str | None = None) -> Response:
    info = api.ErrorInfo(message=message, type=ERROR_TYPES.get(status, "server_error"), param=param, code=status)
    return json_response(api.ErrorResponse(info), status)


async def _wait_for_disconnect(receive) -> None:
    while (await receive())["type"] != "http.disconnect":
        pass


async def cancel_on_disconnect(receive, awaitable: Awaitable[Any]) -> Any:
    """Await ``awaitable`` unless the client disconnects first; then cancel it (which aborts its engine
    requests and frees their KV blocks) and raise ClientGone."""
    work = asyncio.ensure_future(awaitable)
    watcher = asyncio.ensure_future(_wait_for_disconnect(receive))
    try:
        await asyncio.wait({work, watcher}, return_when=asyncio.FIRST_COMPLETED)
        if work.done():
            return work.result()
        raise ClientGone()
    finally:
        # Also when this task itself is cancelled: ``work`` must be over before its iterators are closed,
        # or closing them fails with "asynchronous generator is already running".
        for task in (work, watcher):
            task.cancel()
        await asyncio.gather(work, watcher, return_exceptions=True)


class EventStream:
    """A server-sent-events response that stops (and aborts its requests) when the client goes away."""

    def __init__(self, events: AsyncIterator[str], headers: dict[str, str],
                 on_close: Callable[[], None] | None = None) -> None:
        self.events = events
        self.on_close = on_close
        self.headers = [(k.lower().encode(), v.encode()) for k, v in headers.items()]

    async def __call__(self, scope, receive, send) -> None:
        await send({"type": "http.response.start", "status": 200, "headers": [
            (b"content-type", b"text/event-stream; charset=utf-8"), (b"cache-control", b"no-cache"), *self.headers]})

        async def stream() -> None:
            async for event in self.events:
                await send({"type": "http.response.body", "body": event.encode(), "more_body": True})
            await send({"type": "http.response.body", "body": b"", "more_body": False})

        try:
            await cancel_on_disconnect(receive, stream())
        except ClientGone:
            pass
        finally:
            await self.events.aclose()
            if self.on_close is not None:
                self.on_close()


def sse(body: Any) -> str:
    return f"data: {msgspec.json.encode(body).decode()}\n\n"


SSE_DONE = "data: [DONE]\n\n"


def _decode_error_param(message: str) -> str | None:
    match = _PARAM_AT.search(message) or _MISSING.search(message)
    return match.group(1) if match else None


def _sampling(req: api._GenerationRequest, max_tokens: int | None, logprobs: int | None) -> SamplingParams:
    stop = [req.stop] if isinstance(req.stop, str) else list(req.stop or [])
    try:
        return SamplingParams(
            temperature=1.0 if req.temperature is None else req.temperature,
            top_p=1.0 if req.top_p is None else req.top_p, top_k=req.top_k, min_p=req.min_p, seed=req.seed,
            presence_penalty=req.presence_penalty or 0.0, frequency_penalty=req.frequency_penalty or 0.0,
            repetition_penalty=req.repetition_penalty, max_tokens=max_tokens, min_tokens=req.min_tokens,
            stop=stop, stop_token_ids=list(req.stop_token_ids), ignore_eos=req.ignore_eos, logprobs=logprobs,
            skip_special_tokens=req.skip_special_tokens, include_stop_str_in_output=req.include_stop_str_in_output,
        )
    except ValueError as e:  # SamplingParams names the field first: "top_k=-5 must be ..."
        field = str(e).split("=", 1)[0]
        raise RequestError(400, str(e), field if field.isidentifier() else None) from e


def _choice_sampling(sp: SamplingParams, i: int) -> SamplingParams:
    # n choices from one seeded request must differ from each other yet be reproducible.
    return sp if sp.seed is None or i == 0 else msgspec.structs.replace(sp, seed=(sp.seed + i) % 2**63)


class UsageCounter:
    """Token counts of one HTTP request across its choices."""

    def __init__(self, prompt_lens: list[int], n: int) -> None:
        self.prompt_tokens = sum(prompt_lens)
        self.n = n
        self.completion: dict[int, int] = {}
        self.cached: dict[int, int] = {}

    def add(self, index: int, delta: TextDelta) -> None:
        self.completion[index] = delta.num_output_tokens
        if index % self.n == 0:
            self.cached[index] = delta.num_cached_tokens

    def info(self) -> api.UsageInfo:
        completion = sum(self.completion.values())
        cached = sum(self.cached.values())
        return api.UsageInfo(self.prompt_tokens, completion, self.prompt_tokens + completion,
                             api.PromptTokensDetails(cached) if cached else None)


class OpenAIServer:
    def __init__(self, config: ServerConfig) -> None:
        self.config = config
        self.core: FrontendCore | None = None
        self.metrics = FrontendMetrics()
        self._token_text: dict[int, str] = {}
        self._token_bytes: dict[int, bytes] = {}
        # --chat-template: read once here; the launcher has checked it already
        self.chat_template = load_chat_template(config.chat_template) if config.chat_template else None

    @property
    def model_name(self) -> str:
        return self.core.ready.model_name

    def routes(self) -> list[Route]:
        return [
            Route("/v1/completions", self._endpoint(self.completions), methods=["POST"]),
            Route("/v1/chat/completions", self._endpoint(self.chat_completions), methods=["POST"]),
            Route("/v1/models", self._endpoint(self.models), methods=["GET"]),
            Route("/v1/models/{model:path}", self._endpoint(self.model_card), methods=["GET"]),
            Route("/health", self._endpoint(self.health, public=True), methods=["GET"]),
            Route("/version", self._endpoint(self.version, public=True), methods=["GET"]),
            Route("/metrics", self._endpoint(self.metrics_endpoint, public=True), methods=["GET"]),
            Route("/reset_prefix_cache", self._endpoint(self.reset_prefix_cache), methods=["POST"]),
            *tokenize_routes(self),
        ]

    # --- plumbing ----------------------------------------------------------------------------------
    def _endpoint(self, handler: Callable[[Request], Awaitable[Any]], public: bool = False):
        """Wrap a handler: API-key check (unless public), errors in OpenAI's shape, request metrics."""

        async def endpoint(request: Request):
            try:
                if not public:
                    self._authorize(request)
                response = await handler(request)
            except RequestError as e:
                response = error_response(e.status, e.message, e.param)
            except ClientGone:
                response = Response(status_code=499)
            except Exception as e:  # noqa: BLE001 - a bug must still answer in OpenAI's error shape
                logger.exception("Unhandled error in %s", request.url.path)
                response = error_response(500, f"internal error: {e!r}")
            self.metrics.count_request(request.url.path, getattr(response, "status_code", 200))
            return response

        endpoint.__name__ = handler.__name__
        return endpoint

    def _authorize(self, request: Request) -> None:
        key = self.config.api_key
        if key is None:
            return
        given = request.headers.get("authorization", "")
        scheme, _, token = given.partition(" ")
        if scheme.lower() != "bearer" or not hmac.compare_digest(token.strip().encode(), key.encode()):
            raise RequestError(401, "invalid or missing API key: send 'Authorization: Bearer KEY'")

    async def _parse(self, request: Request, typ: type, rules: dict | None = None):
        """The body decoded as ``typ``; with ``rules``, its fields checked by ``check_fields`` too."""
        try:
            body = await read_body(request.stream(), request.headers.get("content-length"),
                                   self.config.max_request_body_bytes, self.config.http_body_timeout)
        except ClientDisconnect:  # gone mid-body: nothing to answer, and not a server error
            raise ClientGone() from None
        check_json_depth(body)
        try:
            req = msgspec.json.decode(body, type=typ)
        except msgspec.ValidationError as e:
            param = _decode_error_param(str(e))
            message = str(e).split(" - at ")[0]
            raise RequestError(400, f"invalid value for '{param}': {message}" if param and "missing" not in message
                               else message, param) from None
        except msgspec.DecodeError as e:
            raise RequestError(400, f"the request body is not valid JSON: {e}") from None
        if rules is not None:
            check_fields(msgspec.json.decode(body), typ, rules)
        return req

    async def _parse_generation(self, request: Request, typ: type):
        rules = CHAT_RULES if typ is api.ChatCompletionRequest else COMPLETION_RULES
        req = await self._parse(request, typ, rules)
        self.check_model(req.model)
        return req

    def check_model(self, model: str | None) -> None:
        if model is not None and model != self.model_name:
            raise RequestError(404, f"The model `{model}` does not exist; this server serves "
                               f"`{self.model_name}`.", "model")

    def _request_id(self, request: Request, prefix: str) -> str:
        # Echoed back only: the engine gets ids this frontend makes, so a reused id cannot mix outputs.
        return request.headers.get("x-request-id") or f"{prefix}-{uuid.uuid4().hex}"

    def token_text(self, token_id: int) -> str:
        text = self._token_text.get(token_id)
        if text is None:
            text = self._token_text[token_id] = self.core.tokenizer.decode([token_id], skip_special_tokens=False)
        return text

    def token_bytes(self, token_id: int) -> bytes:
        raw = self._token_bytes.get(token_id)
        if raw is None:
            raw = self._token_bytes[token_id] = token_bytes(self.core.tokenizer, token_id)
        return raw

    def _start(self, prepared: list[PreparedRequest]) -> AsyncIterator[tuple[int, TextDelta]]:
        for p in prepared:
            self.metrics.prompt_tokens.inc(len(p.prompt_token_ids))
        return merge_streams([self.metrics.observe(self.core.generate(p)) for p in prepared])

    async def _respond(self, request: Request, prepared: list[PreparedRequest], stream: bool, rid: str,
                       collect: Callable, events: Callable) -> Any:
        admission = self.core.admit(len(prepared))  # held until the response ends
        # n choices of one prompt share its token list: the log counts each prompt once, as usage does.
        prompts = {id(p.prompt_token_ids): p.prompt_token_ids for p in prepared}
        prompt_tokens = sum(len(ids) for ids in prompts.values())
        merged = track_tokens(request.scope, prompt_tokens, self._start(prepared))
        headers = {"x-request-id": rid}
        if not stream:
            try:
                body = await cancel_on_disconnect(request.receive, collect(merged))
            finally:
                await merged.aclose()
                admission.release()
            return json_response(body, headers=headers)
        try:
            # Wait for the first output before answering, so a rejected request still gets its status.
            first = await cancel_on_disconnect(request.receive, anext(merged))
        except BaseException:
            await merged.aclose()
            admission.release()
            raise
        return EventStream(events(_prepend(first, merged)), headers, on_close=admission.release)

    async def _stream_end(self, events: AsyncIterator[str], usage_chunk: Callable[[], Any] | None):
        """Wrap an event stream: an engine failure mid-stream becomes an error event; ends with [DONE]."""
        try:
            async for event in events:
                yield event
            if usage_chunk is not None:
                yield sse(usage_chunk())
        except RequestError as e:
            info = api.ErrorInfo(message=e.message, type=ERROR_TYPES.get(e.status, "server_error"), code=e.status)
            yield sse(api.ErrorResponse(info))
        yield SSE_DONE

    # --- /v1/completions ---------------------------------------------------------------------------
    async def completions(self, request: Request):
        req: api.CompletionRequest = await self._parse_generation(request, api.CompletionRequest)
        prompts = [self.core.check_token_ids(p) if isinstance(p, list) else await self.core.tokenize_text(p)
                   for p in _split_prompts(req.prompt)]
        sp = _sampling(req, req.max_tokens, req.logprobs)
        prepared = [self.core.prepare(ids, _choice_sampling(sp, i), priority=req.priority)
                    for ids in prompts for i in range(req.n)]
        rid = self._request_id(request, "cmpl")
        usage = UsageCounter([len(p) for p in prompts], req.n)
        return await self._respond(request, prepared, req.stream, rid,
                                   lambda merged: self._collect_completion(rid, merged, usage, len(prepared)),
                                   lambda merged: self._completion_events(req, rid, merged, usage))

    async def _collect_completion(self, rid: str, merged, usage: UsageCounter, count: int) -> api.CompletionResponse:
        texts = [""] * count
        lps: list[list[TokenLogprobs] | None] = [None] * count
        finals: list[TextDelta | None] = [None] * count
        async for index, delta in merged:
            texts[index] += delta.text
            if delta.logprobs:
                lps[index] = (lps[index] or []) + delta.logprobs
            if delta.finish_reason is not None:
                finals[index] = delta
                usage.add(index, delta)
        choices = [api.CompletionChoice(index=i, text=texts[i], logprobs=self._completion_logprobs(lps[i], 0),
                                        finish_reason=finals[i].finish_reason, stop_reason=finals[i].stop_reason)
                   for i in range(count)]
        return api.CompletionResponse(id=rid, choices=choices, model=self.model_name, usage=usage.info())

    def _completion_events(self, req: api.CompletionRequest, rid: str, merged, usage: UsageCounter):
        async def events():
            offsets: dict[int, int] = {}
            async for index, delta in merged:
                lp = self._completion_logprobs(delta.logprobs, offsets.get(index, 0))
                offsets[index] = offsets.get(index, 0) + len(delta.text)
                if delta.finish_reason is not None:
                    usage.add(index, delta)
                choice = api.CompletionChoice(index=index, text=delta.text, logprobs=lp,
                                              finish_reason=delta.finish_reason, stop_reason=delta.stop_reason)
                yield sse(api.CompletionResponse(id=rid, choices=[choice], model=self.model_name))

        include_usage = req.stream_options is not None and req.stream_options.include_usage
        usage_chunk = (lambda: api.CompletionResponse(id=rid, choices=[], model=self.model_name,
                                                      usage=usage.info())) if include_usage else None
        return self._stream_end(events(), usage_chunk)

    def _completion_logprobs(self, lps: list[TokenLogprobs] | None, offset: int) -> api.CompletionLogprobs | None:
        if lps is None:
            return None
        tokens = [self.token_text(lp.token_id) for lp in lps]
        text_offset = []
        for t in tokens:
            text_offset.append(offset)
            offset += len(t)
        top = [{self.token_text(t.token_id): t.logprob for t in lp.top} for lp in lps]
        return api.CompletionLogprobs(tokens, [lp.logprob for lp in lps], top, text_offset)

    # --- /v1/chat/completions ----------------------------------------------------------------------
    async def chat_completions(self, request: Request):
        req: api.ChatCompletionRequest = await self._parse_generation(request, api.ChatCompletionRequest)
        ids = await self.core.tokenize_chat(_chat_messages(req.messages),
                                            **chat_template_options(req, self.chat_template))
        max_tokens = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
        param = "max_completion_tokens" if req.max_completion_tokens is not None else "max_tokens"
        sp = _sampling(req, max_tokens, (req.top_logprobs or 0) if req.logprobs else None)
        prepared = [self.core.prepare(ids, _choice_sampling(sp, i), priority=req.priority, max_tokens_param=param,
                                      prompt_param="messages") for i in range(req.n)]
        rid = self._request_id(request, "chatcmpl")
        usage = UsageCounter([len(ids)], req.n)
        return await self._respond(request, prepared, req.stream, rid,
                                   lambda merged: self._collect_chat(rid, merged, usage, req.n),
                                   lambda merged: self._chat_events(req, rid, merged, usage))

    async def _collect_chat(self, rid: str, merged, usage: UsageCounter, n: int) -> api.ChatCompletionResponse:
        texts = [""] * n
        lps: list[list[api.TokenLogprobOut] | None] = [None] * n
        finals: list[TextDelta | None] = [None] * n
        async for index, delta in merged:
            texts[index] += delta.text
            if delta.logprobs:
                lps[index] = (lps[index] or []) + self._chat_logprobs(delta.logprobs).content
            if delta.finish_reason is not None:
                finals[index] = delta
                usage.add(index, delta)
        choices = [api.ChatChoice(index=i, message=api.ChatMessageOut(texts[i]),
                                  logprobs=api.ChatLogprobs(lps[i]) if lps[i] is not None else None,
                                  finish_reason=finals[i].finish_reason, stop_reason=finals[i].stop_reason)
                   for i in range(n)]
        return api.ChatCompletionResponse(id=rid, choices=choices, model=self.model_name, usage=usage.info())

    def _chat_events(self, req: api.ChatCompletionRequest, rid: str, merged, usage: UsageCounter):
        model = self.model_name

        async def events():
            yield sse(api.ChatCompletionChunk(id=rid, model=model, choices=[
                api.ChatChunkChoice(index=i, delta=api.DeltaMessage(role="assistant", content=""))
                for i in range(req.n)]))
            async for index, delta in merged:
                if delta.finish_reason is not None:
                    usage.add(index, delta)
                lp = self._chat_logprobs(delta.logprobs) if delta.logprobs else None
                choice = api.ChatChunkChoice(index=index, delta=api.DeltaMessage(content=delta.text), logprobs=lp,
                                             finish_reason=delta.finish_reason, stop_reason=delta.stop_reason)
                yield sse(api.ChatCompletionChunk(id=rid, model=model, choices=[choice]))

        include_usage = req.stream_options is not None and req.stream_options.include_usage
        usage_chunk = (lambda: api.ChatCompletionChunk(id=rid, choices=[], model=model,
                                                       usage=usage.info())) if include_usage else None
        return self._stream_end(events(), usage_chunk)

    def _chat_logprobs(self, lps: list[TokenLogprobs]) -> api.ChatLogprobs:
        def entry(token_id: int, logprob: float) -> tuple[str, float, list[int]]:
            return self.token_text(token_id), logprob, list(self.token_bytes(token_id))

        return api.ChatLogprobs([
            api.TokenLogprobOut(*entry(lp.token_id, lp.logprob),
                                [api.TopLogprobOut(*entry(t.token_id, t.logprob)) for t in lp.top])
            for lp in lps])

    # --- the rest ----------------------------------------------------------------------------------
    async def models(self, request: Request):
        return json_response(api.ModelList([api.ModelCard(self.model_name, self.core.max_model_len)]))

    async def model_card(self, request: Request):
        name = request.path_params["model"]
        if name != self.model_name:
            raise RequestError(404, f"The model `{name}` does not exist; this server serves `{self.model_name}`.",
                               "model")
        return json_response(api.ModelCard(self.model_name, self.core.max_model_len))

    async def health(self, request: Request):
        client = self.core.client
        if not client.healthy:
            raise RequestError(503, f"the engine is unavailable: {client.unavailable_reason}")
        return json_response({"status": "ok"})

    async def version(self, request: Request):
        return json_response({"version": kvloom.__version__})

    async def metrics_endpoint(self, request: Request):
        stats = None
        if self.core.client.healthy:
            with contextlib.suppress(Exception):
                stats = await self.core.client.utility("stats", timeout=5.0)
        body, content_type = self.metrics.render(self.core.client.healthy, stats)
        return Response(body, media_type=content_type)

    async def reset_prefix_cache(self, request: Request):
        self.core.check_available(0)
        try:
            await self.core.client.utility("reset_prefix_cache")
        except RuntimeError as e:
            raise RequestError(400, str(e)) from None
        return json_response({"status": "ok"})


async def _prepend(first, rest: AsyncIterator):
    try:
        yield first
        async for item in rest:
            yield item
    finally:
        await rest.aclose()


def _split_prompts(prompt: str | list[Any]) -> list[str | list[int]]:
    """A completion ``prompt`` is text, token ids, or a batch of either."""
    if isinstance(prompt, str):
        return [prompt]
    if prompt and all(isinstance(p, str) for p in prompt):
        return list(prompt)
    if prompt and all(_is_token_id(p) for p in prompt):
        return [prompt]
    if prompt and all(isinstance(p, list) and p and all(_is_token_id(t) for t in p) for p in prompt):
        return list(prompt)
    raise RequestError(400, "prompt must be a string, a list of strings, a list of token ids or a list of lists "
                       "of token ids, and not empty", "prompt")


def _is_token_id(value: Any) -> bool:
    return type(value) is int  # not bool: JSON true is not token 1


def chat_template_options(req, default_template: str | None) -> dict[str, Any]:
    """A chat or /tokenize request's template options, as ``render_chat_template`` takes them."""
    return dict(chat_template=req.chat_template, default_template=default_template,
                add_generation_prompt=req.add_generation_prompt, continue_final_message=req.continue_final_message,
                chat_template_kwargs=req.chat_template_kwargs)


def _chat_messages(messages: list[api.ChatMessageIn]) -> list[dict[str, Any]]:
    out = []
    for i, m in enumerate(messages):
        content = m.content
        if isinstance(content, list):
            bad = next((p.type for p in content if p.type != "text"), None)
            if bad is not None:
                raise RequestError(400, f"content part type {bad!r} is not supported (only 'text')",
                                   f"messages[{i}].content")
            content = "".join(p.text or "" for p in content)
        out.append({"role": m.role, "content": content or ""})
    return out


# --- process ---------------------------------------------------------------------------------------
def build_app(engine_address: str, engine_config: EngineConfig, server_config: ServerConfig,
              engine_secret: str | None = None) -> Starlette:
    server = OpenAIServer(server_config)

    @contextlib.asynccontextmanager
    async def lifespan(app):
        try:
            server.core = await start_frontend_core(engine_address, engine_config, server_config, engine_secret)
        except EngineUnavailable as e:
            # The engine has logged why (e.g. max_model_len over the model's); a traceback from each
            # worker would only bury that line. The launcher sees this exit and stops the server.
            logger.error("%s", e)
            logging.shutdown()
            os._exit(3)
        server.metrics.set_model(server.core.ready.model_name)
        try:
            yield
        finally:
            await server.core.client.close()

    async def http_error(request: Request, exc: HTTPException) -> Response:
        return error_response(exc.status_code, f"{request.method} {request.url.path}: {exc.detail}")

    app = Starlette(routes=server.routes(), lifespan=lifespan,
                    exception_handlers={404: http_error, 405: http_error},
                    middleware=[Middleware(AccessLog, enabled=server_config.log_requests)])
    app.state.server = server
    return app


def run_server(engine_address: str, engine_config: EngineConfig, server_config: ServerConfig,
               sock: socket.socket | None = None, log_level: str = "info", engine_secret: str | None = None) -> int:
    import uvicorn

    from kvloom.frontends.uvicorn_server import DRAIN_GRACE_S, DrainingServer, header_timeout_protocol

    app = build_app(engine_address, engine_config, server_config, engine_secret)
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
    from kvloom.launcher import start_child

    parser = argparse.ArgumentParser(prog="kvloom-api-server")
    parser.add_argument("--engine-address", required=True)
    parser.add_argument("--fd", type=int, help="An inherited, bound socket to listen on.")
    args, engine, server = start_child(parser, argv)
    sock = socket.socket(fileno=args.fd) if args.fd is not None else None
    return run_server(args.engine_address, engine, server, sock, args.log_level, args.engine_secret)


if __name__ == "__main__":
    sys.exit(main())
