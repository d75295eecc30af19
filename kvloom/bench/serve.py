"""``engine bench serve``: a load generator for any OpenAI-compatible endpoint, by fixed concurrency or by
Poisson request rate, streaming every response (SSE) to time its tokens. A sweep runs one level after
another; every level is bounded by a request count and a duration."""

from __future__ import annotations

import asyncio
import os
import time
from dataclasses import asdict, dataclass, field
from typing import Any

import httpx
from tqdm.auto import tqdm

from kvloom.bench.clients import (
    MAX_CLIENT_PROCESSES,
    ClientLoad,
    RequestCounter,
    client_count,
    drive,
    run_level_in_processes,
    split_level,
)
from kvloom.bench.metrics import SLO, RequestResult, summarize
from kvloom.bench.request import timed_request
from kvloom.bench.workloads import BenchRequest, Workload

MAX_REQUESTS_PER_LEVEL = 100_000
MAX_DURATION_S = 24 * 3600.0


@dataclass
class LoadSpec:
    """How to load the server. Exactly one of ``concurrency`` / ``request_rate`` lists the sweep levels."""

    base_url: str = "http://127.0.0.1:8000"
    model: str | None = None  # default: the first model /v1/models lists
    api_key: str | None = None
    num_requests: int = 32  # per level
    concurrency: list[int] = field(default_factory=list)
    request_rate: list[float] = field(default_factory=list)  # requests/s; inf sends all at once
    max_concurrency: int | None = None  # cap on requests in flight in rate mode
    max_duration_s: float = 600.0  # per level: no request starts after it, in-flight ones are cut off
    request_timeout_s: float = 600.0
    warmup_requests: int = 1  # sent one by one before the first level, not counted
    ignore_eos: bool = True
    sampling: dict[str, Any] = field(default_factory=lambda: {"temperature": 0.0})
    slo: SLO = field(default_factory=SLO)
    client_processes: int | None = None  # per level; default: one per 64 streams, at most the available cores
    save_requests: bool = False  # keep every request's record (chunk times included) in the result
    progress: bool = True

    def validate(self) -> None:
        if not self.base_url.startswith(("http://", "https://")):
            raise ValueError(f"--base-url {self.base_url!r} must start with http:// or https://")
        if not 1 <= self.num_requests <= MAX_REQUESTS_PER_LEVEL:
            raise ValueError(f"--num-requests={self.num_requests} must be in [1, {MAX_REQUESTS_PER_LEVEL}]")
        if not 0 < self.max_duration_s <= MAX_DURATION_S:
            raise ValueError(f"--max-duration={self.max_duration_s} must be in (0, {MAX_DURATION_S:g}] seconds")
        if self.request_timeout_s <= 0:
            raise ValueError(f"--request-timeout={self.request_timeout_s} must be > 0")
        if bool(self.concurrency) == bool(self.request_rate):
            raise ValueError("give exactly one of --concurrency and --request-rate (each a level or a list to sweep)")
        if any(c < 1 for c in self.concurrency):
            raise ValueError(f"--concurrency {self.concurrency}: every level must be >= 1")
        if any(not r > 0 for r in self.request_rate):
            raise ValueError(f"--request-rate {self.request_rate}: every level must be > 0 (inf: all at once)")
        if self.max_concurrency is not None and self.max_concurrency < 1:
            raise ValueError(f"--max-concurrency={self.max_concurrency} must be >= 1")
        if self.client_processes is not None and not 1 <= self.client_processes <= MAX_CLIENT_PROCESSES:
            raise ValueError(f"--client-processes={self.client_processes} must be in [1, {MAX_CLIENT_PROCESSES}]")
        if not 0 <= self.warmup_requests <= 100:
            raise ValueError(f"--warmup-requests={self.warmup_requests} must be in [0, 100]")

    @property
    def root(self) -> str:
        return self.base_url.rstrip("/").removesuffix("/v1")

    @property
    def headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}

    def levels(self) -> list[dict[str, Any]]:
        if self.concurrency:
            return [{"concurrency": c} for c in self.concurrency]
        return [{"request_rate": r, "max_concurrency": self.max_concurrency} for r in self.request_rate]


def level_name(level: dict[str, Any]) -> str:
    if "concurrency" in level:
        return f"concurrency {level['concurrency']}"
    return f"rate {level['request_rate']:g}/s"


# --- one level --------------------------------------------------------------------------------------
async def run_level(spec: LoadSpec, endpoint: str, bodies: list[tuple[dict[str, Any], int | None]],
                    level: dict[str, Any], seed: int = 0) -> tuple[list[RequestResult], float, list[ClientLoad]]:
    """Send the request ``bodies`` (each with its prompt length, if known) at ``level``, split over the
    level's client processes (one runs here, in this event loop); returns the results of the requests
    sent, the level's wall time and each client's CPU load."""
    n = client_count(level, len(bodies), spec.client_processes)
    shares = split_level(level, n, len(bodies), seed)
    bar = tqdm(total=len(bodies), desc=level_name(level), unit="req", disable=not spec.progress, leave=False)
    if n == 1:
        counter = RequestCounter(len(bodies), shares[0].quota)
        results, load = await drive(spec, endpoint, bodies, shares[0], counter, time.monotonic(),
                                    on_done=lambda: bar.update(1))
        loads = [load]
    else:
        def progress(started: int) -> None:
            bar.update(min(started, len(bodies)) - bar.n)

        results, loads = await asyncio.to_thread(run_level_in_processes, spec, endpoint, bodies, shares, progress)
    bar.close()
    ends = [r.start + r.e2e for r in results if r.e2e is not None]
    duration = max(ends) if ends and not any(r.incomplete for r in results) else max(c.wall_s for c in loads)
    return results, duration, loads


async def _first_model(spec: LoadSpec) -> str:
    async with httpx.AsyncClient(timeout=30) as client:
        resp = await client.get(spec.root + "/v1/models", headers=spec.headers)
        resp.raise_for_status()
        return resp.json()["data"][0]["id"]


async def _warm_up(spec: LoadSpec, endpoint: str, bodies: list[tuple[dict[str, Any], int | None]]) -> None:
    async with httpx.AsyncClient(timeout=spec.request_timeout_s) as client:
        for body, prompt_len in bodies:
            result = RequestResult()
            await timed_request(client, spec, endpoint, body, result, prompt_len)
            if not result.ok:
                raise RuntimeError(f"warm-up request failed: {result.error}")


def request_bodies(spec: LoadSpec, endpoint: str, model: str, requests: list[BenchRequest]
                   ) -> list[tuple[dict[str, Any], int | None]]:
    """The JSON bodies, made before the load starts (a bad workload fails here, not in every request)."""
    return [(r.body(endpoint, model, spec.ignore_eos, spec.sampling), r.prompt_len) for r in requests]


async def run_sweep_async(spec: LoadSpec, workload: Workload, on_level=None) -> dict[str, Any]:
    spec.validate()
    model = spec.model or await _first_model(spec)
    requests = workload.requests(spec.num_requests)
    bodies = request_bodies(spec, workload.endpoint, model, requests)
    if spec.warmup_requests:
        warm = Workload(**{**asdict(workload), "seed": workload.seed + 1_000_003, "_file_rows": []})
        await _warm_up(spec, workload.endpoint,
                       request_bodies(spec, workload.endpoint, model, warm.requests(spec.warmup_requests)))
    levels = []
    for i, level in enumerate(spec.levels()):
        results, duration, loads = await run_level(spec, workload.endpoint, bodies, level, seed=workload.seed + i)
        summary = {"level": level, **summarize(results, duration, spec.slo),
                   # this (client) host's 1-minute load average after the level: a busy shared CPU shows here
                   "host_load_average": round(os.getloadavg()[0], 2),
                   **client_report(loads)}
        if spec.save_requests:
            summary["requests"] = [asdict(r) for r in results]
        levels.append(summary)
        if on_level is not None:
            on_level(summary)
    config = {k: v for k, v in asdict(spec).items() if k not in ("api_key", "progress", "slo")}
    return {"target": spec.root, "model": model, "workload": workload.describe(), "load": config,
            "expected_output_tokens": sum(r.output_len for r in requests) if spec.ignore_eos else None,
            "levels": levels}


def client_report(loads: list[ClientLoad]) -> dict[str, Any]:
    """How busy the load generator was: a client process busy for most of a core times its own work."""
    return {"client_processes": len(loads), "clients": [c.as_dict() for c in loads],
            "client_busy_max": round(max(c.busy for c in loads), 3),
            "client_lag_p90_ms": max(c.lag_p90_ms for c in loads),
            "client_saturated": any(c.saturated for c in loads),
            "client_cpu_wait_max": max((c.cpu_wait_share or 0.0 for c in loads), default=0.0),
            "host_busy": any(c.host_busy for c in loads)}


def run_sweep(spec: LoadSpec, workload: Workload, on_level=None) -> dict[str, Any]:
    return asyncio.run(run_sweep_async(spec, workload, on_level))
