"""Prometheus metrics of one frontend process: its requests and tokens, plus the engine's gauges (KV
blocks, queue lengths) fetched from the engine at scrape time."""

from __future__ import annotations

import time
from typing import Any, AsyncIterator

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, Histogram, generate_latest

# EngineStats field -> (metric name, help)
ENGINE_GAUGES = {
    "num_running": ("kvloom_num_requests_running", "Requests the engine is running."),
    "num_waiting": ("kvloom_num_requests_waiting", "Requests waiting for the engine."),
    "num_free_blocks": ("kvloom_kv_cache_free_blocks", "Free KV-cache blocks."),
    "num_total_blocks": ("kvloom_kv_cache_total_blocks", "All KV-cache blocks."),
    "kv_usage": ("kvloom_kv_cache_usage_ratio", "Fraction of KV-cache blocks in use."),
    "num_preemptions": ("kvloom_num_preemptions", "Preemptions since the engine started."),
    "prefix_cache_queries": ("kvloom_prefix_cache_queries", "Prefix-cache lookups (tokens)."),
    "prefix_cache_hits": ("kvloom_prefix_cache_hits", "Prefix-cache hits (tokens)."),
    "spec_decode_num_drafts": ("kvloom_spec_decode_num_draft_tokens", "Draft tokens verified (speculative decoding)."),
    "spec_decode_num_accepted": ("kvloom_spec_decode_num_accepted_tokens", "Draft tokens the target accepted."),
    "spec_decode_num_steps": ("kvloom_spec_decode_num_verify_steps", "Request-steps that verified drafts."),
}


class FrontendMetrics:
    def __init__(self) -> None:
        r = self.registry = CollectorRegistry()
        self.requests = Counter("kvloom_http_requests", "HTTP requests by path and status.", ["path", "status"],
                                registry=r)
        self.prompt_tokens = Counter("kvloom_prompt_tokens", "Prompt tokens sent to the engine.", registry=r)
        self.generation_tokens = Counter("kvloom_generation_tokens", "Tokens generated.", registry=r)
        self.ttft = Histogram("kvloom_time_to_first_token_seconds", "Time to the first generated token.",
                              buckets=(0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60), registry=r)
        self.latency = Histogram("kvloom_request_latency_seconds", "Time from arrival to the last token.",
                                 buckets=(0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300), registry=r)
        self.engine_healthy = Gauge("kvloom_engine_healthy", "1 while the engine process is up.", registry=r)
        self.engine = {field: Gauge(name, help, registry=r) for field, (name, help) in ENGINE_GAUGES.items()}
        self.spec_acceptance = Gauge("kvloom_spec_decode_acceptance_rate",
                                     "Accepted / verified draft tokens since the engine started.", registry=r)
        self.spec_length = Gauge("kvloom_spec_decode_mean_acceptance_length",
                                 "Tokens per verifying request-step (accepted drafts + 1).", registry=r)

    def count_request(self, path: str, status: int) -> None:
        self.requests.labels(path, str(status)).inc()

    async def observe(self, deltas: AsyncIterator[Any]) -> AsyncIterator[Any]:
        """Pass a completion's TextDeltas through, recording TTFT, latency and token counts."""
        start = time.monotonic()
        counted = 0
        first = False
        try:
            async for delta in deltas:
                if not first and delta.num_output_tokens:
                    first = True
                    self.ttft.observe(time.monotonic() - start)
                self.generation_tokens.inc(delta.num_output_tokens - counted)
                counted = delta.num_output_tokens
                if delta.finish_reason is not None:
                    self.latency.observe(time.monotonic() - start)
                yield delta
        finally:
            await deltas.aclose()

    def render(self, healthy: bool, stats: dict[str, Any] | None) -> tuple[bytes, str]:
        self.engine_healthy.set(1 if healthy else 0)
        stats = stats or {}
        for field, gauge in self.engine.items():
            gauge.set(stats.get(field, 0))
        drafts, accepted = stats.get("spec_decode_num_drafts", 0), stats.get("spec_decode_num_accepted", 0)
        steps = stats.get("spec_decode_num_steps", 0)
        self.spec_acceptance.set(accepted / drafts if drafts else 0.0)
        self.spec_length.set(1.0 + accepted / steps if steps else 0.0)
        return generate_latest(self.registry), CONTENT_TYPE_LATEST
