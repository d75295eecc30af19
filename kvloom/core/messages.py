"""Every message that crosses a process boundary, as msgspec Structs encoded with msgpack.

The union types are tagged (``tag=True``), so each message names its own type and a client in any
language can speak the protocol from the JSON Schema in docs/. Nothing here is ever pickled.
"""

from __future__ import annotations

from typing import Any, Union

import msgspec

from kvloom.core.sampling_params import SamplingParams


class _Msg(msgspec.Struct, tag=True, omit_defaults=True, kw_only=True):
    pass


# frontend -> engine -------------------------------------------------------------------------------
class AddRequest(_Msg):
    """Start generating for ``prompt_token_ids``. ``request_id`` is unique per engine (frontends prefix
    their clients' ids); ``priority`` is used by priority schedulers (lower value runs first)."""

    request_id: str
    prompt_token_ids: list[int]
    sampling: SamplingParams
    priority: int = 0
    arrival_time: float = 0.0
    deadline: float | None = None
    client_index: int = 0


class AbortRequest(_Msg):
    """Stop these requests and free their KV blocks (client went away, stop string hit, timeout)."""

    request_ids: list[str]


class Utility(_Msg):
    """Call an engine utility method by name (``stats``, ``reset_prefix_cache``, ...)."""

    call_id: int
    method: str
    args: list[Any] = []


class Shutdown(_Msg):
    """Finish in-flight work (``drain``) or stop now, then exit."""

    drain: bool = True


# engine -> frontend -------------------------------------------------------------------------------
class TopLogprob(msgspec.Struct, array_like=True):
    token_id: int
    logprob: float


class TokenLogprobs(msgspec.Struct, array_like=True):
    """Logprob of the sampled token and the top-n alternatives at one position."""

    token_id: int
    logprob: float
    top: list[TopLogprob]


class TokenDelta(_Msg):
    """New tokens of one request in one step; ``finish_reason`` is set on its last delta
    (``stop``, ``length``, ``abort`` or ``error`` with ``error`` holding the message)."""

    request_id: str
    new_token_ids: list[int]
    finish_reason: str | None = None
    stop_token_id: int | None = None
    logprobs: list[TokenLogprobs] | None = None
    num_prompt_tokens: int = 0
    num_cached_tokens: int = 0
    error: str | None = None


class EngineStats(msgspec.Struct, omit_defaults=True, kw_only=True):
    num_running: int = 0
    num_waiting: int = 0
    num_free_blocks: int = 0
    num_total_blocks: int = 0
    kv_usage: float = 0.0
    num_preemptions: int = 0
    prefix_cache_queries: int = 0
    prefix_cache_hits: int = 0
    step_tokens: int = 0

    @property
    def prefix_cache_hit_rate(self) -> float:
        """Prompt tokens served from the prefix cache / prompt tokens looked up (0 before any lookup)."""
        return self.prefix_cache_hits / self.prefix_cache_queries if self.prefix_cache_queries else 0.0


class StepOutputs(_Msg):
    """Everything one engine step produced for one frontend."""

    outputs: list[TokenDelta]
    stats: EngineStats | None = None


class UtilityResult(_Msg):
    call_id: int
    result: Any = None
    error: str | None = None


class EngineError(_Msg):
    """The engine failed; every in-flight request of the receiving frontend is over."""

    message: str


class EngineReady(_Msg):
    """Sent once the engine has loaded the model: what frontends need to validate requests."""

    model_name: str
    max_model_len: int
    vocab_size: int
    num_kv_blocks: int
    block_size: int
    eos_token_ids: list[int]
    plugins: list[str] = []


FrontendMessage = Union[AddRequest, AbortRequest, Utility, Shutdown]
EngineMessage = Union[StepOutputs, UtilityResult, EngineError, EngineReady]

_encoder = msgspec.msgpack.Encoder()
_frontend_decoder = msgspec.msgpack.Decoder(FrontendMessage)
_engine_decoder = msgspec.msgpack.Decoder(EngineMessage)


def encode(msg: _Msg) -> bytes:
    return _encoder.encode(msg)


def decode_frontend_message(data: bytes) -> FrontendMessage:
    return _frontend_decoder.decode(data)


def decode_engine_message(data: bytes) -> EngineMessage:
    return _engine_decoder.decode(data)
