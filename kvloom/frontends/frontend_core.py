"""What every frontend shares: turning text or chats into prompt tokens, the request validation
(validation.py) and admission control, and streaming one completion back as text (through
output.CompletionText, the path kvloom.LLM uses too)."""

from __future__ import annotations

import asyncio
import functools
import itertools
from concurrent.futures import ThreadPoolExecutor
import logging
import time
from typing import Any, AsyncIterator

from kvloom.core.config import EngineConfig
from kvloom.core.messages import EngineReady, TokenDelta
from kvloom.core.sampling_params import SamplingParams
from kvloom.frontends.admission import engine_refusal
from kvloom.frontends.config import ServerConfig
from kvloom.frontends.engine_client import AsyncEngineClient, EngineUnavailable
from kvloom.frontends.errors import RequestError
from kvloom.frontends.limits import PromptLengthBound
from kvloom.frontends.output import CompletionText, TextDelta
from kvloom.frontends.router import EngineRouter
from kvloom.frontends.validation import ModelLimits, PreparedRequest, check_token_ids, validate_request
from kvloom.frontends.text import (
    ChatTemplateError,
    encode_rendered_chat,
    load_tokenizer,
    render_chat_template,
)

logger = logging.getLogger("kvloom.frontend")


TOKENIZER_THREADS = 2
DEADLINE_GRACE_S = 0.5  # the frontend's own wait past a deadline the engine is expected to enforce


class FrontendCore:
    def __init__(self, client: AsyncEngineClient | EngineRouter, tokenizer, ready: EngineReady, *,
                 max_pending_requests: int, request_timeout: float | None = None,
                 queue_timeout: float | None = None) -> None:
        self.client = client
        self.tokenizer = tokenizer
        self.ready = ready
        self.max_pending_requests = max_pending_requests
        self.request_timeout = request_timeout
        self.queue_timeout = queue_timeout
        self._ids = itertools.count()
        self.draining = False
        self.num_admitted = 0  # slots held by admitted requests until their responses end
        self.prompt_bound = PromptLengthBound(tokenizer)
        # The engine's LoRA adapters as last seen (name -> its card): what a request's ``model`` may name.
        self.adapters: dict[str, dict[str, Any]] = {}
        self._refreshing: asyncio.Future | None = None
        # Tokenizing a long prompt takes seconds: never on the event loop, which serves every other client.
        self._tokenizer_pool = ThreadPoolExecutor(TOKENIZER_THREADS, thread_name_prefix="tokenize")

    @property
    def max_model_len(self) -> int:
        return self.ready.max_model_len

    # --- LoRA adapters -----------------------------------------------------------------------------
    async def refresh_adapters(self) -> None:
        """Ask the engine which adapters it serves (one call at a time; concurrent callers share it)."""
        if not self.ready.max_loras or not self.client.healthy:
            return
        if self._refreshing is None:
            self._refreshing = asyncio.ensure_future(self._list_adapters())
        try:
            await asyncio.shield(self._refreshing)
        finally:
            if self._refreshing is not None and self._refreshing.done():
                self._refreshing = None

    async def _list_adapters(self) -> None:
        try:
            cards = await self.client.utility("list_lora_adapters")
        except Exception as e:  # noqa: BLE001 - the names seen so far stay; the request gets its 404 or 503
            logger.warning("Could not list the engine's LoRA adapters: %s", e)
            return
        self.adapters = {card["name"]: card for card in cards}

    # --- prompts -----------------------------------------------------------------------------------
    def encode_text(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self.tokenizer.encode(text, add_special_tokens=add_special_tokens)

    async def tokenize_text(self, text: str, param: str = "prompt", *, add_special_tokens: bool = True,
                            truncated: bool = False) -> list[int]:
        """``encode_text`` off the event loop, after refusing a text that provably cannot fit the context
        (unless the caller truncates the tokens to fit)."""
        if not truncated:
            self.prompt_bound.check(text, self.max_model_len, param)
        encode = functools.partial(self.encode_text, text, add_special_tokens)
        return await asyncio.get_running_loop().run_in_executor(self._tokenizer_pool, encode)

    async def tokenize_chat(self, messages: list[dict[str, Any]], param: str = "messages", *,
                            add_special_tokens: bool = False, truncated: bool = False, **options: Any) -> list[int]:
        """The chat's prompt tokens: ``render_chat`` then ``encode_chat``."""
        text = await self.render_chat(messages, param, **options)
        return await self.encode_chat(text, param, add_special_tokens=add_special_tokens, truncated=truncated)

    async def render_chat(self, messages: list[dict[str, Any]], param: str = "messages", **options: Any) -> str:
        """The chat as the template renders it, off the event loop; ``options`` are ``render_chat_template``'s."""
        render = functools.partial(render_chat_template, self.tokenizer, messages, **options)
        try:
            return await asyncio.get_running_loop().run_in_executor(self._tokenizer_pool, render)
        except ChatTemplateError as e:
            raise RequestError(400, str(e), param if e.param == "messages" else e.param) from e

    async def encode_chat(self, text: str, param: str = "messages", *, add_special_tokens: bool = False,
                          truncated: bool = False) -> list[int]:
        """A rendered chat's tokens, off the event loop, after the same length check as a text prompt's;
        with ``add_special_tokens`` the tokenizer's special tokens go around what the template wrote."""
        if not truncated:
            self.prompt_bound.check(text, self.max_model_len, param)
        loop = asyncio.get_running_loop()
        if add_special_tokens:
            return await loop.run_in_executor(self._tokenizer_pool, self.encode_text, text, True)
        return await loop.run_in_executor(self._tokenizer_pool, encode_rendered_chat, self.tokenizer, text)

    def check_token_ids(self, ids: list[int], param: str = "prompt") -> list[int]:
        return check_token_ids(ids, self.ready.vocab_size, param)

    # --- validation --------------------------------------------------------------------------------
    @property
    def limits(self) -> ModelLimits:
        return ModelLimits(self.ready.max_model_len, self.ready.vocab_size, self.ready.task, self.ready.pooling,
                           self.ready.model_name)

    def prepare(self, prompt_token_ids: list[int], sampling: SamplingParams, *, priority: int = 0,
                max_tokens_param: str = "max_tokens", prompt_param: str = "prompt",
                lora_name: str = "") -> PreparedRequest:
        """The request checked (validation.validate_request) and the engine available; raises RequestError."""
        self.check_available()
        return validate_request(prompt_token_ids, sampling, self.limits, priority=priority,
                                max_tokens_param=max_tokens_param, prompt_param=prompt_param, lora_name=lora_name)

    def start_draining(self) -> None:
        """Refuse new requests (503) from now on; those in flight continue."""
        self.draining = True

    def end_all(self, reason: str) -> None:
        """End every request in flight now with ``reason`` (503); the engine aborts them."""
        if self.client.num_in_flight:
            logger.warning("Ending %d request(s): %s", self.client.num_in_flight, reason)
        self.client.end_all(reason)

    def check_available(self, new_requests: int = 1) -> None:
        if self.draining:
            raise RequestError(503, "the server is shutting down")
        if not self.client.healthy:
            raise RequestError(503, f"the engine is unavailable: {self.client.unavailable_reason}")
        if self.num_admitted + new_requests > self.max_pending_requests:
            raise RequestError(429, f"too many requests in flight ({self.num_admitted} of at most "
                               f"max_pending_requests={self.max_pending_requests}); retry later")

    def admit(self, count: int) -> "Admission":
        """Take ``count`` in-flight slots, or raise 429/503. The check and the taking happen with no await
        between them, so concurrent requests can never admit more than ``max_pending_requests``."""
        self.check_available(count)
        self.num_admitted += count
        return Admission(self, count)

    # --- generation --------------------------------------------------------------------------------
    def next_request_id(self) -> str:
        # The engine sees only ids this frontend made, so clients' ids can never collide.
        return f"{self.client.frontend_id}:{next(self._ids)}"

    async def generate(self, req: PreparedRequest) -> AsyncIterator[TextDelta]:
        """Stream one completion as text. Closing the iterator early aborts it in the engine."""
        sp = req.sampling
        completion = CompletionText(self.tokenizer, sp, len(req.prompt_token_ids))
        timeout = req.timeout if req.timeout is not None else self.request_timeout
        limit = req.timeout_param if req.timeout is not None else "request_timeout"
        now = time.time()
        # The engine enforces both deadlines at its step boundary (and frees the KV blocks there); the
        # wait here, a little later, only covers an engine that cannot answer at all.
        deltas = self.client.generate(
            self.next_request_id(), req.prompt_token_ids, sp, req.priority, now,
            deadline=None if timeout is None else now + timeout, api_key_name=req.api_key_name,
            lora_name=req.lora_name,
            queue_deadline=None if self.queue_timeout is None else now + self.queue_timeout)
        deadline = None if timeout is None else time.monotonic() + timeout + DEADLINE_GRACE_S
        try:
            while True:
                delta = await self._next(deltas, deadline, timeout, limit)
                if delta.finish_reason == "error":
                    if delta.error_kind == "not_found":
                        self.adapters.pop(req.lora_name, None)  # unloaded through another worker
                    raise engine_refusal(delta, timeout, limit, self.queue_timeout)
                out = completion.add(delta)
                if out is None:
                    continue
                yield out
                if out.finish_reason is not None:
                    return  # done, or a stop string (closing ``deltas`` aborts the engine's request)
        finally:
            await deltas.aclose()  # aborts the engine request unless it finished

    async def pool(self, req: PreparedRequest) -> TokenDelta:
        """Run one pooling request (validation.validate_pooling): its only delta, with the vector (or
        scores) in ``embedding``; an engine refusal raises as ``generate``'s does."""
        timeout = req.timeout if req.timeout is not None else self.request_timeout
        limit = req.timeout_param if req.timeout is not None else "request_timeout"
        now = time.time()
        deltas = self.client.generate(
            self.next_request_id(), req.prompt_token_ids, req.sampling, req.priority, now,
            deadline=None if timeout is None else now + timeout, api_key_name=req.api_key_name,
            queue_deadline=None if self.queue_timeout is None else now + self.queue_timeout, pooling=req.pooling)
        deadline = None if timeout is None else time.monotonic() + timeout + DEADLINE_GRACE_S
        try:
            delta = await self._next(deltas, deadline, timeout, limit)
            if delta.finish_reason == "error":
                raise engine_refusal(delta, timeout, limit, self.queue_timeout)
            if delta.embedding is None:
                raise RequestError(503, f"the engine ended a pooling request without a result ({delta.finish_reason})")
            return delta
        finally:
            await deltas.aclose()

    async def pool_many(self, prepared: list[PreparedRequest]) -> list[TokenDelta]:
        """Every input's ``pool`` delta, in order; one failing cancels the rest (aborted in the engine)."""
        tasks = [asyncio.ensure_future(self.pool(p)) for p in prepared]
        try:
            return await asyncio.gather(*tasks)
        finally:
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

    async def _next(self, deltas, deadline: float | None, timeout: float | None, limit: str):
        try:
            if deadline is None:
                return await anext(deltas)
            return await asyncio.wait_for(anext(deltas), max(0.0, deadline - time.monotonic()))
        except asyncio.TimeoutError:
            raise RequestError(408, f"the request did not finish within {limit}={timeout:g}s")
        except EngineUnavailable as e:
            raise RequestError(503, f"the engine is unavailable: {e}") from e


class Admission:
    """Slots taken by ``FrontendCore.admit``; ``release`` (idempotent) gives them back."""

    def __init__(self, core: FrontendCore, count: int) -> None:
        self.core = core
        self.count = count

    def release(self) -> None:
        self.core.num_admitted -= self.count
        self.count = 0


async def merge_streams(streams: list[AsyncIterator[Any]]) -> AsyncIterator[tuple[int, Any]]:
    """Interleave several async iterators as ``(index, item)`` in arrival order. An error in one ends
    all; closing the merged iterator closes every source (so each aborts its engine request)."""
    if len(streams) == 1:
        try:
            async for item in streams[0]:
                yield 0, item
        finally:
            await streams[0].aclose()
        return
    queue: asyncio.Queue = asyncio.Queue()
    done = object()

    async def pump(index: int, stream) -> None:
        try:
            async for item in stream:
                queue.put_nowait((index, item, None))
        except Exception as e:  # noqa: BLE001 - handed to the consumer
            queue.put_nowait((index, None, e))
        finally:
            await stream.aclose()
            queue.put_nowait((index, done, None))

    tasks = [asyncio.create_task(pump(i, s)) for i, s in enumerate(streams)]
    try:
        remaining = len(tasks)
        while remaining:
            index, item, error = await queue.get()
            if error is not None:
                raise error
            if item is done:
                remaining -= 1
            else:
                yield index, item
    finally:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


async def start_frontend_core(engine_address: str | list[str], engine: EngineConfig, server: ServerConfig,
                              secret: str | None = None) -> FrontendCore:
    """Connect to the engine (or, through the router, to each data-parallel replica) while the tokenizer
    loads; returns once it is ready. ``secret`` is the launch's engine secret (see launcher.Launcher)."""
    addresses = [engine_address] if isinstance(engine_address, str) else engine_address
    client = EngineRouter(addresses, heartbeat_timeout=server.engine_heartbeat_timeout, secret=secret,
                          policy=server.routing_policy, reconnect=server.restart_engine)
    connecting = asyncio.create_task(client.start(server.engine_start_timeout))
    try:
        tokenizer = await asyncio.to_thread(load_tokenizer, engine.model, engine.tokenizer)
        ready = await connecting
    except BaseException:
        connecting.cancel()
        await client.close()
        raise
    logger.info("Frontend %s ready (model %s, max_model_len %d)", client.frontend_id, ready.model_name,
                ready.max_model_len)
    return FrontendCore(client, tokenizer, ready, max_pending_requests=server.max_pending_requests,
                        request_timeout=server.request_timeout, queue_timeout=server.queue_timeout)
