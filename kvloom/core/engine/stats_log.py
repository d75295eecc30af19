"""The engine's periodic stats line (like vLLM's): prompt and generation throughput, running and
waiting requests, KV-cache use and the prefix-cache hit rate, logged every ``stats_log_interval``
seconds while the engine has work."""

from __future__ import annotations

import logging
import time

from kvloom.core.messages import EngineStats

logger = logging.getLogger("kvloom.engine.stats")


class EngineStatsLog:
    def __init__(self, interval_s: float) -> None:
        self.interval_s = interval_s
        self._since = time.monotonic()
        self._scheduled = 0
        self._generated = 0
        self._hits = self._queries = 0

    def record_step(self, scheduled_tokens: int, generated_tokens: int) -> None:
        self._scheduled += scheduled_tokens
        self._generated += generated_tokens

    def maybe_log(self, stats_fn) -> None:
        """Log a line if the interval has passed and anything ran or waits; ``stats_fn`` is called only then."""
        if self.interval_s <= 0:
            return
        now = time.monotonic()
        elapsed = now - self._since
        if elapsed < self.interval_s:
            return
        stats: EngineStats = stats_fn()
        if self._scheduled or stats.num_running or stats.num_waiting:
            logger.info(self.line(stats, elapsed))
        self._since, self._scheduled, self._generated = now, 0, 0
        self._hits, self._queries = stats.prefix_cache_hits, stats.prefix_cache_queries

    def line(self, stats: EngineStats, elapsed: float) -> str:
        # Scheduled tokens are prompt tokens plus one per decoding sequence; the latter are the generated ones.
        prompt = max(0, self._scheduled - self._generated)
        queries = stats.prefix_cache_queries - self._queries
        hit_rate = (stats.prefix_cache_hits - self._hits) / queries if queries > 0 else 0.0
        return (f"Engine stats: prompt throughput {prompt / elapsed:.1f} tokens/s, generation throughput "
                f"{self._generated / elapsed:.1f} tokens/s, running {stats.num_running} reqs, waiting "
                f"{stats.num_waiting} reqs, KV cache {100 * stats.kv_usage:.1f}% used, prefix cache hit rate "
                f"{100 * hit_rate:.1f}%")
