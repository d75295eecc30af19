"""The default scheduler plugin: first come, first served."""

from __future__ import annotations

from kvloom.core.request import Request
from kvloom.plugins import hookimpl
from kvloom.plugins.info import PluginInfo


class FCFSPolicy:
    """Admit in order of arrival; preempt the newest running request first."""

    name = "fcfs"

    def waiting_order(self, waiting: list[Request], now: float) -> list[Request]:
        return sorted(waiting, key=lambda r: r.arrival_order)

    def select_victim(self, running: list[Request], now: float) -> Request:
        return max(running, key=lambda r: r.arrival_order)


@hookimpl
def kvloom_plugin_info() -> PluginInfo:
    return PluginInfo(kind="scheduler", description="First come, first served; the newest running request "
                                                    "is preempted first.")


@hookimpl
def kvloom_scheduler_policy() -> FCFSPolicy:
    return FCFSPolicy()
