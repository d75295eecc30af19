"""Scheduler plugin ``sjf``: shortest prompt first, with aging so that long prompts are not starved."""

from __future__ import annotations

from typing import Any

from kvloom.core.config import ConfigError
from kvloom.core.engine.request import Request
from kvloom.core.engine.scheduler import RankedPolicy
from kvloom.plugins import hookimpl
from kvloom.plugins.info import PluginInfo, PluginOption


class ShortestPromptFirstPolicy(RankedPolicy):
    """Order by prompt length minus ``aging_tokens_per_s`` for every second waited since arrival: a
    request's place improves steadily while it waits, so a long prompt overtakes newer short ones after
    (its length - theirs) / aging_tokens_per_s seconds. The victim is the request that would be admitted
    last by the same measure."""

    name = "sjf"

    def __init__(self, aging_tokens_per_s: float = 100.0) -> None:
        self.aging_tokens_per_s = aging_tokens_per_s

    def rank(self, request: Request, now: float) -> tuple[float, int]:
        waited = now - request.arrival_time
        return (request.num_prompt_tokens - self.aging_tokens_per_s * waited, request.arrival_order)


@hookimpl
def kvloom_plugin_info() -> PluginInfo:
    return PluginInfo(
        kind="scheduler",
        description="Shortest prompt first, with aging so that long prompts are not starved.",
        options=(PluginOption("aging_tokens_per_s", 100.0, "Prompt tokens a waiting request is credited per "
                              "second it has waited (0 disables aging: long prompts may starve)."),),
    )


@hookimpl
def kvloom_scheduler_policy(options: dict[str, Any]) -> ShortestPromptFirstPolicy:
    if options["aging_tokens_per_s"] < 0:
        raise ConfigError(f"sjf option aging_tokens_per_s={options['aging_tokens_per_s']} must be >= 0")
    return ShortestPromptFirstPolicy(**options)
