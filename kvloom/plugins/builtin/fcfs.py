"""The default scheduler plugin: first come, first served."""

from __future__ import annotations

from kvloom.core.engine.request import Request
from kvloom.core.engine.scheduler import RankedPolicy
from kvloom.plugins import hookimpl
from kvloom.plugins.info import PluginInfo


class FCFSPolicy(RankedPolicy):
    """Admit in order of arrival; preempt the newest running request first."""

    name = "fcfs"

    def rank(self, request: Request, now: float) -> int:
        return request.arrival_order


@hookimpl
def kvloom_plugin_info() -> PluginInfo:
    return PluginInfo(kind="scheduler", description="First come, first served; the newest running request "
                                                    "is preempted first.")


@hookimpl
def kvloom_scheduler_policy() -> FCFSPolicy:
    return FCFSPolicy()
