"""vLLM's flag names for what kvloom has, so a vLLM launch line works as it is. Most of vLLM's names
are kvloom's own (--max-num-seqs, --max-model-len, --served-model-name, --gpu-memory-utilization,
--max-num-batched-tokens, --dtype, --seed, --host, --port, --api-key, ...); these are the ones that
map onto a differently named kvloom option. Flags for features kvloom lacks stay unknown flags."""

from __future__ import annotations

import argparse

from kvloom.core.config import ConfigError, EngineConfig

PREFIX_CACHE_PLUGIN = "prefix_cache"


def add_vllm_flags(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("vLLM's names for kvloom options (docs/compat.md)")
    group.add_argument("--enable-prefix-caching", dest="vllm_prefix_caching", action=argparse.BooleanOptionalAction,
                       default=argparse.SUPPRESS, help=f"Add (or, with --no-, remove) the {PREFIX_CACHE_PLUGIN} plugin.")
    group.add_argument("--enable-chunked-prefill", dest="vllm_chunked_prefill", action=argparse.BooleanOptionalAction,
                       default=argparse.SUPPRESS, help="kvloom always chunks long prefills; --no- is refused.")
    group.add_argument("--disable-log-requests", dest="log_requests", action="store_false",
                       default=argparse.SUPPRESS, help="The same as --no-log-requests.")
    group.add_argument("--enable-log-requests", dest="log_requests", action="store_true",
                       default=argparse.SUPPRESS, help="The same as --log-requests (on by default).")
    group.add_argument("--disable-uvicorn-access-log", dest="log_requests", action="store_false",
                       default=argparse.SUPPRESS, help="The same as --no-log-requests (kvloom's access log "
                       "is the only one).")
    group.add_argument("--api-server-count", dest="api_workers", type=int, metavar="N", default=argparse.SUPPRESS,
                       help="The same as --api-workers.")
    group.add_argument("--disable-log-stats", dest="stats_log_interval", action="store_const", const=0.0,
                       default=argparse.SUPPRESS, help="The same as --stats-log-interval 0.")


def apply_vllm_flags(args: argparse.Namespace, config: EngineConfig) -> EngineConfig:
    """``config`` with the vLLM flags that change it (after the config file and kvloom's own flags)."""
    if getattr(args, "vllm_chunked_prefill", True) is False:
        raise ConfigError("--no-enable-chunked-prefill: kvloom always chunks prefills over "
                          "max_num_batched_tokens (raise --max-num-batched-tokens to chunk less)")
    enable = getattr(args, "vllm_prefix_caching", None)
    if enable is True and PREFIX_CACHE_PLUGIN not in config.plugins:
        config = config.replace(plugins=[*config.plugins, PREFIX_CACHE_PLUGIN])
    elif enable is False:
        config = config.replace(plugins=[p for p in config.plugins if p != PREFIX_CACHE_PLUGIN])
    return config
