"""The HTTP access log: one info line per request on ``kvloom.access`` (client, method, path, status,
the model or LoRA adapter it ran on, prompt and output tokens, time to first token, duration), written
when the response has been sent, so a stream is logged with its real duration and a refusal
(401/4xx/408/429/503) is logged too.
Never the prompt text, the output text or the API key."""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import Any, AsyncIterator

logger = logging.getLogger("kvloom.access")
SCOPE_KEY = "kvloom.access"


@dataclass
class AccessRecord:
    start: float = field(default_factory=time.monotonic)
    status: int | None = None
    prompt_tokens: int | None = None
    output_tokens: dict[int, int] = field(default_factory=dict)  # choice index -> tokens so far
    first_token_at: float | None = None
    model: str | None = None  # the served model or LoRA adapter the request named

    def line(self, scope: dict[str, Any]) -> str:
        client = scope.get("client")
        where = f"{client[0]}:{client[1]}" if client else "-"
        ttft = f"{self.first_token_at - self.start:.3f}s" if self.first_token_at is not None else "-"
        prompt = "-" if self.prompt_tokens is None else self.prompt_tokens
        output = sum(self.output_tokens.values()) if self.prompt_tokens is not None else "-"
        model = f"model={self.model} " if self.model else ""
        return (f'{where} "{scope.get("method", "-")} {scope.get("path", "-")}" {self.status or "-"} '
                f"{model}prompt_tokens={prompt} output_tokens={output} ttft={ttft} "
                f"duration={time.monotonic() - self.start:.3f}s")


class AccessLog:
    """ASGI middleware that writes the line once the response is over (or the client is gone)."""

    def __init__(self, app, enabled: bool = True) -> None:
        self.app = app
        self.enabled = enabled

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http" or not self.enabled:
            await self.app(scope, receive, send)
            return
        record = scope[SCOPE_KEY] = AccessRecord()

        async def send_and_note(message) -> None:
            if message["type"] == "http.response.start":
                record.status = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, send_and_note)
        finally:
            logger.info(record.line(scope))


def note_model(scope: dict[str, Any], model: str) -> None:
    """Name the model (or LoRA adapter) of the request in its access-log line."""
    record: AccessRecord | None = scope.get(SCOPE_KEY)
    if record is not None:
        record.model = model


def note_prompt_tokens(scope: dict[str, Any], prompt_tokens: int) -> None:
    """A request without output tokens (embeddings, scores): its prompt tokens in its access-log line."""
    record: AccessRecord | None = scope.get(SCOPE_KEY)
    if record is not None:
        record.prompt_tokens = prompt_tokens


async def track_tokens(scope: dict[str, Any], prompt_tokens: int,
                       merged: AsyncIterator[tuple[int, Any]]) -> AsyncIterator[tuple[int, Any]]:
    """Pass ``(index, TextDelta)`` through, noting the request's output tokens and first-token time."""
    record: AccessRecord | None = scope.get(SCOPE_KEY)
    if record is None:
        async for item in merged:
            yield item
        return
    record.prompt_tokens = prompt_tokens
    try:
        async for index, delta in merged:
            if delta.num_output_tokens and record.first_token_at is None:
                record.first_token_at = time.monotonic()
            record.output_tokens[index] = delta.num_output_tokens
            yield index, delta
    finally:
        await merged.aclose()
