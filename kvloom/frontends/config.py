"""Serving options (HTTP server, ZMQ gateway, admission control), typed like ``EngineConfig``: the
``engine`` flags and the config file's serving keys are generated from it."""

from __future__ import annotations

import dataclasses
import ipaddress
import os
import re
import types
import typing
from dataclasses import dataclass, fields
from typing import Any

from kvloom.core.config import ConfigError, _opt

LOOPBACK = "127.0.0.1"
ROUTING_POLICIES = ("prefix_affinity", "least_loaded", "round_robin")


def check_field_types(config) -> None:
    """Raise ConfigError naming the first field of the dataclass ``config`` whose value has the wrong
    type (a config file's ``port = "abc"`` or ``api_workers = 1.5``), before any range check runs."""
    hints = typing.get_type_hints(type(config))
    for f in fields(config):
        value = getattr(config, f.name)
        hint = hints[f.name]
        allowed = typing.get_args(hint) if typing.get_origin(hint) in (typing.Union, types.UnionType) else (hint,)
        if not any(_has_type(value, t) for t in allowed):
            names = " or ".join(_TYPE_NAMES.get(typing.get_origin(t) or t, str(t)) for t in allowed)
            raise ConfigError(f"{f.name}={value!r} must be {names}")


_TYPE_NAMES = {int: "an integer", float: "a number", str: "a string", bool: "true or false", list: "a list",
               dict: "a table", type(None): "unset"}


def _has_type(value: Any, t: Any) -> bool:
    if t is type(None):
        return value is None
    if t in (int, float) and isinstance(value, bool):  # TOML true is not 1
        return False
    if t is float:
        return isinstance(value, (int, float))
    return isinstance(value, typing.get_origin(t) or t)


_TCP_ADDRESS = re.compile(r"tcp://(\*|\[[0-9A-Fa-f:.]+\]|[A-Za-z0-9_.-]+):(\*|[0-9]{1,5})")


def check_zmq_address(name: str, address: str) -> None:
    """Raise ConfigError unless ``address`` is a bindable ipc://PATH or tcp://HOST:PORT (checked
    before any process starts, so a typo never costs a model load)."""
    if address.startswith("ipc://"):
        path = address[len("ipc://"):]
        if not path:
            raise ConfigError(f"{name}={address!r}: give a socket path, e.g. ipc:///tmp/kvloom.sock")
        if len(path.encode()) > 107:  # sockaddr_un.sun_path
            raise ConfigError(f"{name}={address!r}: the path has {len(path.encode())} bytes, over the 107 an "
                              "ipc:// socket path may have")
        folder = os.path.dirname(os.path.abspath(path))
        if not os.path.isdir(folder):
            raise ConfigError(f"{name}={address!r}: the folder {folder} does not exist")
        return
    match = _TCP_ADDRESS.fullmatch(address)
    if address.startswith("tcp://") and match is not None:
        port = match.group(2)
        if port == "*" or 1 <= int(port) <= 65535:
            return
        raise ConfigError(f"{name}={address!r}: the port must be in [1, 65535] (or *)")
    raise ConfigError(f"{name}={address!r} must be ipc://PATH or tcp://HOST:PORT")


def zmq_address_is_loopback(address: str) -> bool:
    """ipc:// is local; tcp://HOST:PORT is loopback for 127.x, ::1 and localhost (``*`` is every interface)."""
    if not address.startswith("tcp://"):
        return True
    host = address[len("tcp://"):].rsplit(":", 1)[0].strip("[]")
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return host == "localhost"


@dataclass
class ServerConfig:
    """How the frontends serve. Field docs are the CLI help."""

    host: str = _opt(LOOPBACK, "Address the HTTP server listens on (0.0.0.0 exposes it to the network).")
    port: int = _opt(8000, "HTTP port.")
    api_workers: int = _opt(1, "HTTP frontend processes, all feeding the one engine process.")
    api_key: str | None = _opt(None, "Require 'Authorization: Bearer KEY' on /v1 routes (put it in the "
                               "config file to keep it out of the process list).")
    data_parallel_size: int = _opt(1, "Engine processes of the model (replicas), one per GPU (CUDA_VISIBLE_DEVICES "
                                   "per engine; on the CPU, processes that share the cores); the frontends "
                                   "route between them.")
    routing_policy: str = _opt("prefix_affinity", "How frontends pick a replica: prefix_affinity (the one that "
                               "served the prompt's first KV blocks, unless overloaded; else the least loaded), "
                               "least_loaded, or round_robin.",
                               choices=ROUTING_POLICIES)
    ray_address: str | None = _opt(None, "Run the data-parallel replicas as Ray actors on this Ray cluster (local: a "
                                   "cluster of this machine, started and stopped with the server; auto; or "
                                   "ray://HOST:PORT); with --device cuda each replica gets one GPU. Needs kvloom[ray].")
    served_model_name: str | None = _opt(None, "The model name clients use (default: --model as given).")
    chat_template: str | None = _opt(None, "A Jinja chat template (a file, or the template itself) used instead "
                                     "of the model's; a request's own chat_template wins.")
    log_requests: bool = _opt(True, "Log one line per HTTP request (method, path, status, tokens, TTFT, "
                              "duration; never the prompt or the key).")
    gateway: str | None = _opt(None, "Also serve the ZMQ gateway for non-HTTP services at this address, "
                               "e.g. ipc:///tmp/kvloom.sock or tcp://127.0.0.1:5557.")
    engine_address: str | None = _opt(None, "ZeroMQ address of the engine process (default: ipc:// in a "
                                      "private temp dir; tcp://127.0.0.1:PORT for TCP).")
    max_pending_requests: int = _opt(1024, "Most requests one frontend process keeps in flight; more are "
                                     "refused with 429.")
    request_timeout: float | None = _opt(None, "Seconds a request may run before it is stopped (408); a request's "
                                         "own 'timeout' may shorten it. The deadline travels to the engine, "
                                         "which stops the request there and frees its KV blocks.")
    queue_timeout: float | None = _opt(None, "Most seconds a request may wait in the engine's queue before its "
                                       "first step; past it the engine drops it unrun (408).")
    max_queued_requests: int | None = _opt(None, "Most requests waiting in the engine's queue, for the whole "
                                           "server however many API workers; more are refused at once with 429 "
                                           "and Retry-After.")
    max_queued_tokens: int | None = _opt(None, "Most prompt tokens waiting in the engine's queue (whole server); "
                                         "more are refused with 429 and Retry-After.")
    api_keys: list = _opt([], "API keys with quotas, as [[api_keys]] tables in the config file (key or "
                          "key_sha256, name, requests_per_minute, tokens_per_minute, max_concurrent, priority); "
                          "docs/admission.md. As a flag, JSON (keep keys out of the process list: prefer the file).")
    gateway_require_api_key: bool | None = _opt(None, "Whether the ZMQ gateway requires an API key "
                                                "(Generate.api_key) from api_key/api_keys. Unset: whenever "
                                                "keys are configured, as the HTTP server does; false serves "
                                                "the gateway without keys or their quotas (warned about on "
                                                "TCP).")
    gateway_max_unread: int = _opt(100_000, "Replies the ZMQ gateway queues for a client that does not read "
                                   "them; past that, the client's requests are stopped and each ends with "
                                   "RequestFailed (429) once it reads again.")
    drain_timeout: float = _opt(60.0, "Seconds SIGTERM waits for in-flight requests before stopping them.")
    engine_start_timeout: float = _opt(900.0, "Seconds frontends wait for the engine to load the model.")
    engine_heartbeat_timeout: float | None = _opt(30.0, "Seconds frontends wait for a sign of life from the "
                                                  "engine before treating it as hung: /health 503, in-flight "
                                                  "requests end with an error, new ones get 503, until it "
                                                  "beats again.")
    restart_engine: bool = _opt(False, "Restart the engine process when it dies; the frontends reconnect and "
                                "serve again (requests in flight end with 503). Without it, the server ends the "
                                "requests in flight with 503 and exits non-zero at once, for its supervisor to "
                                "restart it.")
    http_header_timeout: float = _opt(10.0, "Seconds an HTTP client has to send a request's line and headers; "
                                      "slower connections are closed.")
    http_body_timeout: float = _opt(60.0, "Seconds an HTTP client has to send a request's body once its "
                                    "headers are in (408 beyond).")
    http_keep_alive_timeout: float = _opt(5.0, "Seconds an idle keep-alive HTTP connection stays open.")
    http_limit_concurrency: int | None = _opt(4096, "Most HTTP connections and requests one API worker holds "
                                              "at once; beyond it new requests get 503 (none: no limit).")
    tool_call_parser: str | None = _opt(None, "How tool calls are read from the model's output with "
                                        "tool_choice='auto': hermes (Hermes, Qwen <tool_call>) or llama3_json.")
    enable_auto_tool_choice: bool = _opt(False, "Let the model decide whether to call a tool (tool_choice='auto'); "
                                         "needs --tool-call-parser.")
    reasoning_parser: str | None = _opt(None, "Split a reasoning model's <think>...</think> from its answer: "
                                        "reasoning_content in chat, reasoning items in /v1/responses, thinking "
                                        "blocks in /v1/messages (qwen3 or deepseek_r1).")
    structured_outputs_in_reasoning: bool = _opt(False, "With a reasoning parser, let a structured output (a "
                                                 "schema, regex, choice or forced tool call) constrain the reasoning "
                                                 "too (vLLM's enable_in_reasoning); off: the grammar starts after "
                                                 "</think>, unless the prompt has closed the block already.")
    responses_store_path: str | None = _opt(None, "An SQLite file that keeps /v1/responses' stored responses "
                                            "(store, previous_response_id), shared by every API worker; unset: "
                                            "memory (with several API workers, a file in the server's private "
                                            "temporary directory).")
    responses_store_max_entries: int = _opt(10000, "Most stored /v1/responses responses; the oldest go first.")
    responses_store_max_mb: float = _opt(256.0, "Most MiB of stored /v1/responses responses (each with its "
                                         "conversation); the oldest go first.")
    responses_store_max_age: float = _opt(86400.0, "Seconds a stored /v1/responses response is kept.")
    max_request_body_mb: float = _opt(16.0, "Largest HTTP request body (and gateway message) in MiB; larger "
                                      "ones are refused with 413 before they are parsed.")

    def validate(self) -> None:
        check_field_types(self)
        if not 0 <= self.port <= 65535:
            raise ConfigError(f"port={self.port} must be in [0, 65535]")
        for name in ("api_workers", "max_pending_requests", "data_parallel_size", "max_queued_requests",
                     "max_queued_tokens", "gateway_max_unread", "responses_store_max_entries"):
            if getattr(self, name) is not None and getattr(self, name) < 1:
                raise ConfigError(f"{name}={getattr(self, name)} must be >= 1")
        from kvloom.frontends.admission import parse_api_keys

        keys = parse_api_keys(self.api_keys, self.api_key)
        if self.gateway_require_api_key and not keys:
            raise ConfigError("gateway_require_api_key is set but no api_key or [[api_keys]] is configured")
        for name in ("request_timeout", "queue_timeout", "drain_timeout", "engine_start_timeout", "max_request_body_mb",
                     "engine_heartbeat_timeout", "http_header_timeout", "http_body_timeout",
                     "http_keep_alive_timeout", "http_limit_concurrency", "responses_store_max_age",
                     "responses_store_max_mb"):
            value = getattr(self, name)
            if value is not None and value <= 0:
                raise ConfigError(f"{name}={value} must be > 0")
        for name in ("gateway", "engine_address"):
            value = getattr(self, name)
            if value is not None:
                check_zmq_address(name, value)
        from kvloom.frontends.tool_parsers import TOOL_CALL_PARSERS

        if self.tool_call_parser is not None and self.tool_call_parser not in TOOL_CALL_PARSERS:
            raise ConfigError(f"tool_call_parser={self.tool_call_parser!r} must be one of {list(TOOL_CALL_PARSERS)}")
        if self.enable_auto_tool_choice and self.tool_call_parser is None:
            raise ConfigError("enable_auto_tool_choice needs tool_call_parser (hermes or llama3_json)")
        from kvloom.frontends.reasoning import REASONING_PARSERS

        if self.reasoning_parser is not None and self.reasoning_parser not in REASONING_PARSERS:
            raise ConfigError(f"reasoning_parser={self.reasoning_parser!r} must be one of {list(REASONING_PARSERS)}")
        if self.responses_store_path is not None:
            folder = os.path.dirname(os.path.abspath(self.responses_store_path))
            if not os.path.isdir(folder):
                raise ConfigError(f"responses_store_path={self.responses_store_path!r}: the folder {folder} does "
                                  "not exist")
        if self.routing_policy not in ROUTING_POLICIES:
            raise ConfigError(f"routing_policy={self.routing_policy!r} must be one of {', '.join(ROUTING_POLICIES)}")
        if self.data_parallel_size > 1 and self.engine_address is not None:
            raise ConfigError(f"engine_address={self.engine_address!r} names one engine, but data_parallel_size="
                              f"{self.data_parallel_size} starts several: leave engine_address unset (each replica "
                              "gets its own ipc:// socket)")
        if self.ray_address is not None and self.engine_address is not None:
            raise ConfigError(f"engine_address={self.engine_address!r} and ray_address={self.ray_address!r}: the Ray "
                              "replicas bind their own addresses on their nodes; leave engine_address unset")
        if self.gateway is not None and self.gateway == self.engine_address:
            raise ConfigError(f"gateway and engine_address are both {self.gateway!r}: give them different addresses")

    @property
    def engine_heartbeat_interval(self) -> float | None:
        """How often the engine beats: often enough that one late beat is no alarm."""
        return None if self.engine_heartbeat_timeout is None else self.engine_heartbeat_timeout / 4

    @property
    def gateway_keys_required(self) -> bool:
        """Whether the gateway asks for API keys: as the HTTP server does, unless explicitly turned off."""
        if self.gateway_require_api_key is not None:
            return self.gateway_require_api_key
        return bool(self.api_key or self.api_keys)

    @property
    def max_request_body_bytes(self) -> int:
        return int(self.max_request_body_mb * 2**20)

    @property
    def is_loopback(self) -> bool:
        try:
            return ipaddress.ip_address(self.host).is_loopback
        except ValueError:
            return self.host == "localhost"

    @classmethod
    def keys(cls) -> set[str]:
        return {f.name for f in fields(cls)}

    def replace(self, **changes: Any) -> "ServerConfig":
        return dataclasses.replace(self, **changes)
