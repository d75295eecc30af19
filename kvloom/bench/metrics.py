"""What a load test measures per request, and the summary of one load level: counts, throughput,
TTFT / TPOT / ITL / end-to-end latency (mean, p50, p95, p99) and goodput against SLOs."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np

PERCENTILES = (50, 95, 99)
LATENCIES = ("ttft", "tpot", "itl", "e2e")


@dataclass
class RequestResult:
    """One request, timed from just before it was sent. ``chunk_times`` are the arrival times (seconds
    after the send) of the stream chunks that carried generated tokens."""

    ok: bool = False
    error: str | None = None
    incomplete: bool = False  # still running when the level's --max-duration ran out
    prompt_tokens: int | None = None
    output_tokens: int | None = None
    usage_reported: bool = False
    chunk_times: list[float] = field(default_factory=list)
    e2e: float | None = None
    status: int | None = None  # HTTP status, or the code of a stream's final error event
    error_s: float | None = None  # seconds after the send when a refusal or an error came
    start: float = 0.0  # seconds after the level started
    client: int = 0  # the client process that sent it

    @property
    def ttft(self) -> float | None:
        return self.chunk_times[0] if self.chunk_times else None

    @property
    def itls(self) -> list[float]:
        return list(np.diff(self.chunk_times)) if len(self.chunk_times) > 1 else []

    @property
    def tpot(self) -> float | None:
        """Time per output token after the first: (e2e - ttft) / (output tokens - 1)."""
        if self.e2e is None or self.ttft is None or not self.output_tokens or self.output_tokens < 2:
            return None
        return (self.e2e - self.ttft) / (self.output_tokens - 1)


@dataclass
class SLO:
    """Service-level objectives in milliseconds; None means no limit on that figure."""

    ttft_ms: float | None = None
    tpot_ms: float | None = None
    e2e_ms: float | None = None

    @property
    def given(self) -> bool:
        return any(v is not None for v in (self.ttft_ms, self.tpot_ms, self.e2e_ms))

    def met(self, r: RequestResult) -> bool:
        checks = [(self.ttft_ms, r.ttft), (self.e2e_ms, r.e2e)]
        if r.tpot is not None:  # undefined for a one-token output, which meets any TPOT objective
            checks.append((self.tpot_ms, r.tpot))
        return all(limit is None or (value is not None and value * 1000 <= limit) for limit, value in checks)


# No engine step of a served model is this short: two chunks of one stream closer than this arrived together
# (read in one go by a client behind on its reads, or written at once by a server).
BURST_GAP_S = 0.0002


def distribution_ms(values: list[float]) -> dict[str, float | None]:
    """Mean and percentiles, in milliseconds (None for no values)."""
    if not values:
        return {"mean": None, **{f"p{p}": None for p in PERCENTILES}}
    arr = np.asarray(values, dtype=float) * 1000
    pct = np.percentile(arr, PERCENTILES)
    return {"mean": float(arr.mean()), **{f"p{p}": float(v) for p, v in zip(PERCENTILES, pct)}}


def summarize(results: list[RequestResult], duration: float, slo: SLO | None = None) -> dict[str, Any]:
    """The figures of one load level; ``duration`` is the level's wall time (first send to last answer)."""
    slo = slo or SLO()
    done = [r for r in results if r.ok]
    failed = [r for r in results if not r.ok and not r.incomplete]
    prompt_tokens = sum(r.prompt_tokens or 0 for r in done)
    output_tokens = sum(r.output_tokens or 0 for r in done)
    per_s = (lambda n: n / duration) if duration > 0 else (lambda n: 0.0)
    out: dict[str, Any] = {
        "completed": len(done), "failed": len(failed), "incomplete": sum(r.incomplete for r in results),
        "duration_s": duration,
        "prompt_tokens": prompt_tokens, "output_tokens": output_tokens,
        "usage_reported": all(r.usage_reported for r in done),
        "request_throughput": per_s(len(done)),
        "output_throughput": per_s(output_tokens),
        "total_token_throughput": per_s(prompt_tokens + output_tokens),
        "ttft_ms": distribution_ms([r.ttft for r in done if r.ttft is not None]),
        "tpot_ms": distribution_ms([r.tpot for r in done if r.tpot is not None]),
        "itl_ms": distribution_ms(gaps := [gap for r in done for gap in r.itls]),
        "itl_burst_share": sum(g < BURST_GAP_S for g in gaps) / len(gaps) if gaps else 0.0,
        "e2e_ms": distribution_ms([r.e2e for r in done if r.e2e is not None]),
        "slo": {"ttft_ms": slo.ttft_ms, "tpot_ms": slo.tpot_ms, "e2e_ms": slo.e2e_ms},
        "goodput": per_s(sum(slo.met(r) for r in done)) if slo.given else None,
        "errors": sorted({r.error for r in failed if r.error})[:5],
    }
    return out
