"""One timed streaming request of a load test: chunk arrival times, usage and errors into a ``RequestResult``."""

from __future__ import annotations

import asyncio
import json
import time
from typing import TYPE_CHECKING, Any

import httpx

from kvloom.bench.metrics import RequestResult

if TYPE_CHECKING:
    from kvloom.bench.serve import LoadSpec


def _is_token_chunk(choice: dict[str, Any], endpoint: str) -> bool:
    """A chunk that carries generated tokens (its text may be empty while a multi-byte character is
    incomplete). Chat streams open with a role-only chunk that carries none."""
    if endpoint == "chat":
        delta = choice.get("delta") or {}
        return "role" not in delta or bool(delta.get("content"))
    return "text" in choice


async def send_request(client: httpx.AsyncClient, spec: LoadSpec, endpoint: str, body: dict[str, Any],
                       result: RequestResult, prompt_len: int | None) -> None:
    """Stream one request into ``result`` (filled as chunks arrive, so a cut-off request keeps what came)."""
    path = "/v1/chat/completions" if endpoint == "chat" else "/v1/completions"
    sent = time.perf_counter()
    result.prompt_tokens = prompt_len
    chunks = 0
    async with client.stream("POST", spec.root + path, json=body, headers=spec.headers,
                             timeout=spec.request_timeout_s) as resp:
        result.status = resp.status_code
        if resp.status_code != 200:
            text = (await resp.aread()).decode(errors="replace")
            result.error = f"HTTP {resp.status_code}: {text[:200]}"
            result.error_s = time.perf_counter() - sent
            return
        async for line in resp.aiter_lines():
            if not line.startswith("data:"):
                continue
            data = line[5:].strip()
            if data == "[DONE]":
                result.e2e = time.perf_counter() - sent
                break
            event = json.loads(data)
            if "error" in event:
                result.error = f"stream error: {str(event['error'])[:200]}"
                result.error_s = time.perf_counter() - sent
                code = event["error"].get("code") if isinstance(event["error"], dict) else None
                result.status = code if isinstance(code, int) else result.status
                return
            choices = event.get("choices") or []
            if choices and _is_token_chunk(choices[0], endpoint):
                result.chunk_times.append(time.perf_counter() - sent)
                chunks += 1
            if event.get("usage"):
                result.prompt_tokens = event["usage"].get("prompt_tokens", prompt_len)
                result.output_tokens = event["usage"].get("completion_tokens")
                result.usage_reported = True
    if result.e2e is None:
        result.error = "the stream ended without [DONE]"
        return
    if not result.usage_reported:
        result.output_tokens = chunks  # no usage from the server: one token per chunk
    result.ok = True


async def timed_request(client: httpx.AsyncClient, spec: LoadSpec, endpoint: str, body: dict[str, Any],
                        result: RequestResult, prompt_len: int | None) -> None:
    """``send_request`` bounded by --request-timeout in total; any failure is recorded, never raised."""
    try:
        await asyncio.wait_for(send_request(client, spec, endpoint, body, result, prompt_len), spec.request_timeout_s)
    except asyncio.TimeoutError:
        result.error = f"no complete answer within --request-timeout={spec.request_timeout_s:g}s"
    except Exception as e:  # a load test records a bad answer and goes on
        result.error = f"{type(e).__name__}: {e}"[:200]
