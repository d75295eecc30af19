"""Prometheus metrics of the HTTP frontends: requests, tokens, latencies (TTFT, TPOT, ITL, end to end)
and finish reasons, summed over every API worker (prometheus_client's multiprocess mode, which the
launcher turns on), plus the engine's own counters and gauges fetched from the engine at scrape time
and served once. Every series carries a ``model`` label (the model that served the request, or the LoRA
adapter it named; the first model for requests that name none); the engine's series also a ``replica``
label (its index among the model's data-parallel replicas)."""

from __future__ import annotations

import os
import time
from typing import Any, AsyncIterator, NamedTuple

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily

from kvloom.core.engine.gate import QUEUE_WAIT_BUCKETS

# prometheus_client reads this variable itself; the launcher sets it for its API workers so their
# counters land in one shared directory (it is plumbing between our processes, not a user setting).
MULTIPROC_ENV = "PROMETHEUS_MULTIPROC_DIR"

# EngineStats field -> (metric name, help); the engine's totals since it started.
ENGINE_COUNTERS = {
    "num_preemptions": ("kvloom_num_preemptions", "Preemptions since the engine started."),
    "prefix_cache_queries": ("kvloom_prefix_cache_queries", "Prompt tokens looked up in the prefix cache."),
    "prefix_cache_hits": ("kvloom_prefix_cache_hits", "Prompt tokens served from the prefix cache."),
    "spec_decode_num_drafts": ("kvloom_spec_decode_num_draft_tokens", "Draft tokens verified (speculative decoding)."),
    "spec_decode_num_accepted": ("kvloom_spec_decode_num_accepted_tokens", "Draft tokens the target accepted."),
    "spec_decode_num_steps": ("kvloom_spec_decode_num_verify_steps", "Request-steps that verified drafts."),
    "num_rejected_queue_full": ("kvloom_engine_rejected_queue_full", "Requests the engine refused at a full queue "
                                "(max_queued_requests / max_queued_tokens)."),
    "num_expired_in_queue": ("kvloom_engine_expired_in_queue", "Requests dropped unrun at queue_timeout or "
                             "their deadline."),
    "num_expired_running": ("kvloom_engine_expired_running", "Requests stopped at their deadline while running."),
    "lora_slot_loads": ("kvloom_lora_slot_loads", "LoRA adapters moved into a device slot."),
}
ENGINE_GAUGES = {
    "num_running": ("kvloom_num_requests_running", "Requests the engine is running."),
    "num_waiting": ("kvloom_num_requests_waiting", "Requests waiting for the engine."),
    "num_waiting_tokens": ("kvloom_num_tokens_waiting", "Prompt tokens waiting for the engine."),
    "num_free_blocks": ("kvloom_kv_cache_free_blocks", "Free KV-cache blocks."),
    "num_total_blocks": ("kvloom_kv_cache_total_blocks", "All KV-cache blocks."),
    "kv_usage": ("kvloom_kv_cache_usage_ratio", "Fraction of KV-cache blocks in use."),
    "lora_loaded": ("kvloom_lora_adapters_loaded", "LoRA adapters the engine serves by name."),
}
LATENCY_BUCKETS = (0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300)
TTFT_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60)
TOKEN_GAP_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75, 1, 2.5, 5)
PHASE_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300)
# Per-request token counts, 1-2-5 steps as vLLM's (a request longer than the last lands in +Inf).
TOKEN_COUNT_BUCKETS = tuple(m * 10**e for e in range(6) for m in (1, 2, 5))


ENGINE_LABELS = ["model", "replica"]


class EngineSample(NamedTuple):
    """One engine's state at a scrape: ``stats`` is None when it could not be asked (down or hung)."""

    model: str
    replica: int
    healthy: bool
    stats: dict[str, Any] | None


class _EngineCollector:
    """One engine's stats of one scrape as Prometheus families (counters end in ``_total``). An engine
    that could not be asked has only its ``kvloom_engine_healthy`` 0: no figure beats a made-up zero."""

    def __init__(self, sample: EngineSample) -> None:
        self.labels = [sample.model, str(sample.replica)]
        self.healthy, self.stats = sample.healthy, sample.stats

    def collect(self):
        health = GaugeMetricFamily("kvloom_engine_healthy", "1 while the engine process is up.", labels=ENGINE_LABELS)
        health.add_metric(self.labels, 1 if self.healthy else 0)
        yield health
        if self.stats is None:
            return
        for field, (name, help) in ENGINE_COUNTERS.items():
            family = CounterMetricFamily(name, help, labels=ENGINE_LABELS)
            family.add_metric(self.labels, self.stats.get(field, 0))
            yield family
        for field, (name, help) in ENGINE_GAUGES.items():
            family = GaugeMetricFamily(name, help, labels=ENGINE_LABELS)
            family.add_metric(self.labels, self.stats.get(field, 0))
            yield family
        limited = CounterMetricFamily("kvloom_engine_rate_limited", "Requests the engine refused over their API "
                                      "key's quota, by key name.", labels=[*ENGINE_LABELS, "api_key"])
        for key, count in sorted((self.stats.get("num_rate_limited") or {}).items()):
            limited.add_metric([*self.labels, key], count)
        yield limited
        counts = self.stats.get("queue_wait_buckets") or [0] * (len(QUEUE_WAIT_BUCKETS) + 1)
        cumulative, total = [], 0
        for bound, count in zip([*map(str, QUEUE_WAIT_BUCKETS), "+Inf"], counts):
            total += count
            cumulative.append((bound, total))
        wait = HistogramMetricFamily("kvloom_queue_wait_seconds", "Time from arrival to the first step, in the "
                                     "engine's queue.", labels=ENGINE_LABELS)
        wait.add_metric(self.labels, cumulative, self.stats.get("queue_wait_sum", 0.0))
        yield wait
        for field, name, help in (
            ("lora_running", "kvloom_lora_requests_running", "Running requests by LoRA adapter."),
            ("lora_waiting", "kvloom_lora_requests_waiting", "Waiting requests by LoRA adapter."),
        ):
            family = GaugeMetricFamily(name, help, labels=[*ENGINE_LABELS, "lora_adapter"])
            for adapter, count in sorted((self.stats.get(field) or {}).items()):
                family.add_metric([*self.labels, adapter], count)
            yield family
        drafts, accepted = self.stats.get("spec_decode_num_drafts", 0), self.stats.get("spec_decode_num_accepted", 0)
        steps = self.stats.get("spec_decode_num_steps", 0)
        for name, help, value in (
            ("kvloom_spec_decode_acceptance_rate", "Accepted / verified draft tokens since the engine started.",
             accepted / drafts if drafts else 0.0),
            ("kvloom_spec_decode_mean_acceptance_length", "Tokens per verifying request-step (accepted drafts + 1).",
             1.0 + accepted / steps if steps else 0.0),
        ):
            family = GaugeMetricFamily(name, help, labels=ENGINE_LABELS)
            family.add_metric(self.labels, value)
            yield family


class _EngineCollectors:
    """Every engine's families (each model's replicas), merged so each family is written once with a
    sample per engine."""

    def __init__(self, engines: list[EngineSample]) -> None:
        self.collectors = [_EngineCollector(e) for e in engines]

    def collect(self):
        families: dict[str, Any] = {}
        for collector in self.collectors:
            for family in collector.collect():
                if family.name in families:
                    families[family.name].samples.extend(family.samples)
                else:
                    families[family.name] = family
        yield from families.values()


class FrontendMetrics:
    def __init__(self) -> None:
        self.multiprocess = bool(os.environ.get(MULTIPROC_ENV))
        r = self.registry = CollectorRegistry()
        self.model = ""
        self.requests = Counter("kvloom_http_requests", "HTTP requests by path and status.",
                                ["path", "status", "model"], registry=r)
        self._prompt_tokens = Counter("kvloom_prompt_tokens", "Prompt tokens sent to the engine.", ["model"],
                                      registry=r)
        self._generation_tokens = Counter("kvloom_generation_tokens", "Tokens generated.", ["model"], registry=r)
        self._finished = Counter("kvloom_request_success", "Completions finished, by finish reason.",
                                 ["finished_reason", "model"], registry=r)
        self._ttft = Histogram("kvloom_time_to_first_token_seconds", "Time to the first generated token.", ["model"],
                               buckets=TTFT_BUCKETS, registry=r)
        self._tpot = Histogram("kvloom_time_per_output_token_seconds", "Per completion: time after the first "
                               "token divided by the tokens after it.", ["model"], buckets=TOKEN_GAP_BUCKETS,
                               registry=r)
        self._itl = Histogram("kvloom_inter_token_latency_seconds", "Time between successive output tokens.",
                              ["model"], buckets=TOKEN_GAP_BUCKETS, registry=r)
        self._rejections = Counter("kvloom_rejections", "Requests answered with an error status, by reason "
                                   "(bad_request, unauthorized, too_many_in_flight, queue_full, rate_limited, "
                                   "deadline, unavailable) and API key name.", ["reason", "api_key", "model"],
                                   registry=r)
        self._key_requests = Counter("kvloom_api_key_requests", "Generation requests admitted, by API key name.",
                                     ["api_key", "model"], registry=r)
        self._key_tokens = Counter("kvloom_api_key_tokens", "Tokens by API key name and kind (prompt, completion).",
                                   ["api_key", "kind", "model"], registry=r)
        self._latency = Histogram("kvloom_request_latency_seconds", "Time from arrival to the last token.",
                                  ["model"], buckets=LATENCY_BUCKETS, registry=r)
        # vLLM's per-request series (vllm:request_prompt_tokens, ...; docs/compat.md maps them)
        self._request_prompt = Histogram("kvloom_request_prompt_tokens", "Prompt tokens of each finished "
                                         "completion.", ["model"], buckets=TOKEN_COUNT_BUCKETS, registry=r)
        self._request_generation = Histogram("kvloom_request_generation_tokens", "Tokens generated by each "
                                             "finished completion.", ["model"], buckets=TOKEN_COUNT_BUCKETS,
                                             registry=r)
        self._request_max_generation = Histogram(
            "kvloom_request_max_num_generation_tokens", "Per prompt of a request: the most tokens any of its n "
            "completions generated.", ["model"], buckets=TOKEN_COUNT_BUCKETS, registry=r)
        self._prefill_time = Histogram("kvloom_request_prefill_time_seconds", "Per completion: the engine's time "
                                       "from its first step to its first token.", ["model"], buckets=PHASE_BUCKETS,
                                       registry=r)
        self._decode_time = Histogram("kvloom_request_decode_time_seconds", "Per completion: time from its first "
                                      "token to its last.", ["model"], buckets=PHASE_BUCKETS, registry=r)

    def set_model(self, model: str, served: list[str] = ()) -> None:
        """Name the first served model (known once its engine is ready): the label of requests that
        name no model, or fail before one is known. Every served model's token counters and latency
        histograms are written from the start, at zero, so a scrape before the first request already
        has them (a labelled series otherwise appears only once it is used)."""
        self.model = model
        for name in [model, *served]:
            for series in (self._prompt_tokens, self._generation_tokens, self._ttft, self._tpot, self._itl,
                           self._latency, self._request_prompt, self._request_generation,
                           self._request_max_generation, self._prefill_time, self._decode_time):
                series.labels(name)

    def count_prompt_tokens(self, count: int, model: str | None = None) -> None:
        self._prompt_tokens.labels(model or self.model).inc(count)

    def count_request(self, path: str, status: int, model: str | None = None) -> None:
        self.requests.labels(path, str(status), model or self.model).inc()

    def count_rejection(self, reason: str, api_key: str, model: str | None = None) -> None:
        self._rejections.labels(reason, api_key, model or self.model).inc()

    async def count_key_usage(self, api_key: str, prompt_tokens: int, merged: AsyncIterator[Any],
                              model: str | None = None) -> AsyncIterator[Any]:
        """Pass ``(index, TextDelta)`` items through, counting the key's request and tokens once it ends."""
        model = model or self.model
        completion: dict[int, int] = {}
        try:
            async for index, delta in merged:
                completion[index] = delta.num_output_tokens
                yield index, delta
        finally:
            await merged.aclose()
            # Only if it ran (a client gone mid-stream included): a refusal (429, or 408 before its first
            # step) raises before any output, and kvloom_rejections counts it instead.
            if completion:
                self._key_requests.labels(api_key, model).inc()
                self._key_tokens.labels(api_key, "prompt", model).inc(prompt_tokens)
                self._key_tokens.labels(api_key, "completion", model).inc(sum(completion.values()))

    def count_pooled(self, prompt_tokens: list[int], latency: float, api_key: str | None, model: str | None = None
                     ) -> None:
        """Pooling requests (embeddings, scores) that ran: one finished request per input, no generated
        tokens; their key's request and prompt tokens as a generation's are counted."""
        model = model or self.model
        for n in prompt_tokens:
            self._finished.labels("stop", model).inc()
            self._request_prompt.labels(model).observe(n)
            self._request_generation.labels(model).observe(0)
            self._latency.labels(model).observe(latency)
        if api_key is not None:
            self._key_requests.labels(api_key, model).inc()
            self._key_tokens.labels(api_key, "prompt", model).inc(sum(prompt_tokens))

    async def observe(self, deltas: AsyncIterator[Any], model: str | None = None) -> AsyncIterator[Any]:
        """Pass a completion's TextDeltas through, recording its latencies, tokens and finish reason
        under ``model``'s label."""
        model = model or self.model
        ttft, itl, tpot = self._ttft.labels(model), self._itl.labels(model), self._tpot.labels(model)
        latency, generation_tokens = self._latency.labels(model), self._generation_tokens.labels(model)
        start = time.monotonic()
        counted = 0
        first_at = last_at = None
        try:
            async for delta in deltas:
                now = time.monotonic()
                if delta.prefill_time is not None:
                    self._prefill_time.labels(model).observe(delta.prefill_time)
                new = delta.num_output_tokens - counted
                if new > 0:
                    if first_at is None:
                        first_at = now
                        ttft.observe(now - start)
                    else:
                        for _ in range(new):  # tokens that arrive together share the wait
                            itl.observe((now - last_at) / new)
                    last_at = now
                    generation_tokens.inc(new)
                    counted = delta.num_output_tokens
                if delta.finish_reason is not None:
                    latency.observe(now - start)
                    if first_at is not None and counted > 1:
                        tpot.observe((now - first_at) / (counted - 1))
                    if first_at is not None:
                        self._decode_time.labels(model).observe(now - first_at)
                    self._request_prompt.labels(model).observe(delta.num_prompt_tokens)
                    self._request_generation.labels(model).observe(counted)
                    self._finished.labels(delta.finish_reason, model).inc()
                yield delta
        finally:
            await deltas.aclose()

    async def observe_prompts(self, merged: AsyncIterator[Any], groups: list[int],
                              model: str | None = None) -> AsyncIterator[Any]:
        """Pass a request's ``(index, TextDelta)`` items through; once it ends, record for each prompt
        (``groups[index]``: the prompt of choice ``index``) the most tokens one of its finished
        completions generated."""
        model = model or self.model
        most: dict[int, int] = {}
        try:
            async for index, delta in merged:
                if delta.finish_reason is not None:
                    group = groups[index]
                    most[group] = max(most.get(group, 0), delta.num_output_tokens)
                yield index, delta
        finally:
            await merged.aclose()
            for count in most.values():
                self._request_max_generation.labels(model).observe(count)

    def render(self, engines: list[EngineSample]) -> tuple[bytes, str]:
        """The frontends' series (every API worker's) and ``engines``' (each served model's replicas)."""
        if self.multiprocess:
            from prometheus_client import multiprocess

            frontends = CollectorRegistry()
            multiprocess.MultiProcessCollector(frontends)
        else:
            frontends = self.registry
        engine = CollectorRegistry()
        engine.register(_EngineCollectors(engines))
        return generate_latest(frontends) + generate_latest(engine), CONTENT_TYPE_LATEST
