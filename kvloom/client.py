"""Python client of the ZMQ gateway (``engine --gateway ADDRESS``): ``AsyncClient`` is for asyncio, and
``Client``, which blocks, runs one on a loop of its own. Both stream text chunks or return a whole completion::

    with Client("ipc:///tmp/kvloom.sock") as client:
        print(client.generate("The capital of France is", max_tokens=16, temperature=0).text)
        for chunk in client.stream(messages=[{"role": "user", "content": "Hi!"}], max_tokens=32):
            print(chunk.text, end="", flush=True)

Sampling options are ``SamplingParams`` fields (``max_tokens``, ``temperature``, ``top_p``, ``stop``,
``seed``, ``logprobs``, ...). ``prompt_logprobs=N`` scores the prompt too (what loglikelihood evaluations
read): the first chunk, and the ``Completion``, carry ``prompt_logprobs``.
"""

from __future__ import annotations

import asyncio
import itertools
import os
import threading
import weakref
from collections import deque
from dataclasses import dataclass, field
from typing import Any, AsyncIterator, Iterator

import zmq
import zmq.asyncio

from kvloom.core.messages import (
    Cancel,
    ChatMessage,
    Embed,
    Embeddings,
    Generate,
    Ping,
    Pong,
    RequestFailed,
    TextChunk,
    TokenLogprobs,
    Usage,
    decode_gateway_reply,
    encode,
)
from kvloom.core.sampling_params import SamplingParams

__all__ = ["AsyncClient", "Client", "Completion", "GatewayError", "TextChunk"]


class GatewayError(RuntimeError):
    """A request failed; ``status`` follows HTTP (400 bad request, 429 busy, 503 engine unavailable)."""

    def __init__(self, message: str, status: int, request_id: str = "") -> None:
        super().__init__(f"{message} (status {status})")
        self.message = message
        self.status = status
        self.request_id = request_id


@dataclass
class Completion:
    request_id: str
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    finish_reason: str | None = None
    stop_reason: str | int | None = None
    usage: Usage | None = None
    logprobs: list[TokenLogprobs] | None = None
    # prompt_logprobs=N: prompt tokens 1.. scored (the first has no context), each with its rank and top N
    prompt_logprobs: list[TokenLogprobs] | None = None

    def add(self, chunk: TextChunk) -> None:
        self.text += chunk.text
        self.token_ids.extend(chunk.token_ids)
        if chunk.prompt_logprobs is not None:
            self.prompt_logprobs = chunk.prompt_logprobs
        if chunk.logprobs:
            self.logprobs = (self.logprobs or []) + chunk.logprobs
        if chunk.finish_reason is not None:
            self.finish_reason, self.stop_reason, self.usage = chunk.finish_reason, chunk.stop_reason, chunk.usage


_ids = itertools.count()


def _generate_message(prompt: str | None, messages: list[dict[str, str]] | None, prompt_token_ids: list[int] | None,
                      request_id: str | None, priority: int, model: str | None, sampling: dict[str, Any],
                      api_key: str | None) -> Generate:
    return Generate(
        request_id=request_id or f"{os.getpid()}-{next(_ids)}", model=model, prompt=prompt,
        messages=None if messages is None else [ChatMessage(role=m["role"], content=m["content"]) for m in messages],
        prompt_token_ids=prompt_token_ids, sampling=SamplingParams(**sampling), priority=priority, api_key=api_key,
    )


def _claim(inbox: dict, request_id: str) -> str:
    if request_id in inbox:
        raise ValueError(f"request id {request_id!r} is already in flight on this client")
    return request_id


def _end_stream(sock: zmq.Socket, inbox: dict, request_id: str, finished: bool) -> None:
    del inbox[request_id]
    if not finished:  # the caller stopped reading early: stop the request in the engine too
        sock.send(encode(Cancel(request_id=request_id)))


def _check(reply: TextChunk | RequestFailed) -> TextChunk:
    if isinstance(reply, RequestFailed):
        raise GatewayError(reply.message, reply.status, reply.request_id)
    return reply


def _socket(ctx: zmq.Context, address: str) -> zmq.Socket:
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(address)
    return sock


def _no_reply(address: str, timeout: float | None) -> TimeoutError:
    return TimeoutError(f"no reply from the kvloom gateway at {address} within {timeout:g}s")


class Client:
    """A blocking client: an ``AsyncClient`` on an event loop of its own, in a background thread. One thread
    at a time; several streams may be open and read in turn. ``timeout`` is the longest wait for the next
    reply (None: forever); ``api_key`` goes with every request (a gateway of a server with API keys requires one)."""

    def __init__(self, address: str, *, timeout: float | None = 300.0, api_key: str | None = None) -> None:
        self._loop = asyncio.new_event_loop()
        thread = threading.Thread(target=self._loop.run_forever, name="kvloom-client", daemon=True)
        thread.start()

        async def connect() -> AsyncClient:  # its sockets belong to the loop that uses them
            return AsyncClient(address, timeout=timeout, api_key=api_key)

        self._client = asyncio.run_coroutine_threadsafe(connect(), self._loop).result()
        # close(), or the collection of a client never closed, closes the connection and ends the thread
        self._finalizer = weakref.finalize(self, _shut_down, self._loop, thread, self._client)

    @property
    def address(self) -> str:
        return self._client.address

    @property
    def api_key(self) -> str | None:
        return self._client.api_key

    @property
    def timeout(self) -> float | None:
        return self._client.timeout

    @timeout.setter
    def timeout(self, value: float | None) -> None:
        self._client.timeout = value

    def stream(self, prompt: str | None = None, *, messages: list[dict[str, str]] | None = None,
               prompt_token_ids: list[int] | None = None, request_id: str | None = None, priority: int = 0,
               model: str | None = None, **sampling: Any) -> Iterator[TextChunk]:
        """Yield the request's text chunks; the last has ``finish_reason`` and ``usage``. Stopping early
        cancels the request. ``model``: a served model's name (``ping().models``); None: the first."""
        chunks = self._client.stream(prompt, messages=messages, prompt_token_ids=prompt_token_ids,
                                     request_id=request_id, priority=priority, model=model, **sampling)
        try:
            while True:
                try:
                    chunk = self._run(_next(chunks))
                except StopAsyncIteration:
                    return
                yield chunk
        finally:
            if self._finalizer.alive:
                self._run(chunks.aclose())  # a stream left early cancels its request

    def generate(self, prompt: str | None = None, **kwargs: Any) -> Completion:
        """The whole completion (see ``stream`` for the arguments)."""
        return self._run(self._client.generate(prompt, **kwargs))

    def embed(self, inputs: str | list[str] | list[list[int]], **kwargs: Any) -> Embeddings:
        """One vector per input (see ``AsyncClient.embed``)."""
        return self._run(self._client.embed(inputs, **kwargs))

    def ping(self) -> Pong:
        return self._run(self._client.ping())

    def _run(self, coro):
        if not self._finalizer.alive:
            coro.close()
            raise RuntimeError("the client is closed")
        future = asyncio.run_coroutine_threadsafe(coro, self._loop)
        try:
            return future.result()
        except BaseException:
            if future.cancel():  # interrupted (Ctrl-C): stop the call in the loop too, and let it unwind there
                asyncio.run_coroutine_threadsafe(asyncio.sleep(0), self._loop).result()
            raise

    def close(self) -> None:
        self._finalizer()

    def __enter__(self) -> "Client":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


async def _next(chunks: AsyncIterator[TextChunk]) -> TextChunk:
    return await chunks.__anext__()


def _shut_down(loop: asyncio.AbstractEventLoop, thread: threading.Thread, client: "AsyncClient") -> None:
    if thread.is_alive():
        asyncio.run_coroutine_threadsafe(client.close(), loop).result()
        loop.call_soon_threadsafe(loop.stop)
        thread.join()
    loop.close()


class AsyncClient:
    """An asyncio client: any number of concurrent streams over one connection (arguments as ``Client``'s)."""

    def __init__(self, address: str, *, timeout: float | None = 300.0, api_key: str | None = None) -> None:
        self.address = address
        self.timeout = timeout
        self.api_key = api_key
        self._ctx = zmq.asyncio.Context()
        self._sock = _socket(self._ctx, address)
        self._inbox: dict[str, asyncio.Queue] = {}
        self._pongs: deque[asyncio.Future] = deque()
        self._reader: asyncio.Task | None = None

    async def stream(self, prompt: str | None = None, *, messages: list[dict[str, str]] | None = None,
                     prompt_token_ids: list[int] | None = None, request_id: str | None = None, priority: int = 0,
                     model: str | None = None, **sampling: Any) -> AsyncIterator[TextChunk]:
        """Yield the request's text chunks; the last has ``finish_reason`` and ``usage``. Stopping early
        cancels the request. ``model``: a served model's name (``ping().models``); None: the first."""
        msg = _generate_message(prompt, messages, prompt_token_ids, request_id, priority, model, sampling,
                                self.api_key)
        rid, queue = self._open(msg.request_id)
        finished = False
        try:
            await self._sock.send(encode(msg))
            while not finished:
                chunk = _check(await self._reply(queue))
                finished = chunk.finish_reason is not None
                yield chunk
        finally:
            _end_stream(self._sock, self._inbox, rid, finished)

    async def generate(self, prompt: str | None = None, **kwargs: Any) -> Completion:
        """The whole completion (see ``stream`` for the arguments)."""
        out = None
        async for chunk in self.stream(prompt, **kwargs):
            out = out or Completion(chunk.request_id)
            out.add(chunk)
        return out

    async def embed(self, inputs: str | list[str] | list[list[int]], *, model: str | None = None,
                    dimensions: int | None = None, normalize: bool | None = None, priority: int = 0,
                    request_id: str | None = None) -> Embeddings:
        """Embed texts (a string or a list) or token-id lists with an embedding model; raises GatewayError
        (with the gateway's status) when refused."""
        texts = [inputs] if isinstance(inputs, str) else list(inputs)
        ids = bool(texts) and all(isinstance(t, list) for t in texts)
        msg = Embed(request_id=request_id or f"{os.getpid()}-{next(_ids)}", model=model, input=None if ids else texts,
                    input_token_ids=texts if ids else None, dimensions=dimensions, normalize=normalize,
                    priority=priority, api_key=self.api_key)
        rid, queue = self._open(msg.request_id)
        finished = False
        try:
            await self._sock.send(encode(msg))
            reply = await self._reply(queue)
            finished = True
            if isinstance(reply, RequestFailed):
                raise GatewayError(reply.message, reply.status, reply.request_id)
            return reply
        finally:
            _end_stream(self._sock, self._inbox, rid, finished)

    def _open(self, request_id: str) -> tuple[str, asyncio.Queue]:
        """Claim ``request_id`` on this client and the queue its replies arrive in."""
        rid = _claim(self._inbox, request_id)
        self._start_reader()
        queue = self._inbox[rid] = asyncio.Queue()
        return rid, queue

    async def _reply(self, queue: asyncio.Queue):
        try:
            return await asyncio.wait_for(queue.get(), self.timeout)
        except asyncio.TimeoutError:
            raise _no_reply(self.address, self.timeout) from None

    async def ping(self) -> Pong:
        self._start_reader()
        future = asyncio.get_running_loop().create_future()
        self._pongs.append(future)
        await self._sock.send(encode(Ping()))
        try:
            return await asyncio.wait_for(future, self.timeout)
        except asyncio.TimeoutError:
            raise _no_reply(self.address, self.timeout) from None

    def _start_reader(self) -> None:
        if self._reader is None:
            self._reader = asyncio.create_task(self._read())

    async def _read(self) -> None:
        while True:
            reply = decode_gateway_reply(await self._sock.recv())
            if isinstance(reply, Pong):
                while self._pongs:
                    future = self._pongs.popleft()
                    if not future.done():
                        future.set_result(reply)
                        break
            elif reply.request_id in self._inbox:
                self._inbox[reply.request_id].put_nowait(reply)
            elif isinstance(reply, RequestFailed) and not reply.request_id:
                # a refusal the gateway could not tie to a request (an oversized or unreadable message):
                # every caller waiting on this connection gets it rather than a timeout
                for queue in self._inbox.values():
                    queue.put_nowait(reply)
                while self._pongs:
                    future = self._pongs.popleft()
                    if not future.done():
                        future.set_exception(GatewayError(reply.message, reply.status))

    async def close(self) -> None:
        if self._reader is not None:
            self._reader.cancel()
            await asyncio.gather(self._reader, return_exceptions=True)
        self._sock.close(linger=0)
        self._ctx.term()

    async def __aenter__(self) -> "AsyncClient":
        return self

    async def __aexit__(self, *exc) -> None:
        await self.close()
