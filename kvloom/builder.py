"""Assembly of an engine from its configuration, one floor above core: the plugin manager picks the parts
(scheduling policy, KV allocator, prefix cache, weight format, proposer) and ``EngineCore`` is handed them."""

from __future__ import annotations

from kvloom.core.config import EngineConfig
from kvloom.core.engine.core import EngineCore
from kvloom.plugins.manager import PluginManager

TP_WORKER_MODULE = "kvloom.launch.tp_worker"  # the process of ranks 1..N-1


def build_engine(config: EngineConfig) -> EngineCore:
    """An ``EngineCore`` for ``config``; an unknown plugin or a conflict between plugins fails before loading."""
    config.validate()
    return EngineCore(config, PluginManager.from_config(config), tp_worker_module=TP_WORKER_MODULE)
