"""The hook specifications of kvloom: the whole contract between the engine and its plugins. Each
docstring is that hook's documentation (docs/plugins.md links here).

A plugin implements ``kvloom_plugin_info`` and the one factory hook of its kind:

=============  ============================  =========================
kind           factory hook                  returns
=============  ============================  =========================
scheduler      ``kvloom_scheduler_policy``   ``SchedulingPolicy``
kv_allocator   ``kvloom_kv_allocator``       ``BlockAllocator``
prefix_cache   ``kvloom_prefix_cache``       ``PrefixCache``
quantization   ``kvloom_quantization``       ``QuantizationMethod``
spec_decode    ``kvloom_spec_proposer``      ``DraftProposer``
=============  ============================  =========================

Only enabled plugins are registered when the engine calls a factory hook, and at most one plugin of
each kind is enabled, so every factory hook is ``firstresult``: its one implementation answers. Every
hookimpl may take any subset of its hook's arguments, by name.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import pluggy

from kvloom.plugins import _PROJECT

if TYPE_CHECKING:
    from kvloom.core.config import EngineConfig
    from kvloom.core.engine.kv_cache import BlockAllocator, PrefixCache
    from kvloom.core.engine.scheduler import SchedulingPolicy
    from kvloom.plugins.info import PluginInfo
    from kvloom.plugins.interfaces import DraftProposer, QuantizationMethod

_hookspec = pluggy.HookspecMarker(_PROJECT)

# The factory hook of each kind (see the table above).
FACTORY_HOOKS = {
    "scheduler": "kvloom_scheduler_policy",
    "kv_allocator": "kvloom_kv_allocator",
    "prefix_cache": "kvloom_prefix_cache",
    "quantization": "kvloom_quantization",
    "spec_decode": "kvloom_spec_proposer",
}


@_hookspec
def kvloom_plugin_info() -> PluginInfo:
    """Describe this plugin: its kind, a one-line description, its options and its conflicts.

    Every plugin implements it. Called once per plugin when plugins are loaded (at engine start-up and
    by ``engine plugins``), whether or not the plugin is enabled, so it must be cheap and must not
    import heavy modules. Not ``firstresult``: the manager reads each plugin's answer separately.

    :return: a ``kvloom.plugins.info.PluginInfo``; ``kind`` must be one of ``kvloom.plugins.info.KINDS``
        and the plugin must implement that kind's factory hook (and no other).
    """


@_hookspec(firstresult=True)
def kvloom_scheduler_policy(config: EngineConfig, options: dict[str, Any]) -> SchedulingPolicy:
    """Create the scheduling policy: the order of the waiting queue and the preemption victim.

    Called once at engine start-up on the enabled scheduler plugin (``fcfs`` unless another is chosen).
    ``firstresult``.

    :param config: the engine configuration (read-only).
    :param options: this plugin's options, every declared option present (defaults filled in).
    :return: an object with the ``kvloom.core.engine.scheduler.SchedulingPolicy`` methods: ``waiting_order``,
        ``select_victim`` and, optionally, ``may_preempt``.
    """


@_hookspec(firstresult=True)
def kvloom_kv_allocator(num_blocks: int, config: EngineConfig, options: dict[str, Any]) -> BlockAllocator:
    """Create the allocator of the paged KV pool: reference-counted blocks ``0 .. num_blocks - 1``.

    Called once at engine start-up, after the KV capacity is known, on the enabled allocator plugin
    (``free_list`` unless another is chosen). ``firstresult``.

    :param num_blocks: blocks in the pool (from the memory profile, ``kv_cache_memory_gib`` or
        ``num_kv_blocks``).
    :param config: the engine configuration (read-only).
    :param options: this plugin's options, defaults filled in.
    :return: a ``kvloom.core.engine.kv_cache.BlockAllocator``; its ``on_evict`` attribute is set afterwards by
        the engine when a prefix cache is enabled.
    """


@_hookspec(firstresult=True)
def kvloom_prefix_cache(block_size: int, config: EngineConfig, options: dict[str, Any]) -> PrefixCache:
    """Create the prefix cache, which lets a new request start from KV blocks that hold its prefix.

    Called once at engine start-up, only when a prefix-cache plugin is enabled (there is none by
    default). ``firstresult``.

    :param block_size: tokens per KV block; only full blocks are cached.
    :param config: the engine configuration (read-only).
    :param options: this plugin's options, defaults filled in.
    :return: a ``kvloom.core.engine.kv_cache.PrefixCache``.
    """


@_hookspec(firstresult=True)
def kvloom_quantization(hf_config: Any, config: EngineConfig, options: dict[str, Any]) -> QuantizationMethod:
    """Create the quantization method that loads and runs the model's linear layers.

    Called once before the model is built, on the enabled quantization plugin: the one ``--plugins`` or
    ``--quantization`` names, or else the built-in plugin (``fp8``, ``awq``, ``gptq``) that the
    checkpoint's ``quantization_config`` names. A built-in plugin checks the checkpoint's settings and
    raises ``ConfigError`` naming the key and the supported values. ``firstresult``.

    :param hf_config: the model's transformers config (its ``quantization_config``, if any, tells the
        checkpoint's format).
    :param config: the engine configuration (read-only).
    :param options: this plugin's options, defaults filled in.
    :return: a ``kvloom.plugins.interfaces.QuantizationMethod``.
    """


@_hookspec(firstresult=True)
def kvloom_spec_proposer(hf_config: Any, config: EngineConfig, options: dict[str, Any]) -> DraftProposer:
    """Create the draft-token proposer for speculative decoding.

    Called once after the target model is loaded, only when a spec_decode plugin is enabled (the
    built-in one is ``spec_decode``). The engine asks the proposer for drafts before each step and
    verifies them with the target in the same batch. Raise ``kvloom.core.config.ConfigError`` for
    options that cannot work: it fails the start-up with your message. ``firstresult``.

    :param hf_config: the target model's transformers config (a draft model must share its vocabulary).
    :param config: the engine configuration (read-only).
    :param options: this plugin's options, defaults filled in.
    :return: a ``kvloom.plugins.interfaces.DraftProposer``.
    """
