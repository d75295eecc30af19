"""A kvloom scheduler plugin, ``shortest_output``: requests with the smallest output budget (``max_tokens``)
run first, so short answers are not stuck behind long generations; a request that has waited
``max_wait_s`` goes ahead of every newer one, so long generations still start."""

from __future__ import annotations

from typing import Any

from kvloom.core.engine.request import Request
from kvloom.core.engine.scheduler import RankedPolicy
from kvloom.plugins import hookimpl
from kvloom.plugins.info import PluginInfo, PluginOption


class ShortestOutputFirst(RankedPolicy):
    """RankedPolicy admits in ascending rank and preempts the highest rank first."""

    name = "shortest_output"

    def __init__(self, max_wait_s: float) -> None:
        self.max_wait_s = max_wait_s

    def rank(self, request: Request, now: float) -> tuple:
        if now - request.arrival_time >= self.max_wait_s:
            return (0, request.arrival_order)  # overdue: oldest first, ahead of everything else
        return (1, request.max_tokens, request.arrival_order)


@hookimpl
def kvloom_plugin_info() -> PluginInfo:
    return PluginInfo(
        kind="scheduler",
        description="Smallest output budget (max_tokens) first; requests waiting max_wait_s go first.",
        options=(PluginOption("max_wait_s", 30.0, "Seconds after which a waiting request goes ahead of "
                              "all newer ones."),),
    )


@hookimpl
def kvloom_scheduler_policy(options: dict[str, Any]) -> ShortestOutputFirst:
    return ShortestOutputFirst(options["max_wait_s"])
