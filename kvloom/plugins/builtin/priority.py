"""Scheduler plugin ``priority``: requests with a lower ``priority`` value run first and are preempted last."""

from __future__ import annotations

from typing import Any

from kvloom.core.engine.request import Request
from kvloom.core.engine.scheduler import RankedPolicy
from kvloom.plugins import hookimpl
from kvloom.plugins.info import PluginInfo, PluginOption


class PriorityPolicy(RankedPolicy):
    """Order by (priority, arrival); the victim is the lowest-priority (largest value), newest request.
    With ``preempt_for_waiting``, a waiting request that cannot get KV blocks preempts running requests
    of strictly lower priority instead of waiting for them to finish."""

    name = "priority"

    def __init__(self, preempt_for_waiting: bool = True) -> None:
        self.preempt_for_waiting = preempt_for_waiting

    def rank(self, request: Request, now: float) -> tuple[int, int]:
        return (request.priority, request.arrival_order)

    def may_preempt(self, waiting: Request, running: Request) -> bool:
        # Strictly lower priority only: equals never preempt each other, so nothing thrashes.
        return self.preempt_for_waiting and waiting.priority < running.priority


@hookimpl
def kvloom_plugin_info() -> PluginInfo:
    return PluginInfo(
        kind="scheduler",
        description="Per-request priority (lower value first; AddRequest.priority, LLM.generate(priority=...), "
                    "the OpenAI 'priority' field); lower priority is preempted first.",
        options=(PluginOption("preempt_for_waiting", True, "A waiting request that cannot get KV blocks "
                              "preempts running requests of lower priority."),),
    )


@hookimpl
def kvloom_scheduler_policy(options: dict[str, Any]) -> PriorityPolicy:
    return PriorityPolicy(**options)
