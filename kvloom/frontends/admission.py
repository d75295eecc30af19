"""Admission, shared by the HTTP server and the ZMQ gateway: API keys (``api_key`` and ``[[api_keys]]``,
compared in constant time), the per-request ``timeout`` bounded by the server's, and the refusals in
HTTP's terms (429 with Retry-After and OpenAI's x-ratelimit-* headers, 408 naming the limit, 503).

The counting itself happens in the engine process (core/engine/gate.py): the waiting queue's caps and
each key's token buckets are kept where every API worker's requests meet, so N workers can never admit
N times a cap or a quota. This module gives the engine its gate (``engine_gate``) and turns the
engine's refusals into client errors (``engine_refusal``)."""

from __future__ import annotations

import dataclasses
import hashlib
import hmac
import math
import re
from dataclasses import dataclass
from typing import Any

from kvloom.core.config import ConfigError
from kvloom.core.engine.gate import AdmissionGate, KeyQuota
from kvloom.core.messages import RateLimitInfo, TokenDelta
from kvloom.core.sampling_params import PRIORITY_RANGE
from kvloom.frontends.errors import RequestError

KEY_FIELDS = {"key", "key_sha256", "name", "requests_per_minute", "tokens_per_minute", "max_concurrent", "priority"}
_HEX64 = re.compile(r"[0-9a-fA-F]{64}")


@dataclass(frozen=True)
class ApiKey:
    """One accepted key: only its sha256 is kept, so a config file may hold the hash alone."""

    name: str
    sha256: bytes
    requests_per_minute: int | None = None
    tokens_per_minute: int | None = None
    max_concurrent: int | None = None
    priority: int = 0

    def quota(self) -> KeyQuota:
        return KeyQuota(self.name, self.requests_per_minute, self.tokens_per_minute, self.max_concurrent)


def parse_api_keys(entries: Any, single_key: str | None = None) -> list[ApiKey]:
    """The keys of ``[[api_keys]]`` (and ``api_key``, named ``default``, unlimited); ConfigError names the
    entry and the field that is wrong."""
    if not isinstance(entries, list):
        raise ConfigError(f"api_keys={entries!r} must be a list of tables ([[api_keys]] in the config file)")
    keys = [] if single_key is None else [ApiKey("default", _sha256(single_key))]
    for i, entry in enumerate(entries):
        where = f"api_keys[{i}]"
        if not isinstance(entry, dict):
            raise ConfigError(f"{where}={entry!r} must be a table with key (or key_sha256) and name")
        unknown = sorted(set(entry) - KEY_FIELDS)
        if unknown:
            raise ConfigError(f"{where}: unknown field(s) {unknown}; known: {sorted(KEY_FIELDS)}")
        name = entry.get("name")
        if not isinstance(name, str) or not name:
            raise ConfigError(f"{where}.name={name!r} must be a non-empty string (it labels the key's metrics)")
        if ("key" in entry) == ("key_sha256" in entry):
            raise ConfigError(f"{where} ({name}): give exactly one of key and key_sha256")
        if "key" in entry:
            if not isinstance(entry["key"], str) or not entry["key"]:
                raise ConfigError(f"{where}.key must be a non-empty string")
            digest = _sha256(entry["key"])
        else:
            value = entry["key_sha256"]
            if not isinstance(value, str) or not _HEX64.fullmatch(value):
                raise ConfigError(f"{where}.key_sha256={value!r} must be 64 hex digits (sha256sum of the key)")
            digest = bytes.fromhex(value)
        limits = {}
        for field in ("requests_per_minute", "tokens_per_minute", "max_concurrent"):
            value = entry.get(field)
            if value is not None and (type(value) is not int or value < 1):
                raise ConfigError(f"{where}.{field}={value!r} must be an integer >= 1 (leave it out: no limit)")
            limits[field] = value
        priority = entry.get("priority", 0)
        lo, hi = PRIORITY_RANGE
        if type(priority) is not int or not lo <= priority <= hi:
            raise ConfigError(f"{where}.priority={priority!r} must be an integer in [{lo}, {hi}]")
        keys.append(ApiKey(name, digest, priority=priority, **limits))
    names = [k.name for k in keys]
    duplicate = next((n for n in names if names.count(n) > 1), None)
    if duplicate is not None:
        raise ConfigError(f"api_keys: the name {duplicate!r} is used twice (each key needs its own name)")
    digests = [k.sha256 for k in keys]
    if len(set(digests)) != len(digests):
        raise ConfigError("api_keys: the same key is listed twice")
    return keys


def _sha256(key: str) -> bytes:
    return hashlib.sha256(key.encode()).digest()


class KeyRing:
    """The accepted keys; none configured means no key is needed."""

    def __init__(self, keys: list[ApiKey]) -> None:
        self.keys = keys

    @property
    def required(self) -> bool:
        return bool(self.keys)

    def authenticate(self, token: str | None,
                     how: str = "send 'Authorization: Bearer KEY' (or 'x-api-key: KEY')") -> ApiKey | None:
        """The key ``token`` is, or RequestError(401); ``how`` tells a client without one how to send it.
        Every key is compared (in constant time, on sha256 digests of equal length), so neither a key's
        bytes nor its position in the list show in the answer's timing."""
        if not self.keys:
            return None
        digest = _sha256(token or "")
        found = None
        for key in self.keys:
            if hmac.compare_digest(digest, key.sha256) and token:
                found = key
        if found is None:
            raise RequestError(401, f"invalid or missing API key: {how}" if token is None else "invalid API key",
                               reason="unauthorized")
        return found

    def authenticate_header(self, authorization: str | None) -> ApiKey | None:
        scheme, _, token = (authorization or "").partition(" ")
        return self.authenticate(token.strip() if scheme.lower() == "bearer" and token.strip() else None)

    def authenticate_headers(self, headers) -> ApiKey | None:
        """An HTTP request's key: ``Authorization: Bearer KEY`` (OpenAI's clients) or ``x-api-key: KEY``
        (Anthropic's); one request giving both must give the same key."""
        bearer, api_key = headers.get("authorization"), headers.get("x-api-key")
        if api_key is None:
            return self.authenticate_header(bearer)
        key = self.authenticate(api_key.strip() or None)
        if bearer is not None and self.authenticate_header(bearer) != key:
            raise RequestError(401, "the Authorization and x-api-key headers name different keys",
                               reason="unauthorized")
        return key


def effective_priority(key: ApiKey | None, requested: int) -> int:
    """A key's priority is its requests' default and their best: a request may ask to run later than
    its key (a higher value), never sooner."""
    if key is None:
        return requested
    return key.priority if requested == 0 else max(key.priority, requested)


def check_timeout(timeout: float | None, server_timeout: float | None) -> float | None:
    """A request's own ``timeout`` (seconds), which may shorten the server's request_timeout but never
    lengthen it; the run timeout that applies is returned."""
    if timeout is None:
        return server_timeout
    if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or not timeout > 0 \
            or not math.isfinite(timeout):
        raise RequestError(400, f"timeout={timeout!r} must be a number of seconds > 0", "timeout")
    if server_timeout is not None and timeout > server_timeout:
        raise RequestError(400, f"timeout={timeout:g} is over this server's request_timeout={server_timeout:g}s",
                           "timeout")
    return float(timeout)


def engine_gate(server) -> AdmissionGate:
    """The engine's gate from the serving settings (a ServerConfig)."""
    keys = parse_api_keys(server.api_keys, server.api_key)
    return AdmissionGate(server.max_queued_requests, server.max_queued_tokens, [k.quota() for k in keys])


# --- refusals --------------------------------------------------------------------------------------
def retry_after_header(seconds: float) -> str:
    """HTTP's Retry-After is whole seconds; rounded up so a client that waits that long is let in."""
    return str(max(1, math.ceil(seconds)))


def _duration(seconds: float) -> str:
    """OpenAI's reset format: ``1s``, ``6m0s``, ``20ms``."""
    if seconds < 1:
        return f"{max(1, round(seconds * 1000))}ms"
    minutes, rest = divmod(seconds, 60)
    return f"{int(minutes)}m{rest:.0f}s" if minutes else f"{seconds:.3g}s"


def rate_limit_headers(info: RateLimitInfo | None) -> dict[str, str]:
    """OpenAI's ``x-ratelimit-{limit,remaining,reset}-{requests,tokens}`` for the limits a key has."""
    if info is None:
        return {}
    headers = {}
    for unit in ("requests", "tokens"):
        limit = getattr(info, f"limit_{unit}")
        if limit is None:
            continue
        headers[f"x-ratelimit-limit-{unit}"] = str(limit)
        headers[f"x-ratelimit-remaining-{unit}"] = str(getattr(info, f"remaining_{unit}"))
        headers[f"x-ratelimit-reset-{unit}"] = _duration(getattr(info, f"reset_{unit}"))
    return headers


def engine_refusal(delta: TokenDelta, run_timeout: float | None, run_limit: str,
                   queue_timeout: float | None) -> RequestError:
    """The client error for an engine's error delta; ``run_limit`` names the setting ``run_timeout``
    came from (``request_timeout`` or the body's ``timeout``)."""
    kind, message = delta.error_kind, delta.error or "the engine failed this request"
    if kind in ("queue_full", "rate_limited"):
        headers = {"Retry-After": retry_after_header(delta.retry_after or 1.0), **rate_limit_headers(delta.rate_limit)}
        return RequestError(429, message, headers=headers, reason=kind)
    if kind == "queue_timeout":
        return RequestError(408, f"the request waited longer than queue_timeout={queue_timeout:g}s for its first "
                            "step; it was dropped before it ran" if queue_timeout is not None else message,
                            reason="deadline")
    if kind == "deadline":
        return RequestError(408, f"the request did not finish within {run_limit}={run_timeout:g}s"
                            if run_timeout is not None else message, reason="deadline")
    if kind == "rejected":
        return RequestError(400, message)
    if kind == "not_found":  # a LoRA adapter unloaded meanwhile
        return RequestError(404, message, "model")
    return RequestError(503, message, reason="unavailable")


def replace_prepared(prepared, key: ApiKey | None, timeout: float | None, timeout_given: bool):
    """``prepared`` (a PreparedRequest) with its key's name and priority and its run timeout."""
    return dataclasses.replace(prepared, api_key_name=key.name if key else "",
                               priority=effective_priority(key, prepared.priority), timeout=timeout,
                               timeout_param="timeout" if timeout_given else "request_timeout")
