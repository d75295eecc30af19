"""Every message that crosses a process boundary, as msgspec Structs encoded with msgpack.

The union types are tagged (``tag=True``), so each message names its own type and a client in any
language can speak the protocol from the JSON Schema in docs/. Nothing here is ever pickled.
"""

from __future__ import annotations

import json
import sys
from typing import Any, Union

import msgspec

from kvloom.core.sampling_params import SamplingParams


class _Msg(msgspec.Struct, tag=True, omit_defaults=True, kw_only=True, forbid_unknown_fields=True):
    """A field the receiver does not know is an error naming it, never silently dropped (a misspelt
    ``prompt_logprob`` must not quietly return nothing)."""


# frontend -> engine -------------------------------------------------------------------------------
class PoolingParams(msgspec.Struct, omit_defaults=True, kw_only=True, forbid_unknown_fields=True):
    """A prefill-only request: the prompt's final hidden states are pooled instead of sampled from.
    ``embed``: the model's pooling (``EngineReady.pooling``) into one vector, truncated to ``dimensions`` and
    L2-normalized when ``normalize`` (None: as the model's config says). ``score``: the softmax over the
    logits of ``score_token_ids`` at the last position (a yes/no reranker's relevance is its last entry)."""

    task: str = "embed"
    dimensions: int | None = None
    normalize: bool | None = None
    score_token_ids: list[int] = []


class RegisterFrontend(_Msg):
    """First message of every frontend; the engine answers with ``EngineReady`` once the model is
    loaded. Outputs go back to the ZeroMQ identity the frontend registered from."""

    frontend_id: str
    pid: int = 0
    secret: str = ""  # the launch's shared secret; an engine started with one ignores frontends without it


class AddRequest(_Msg):
    """Start generating for ``prompt_token_ids``. ``request_id`` is unique per engine (frontends prefix
    their clients' ids); ``priority`` is used by priority schedulers (lower value runs first)."""

    request_id: str
    prompt_token_ids: list[int]
    sampling: SamplingParams
    priority: int = 0
    arrival_time: float = 0.0
    deadline: float | None = None  # wall-clock time (time.time()) past which the request is aborted
    client_index: int = 0
    queue_deadline: float | None = None  # wall-clock time past which it is dropped if it has not started
    api_key_name: str = ""  # the name of the caller's API key: its quotas are kept in the engine (docs/admission.md)
    lora_name: str = ""  # the LoRA adapter to run with (docs/lora.md); empty: the base model
    pooling: PoolingParams | None = None  # pool the prompt (embeddings, scores) instead of generating


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
    """Logprob of the sampled (or prompt) token and the top-n alternatives at one position; ``rank`` (1:
    the most likely token) is given for prompt tokens."""

    token_id: int
    logprob: float
    top: list[TopLogprob]
    rank: int | None = None


class RateLimitInfo(msgspec.Struct, omit_defaults=True, kw_only=True):
    """An API key's quota state when it was refused (OpenAI's x-ratelimit-* headers); resets in seconds."""

    limit_requests: int | None = None
    remaining_requests: int | None = None
    reset_requests: float | None = None
    limit_tokens: int | None = None
    remaining_tokens: int | None = None
    reset_tokens: float | None = None


class TokenDelta(_Msg):
    """New tokens of one request in one step; ``finish_reason`` is set on its last delta
    (``stop``, ``length``, ``abort`` or ``error`` with ``error`` holding the message). ``error_kind``
    says whether an error is the request's fault (``rejected``: it can never run) or the engine's
    (``unavailable``: shutting down or failed; retrying elsewhere may work) or names a LoRA adapter the
    engine does not serve (``not_found``); admission adds
    ``queue_full`` and ``rate_limited`` (retry after ``retry_after`` seconds) and the deadlines
    ``queue_timeout`` (dropped before its first step) and ``deadline`` (stopped while running)."""

    request_id: str
    new_token_ids: list[int]
    finish_reason: str | None = None
    stop_token_id: int | None = None
    logprobs: list[TokenLogprobs] | None = None
    # sampling.prompt_logprobs: prompt tokens 1.. (the first has no context), each with its top-n; sent
    # once, on the request's first delta
    prompt_logprobs: list[TokenLogprobs] | None = None
    num_prompt_tokens: int = 0
    num_cached_tokens: int = 0
    error: str | None = None
    error_kind: str | None = None
    num_draft_tokens: int = 0  # speculative decoding: drafts verified for this request so far
    num_accepted_tokens: int = 0  # of which the target model accepted
    retry_after: float | None = None
    rate_limit: RateLimitInfo | None = None
    prefill_time: float | None = None  # seconds from the first step to the first token, on the delta with it
    embedding: list[float] | None = None  # a pooling request's vector (or scores), on its only delta


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
    spec_decode_num_drafts: int = 0  # draft tokens verified since the engine started
    spec_decode_num_accepted: int = 0  # of which accepted
    spec_decode_num_steps: int = 0  # request-steps that verified at least one draft
    num_waiting_tokens: int = 0  # prompt tokens of the waiting requests (max_queued_tokens counts these)
    num_rejected_queue_full: int = 0  # admission (docs/admission.md): refused at a full queue
    num_rate_limited: dict[str, int] = {}  # API key name -> refusals over its quota
    num_expired_in_queue: int = 0  # dropped at queue_timeout (or their deadline) before their first step
    num_expired_running: int = 0  # stopped at their deadline while running
    queue_wait_buckets: list[int] = []  # seconds from arrival to first step, per gate.QUEUE_WAIT_BUCKETS (+inf last)
    queue_wait_sum: float = 0.0
    lora_running: dict[str, int] = {}  # LoRA adapter name -> its running requests
    lora_waiting: dict[str, int] = {}  # ... its waiting ones
    lora_loaded: int = 0  # adapters loaded (served by name)
    lora_slot_loads: int = 0  # adapter moves into a device slot since the engine started

    @property
    def spec_decode_acceptance_rate(self) -> float:
        """Accepted / verified draft tokens (0 before any)."""
        return self.spec_decode_num_accepted / self.spec_decode_num_drafts if self.spec_decode_num_drafts else 0.0

    @property
    def spec_decode_mean_acceptance_length(self) -> float:
        """Tokens a request gains per verifying step: accepted drafts plus the target's own token."""
        return 1.0 + self.spec_decode_num_accepted / self.spec_decode_num_steps if self.spec_decode_num_steps else 0.0

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
    # with ``error``: ``not_found`` (the named thing does not exist), ``conflict`` (it is in use), else None
    error_kind: str | None = None


class EngineError(_Msg):
    """The engine failed; every in-flight request of the receiving frontend is over."""

    message: str


class PoolingInfo(msgspec.Struct, omit_defaults=True, kw_only=True, forbid_unknown_fields=True):
    """How an embedding engine pools (from the model's sentence-transformers files) and which truncated
    sizes ``dimensions`` may ask for: ``matryoshka`` off, none; on with no list, any up to ``hidden_size``."""

    pooling: str = "last"
    normalize: bool = True
    hidden_size: int = 0
    matryoshka: bool = False
    matryoshka_dimensions: list[int] = []


class EngineReady(_Msg):
    """Sent once the engine has loaded the model: what frontends need to validate requests."""

    model_name: str
    max_model_len: int
    vocab_size: int
    num_kv_blocks: int
    block_size: int
    eos_token_ids: list[int]
    plugins: list[str] = []
    pid: int = 0
    max_loras: int = 0  # LoRA device slots; 0: the engine serves no adapters
    task: str = "generate"  # generate, embed (pooling says how) or score (a yes/no reranker)
    pooling: PoolingInfo | None = None


class Heartbeat(_Msg):
    """The engine's loop is alive: sent to every frontend at least every heartbeat interval, busy or
    idle, so a frontend can tell a hung engine (alive but not stepping) from a quiet one."""

    num_unfinished: int = 0


FrontendMessage = Union[RegisterFrontend, AddRequest, AbortRequest, Utility, Shutdown]
EngineMessage = Union[StepOutputs, UtilityResult, EngineError, EngineReady, Heartbeat]


# service -> ZMQ gateway (text in) -----------------------------------------------------------------
class ChatMessage(msgspec.Struct, omit_defaults=True, kw_only=True, forbid_unknown_fields=True):
    role: str
    content: str


class Generate(_Msg):
    """Generate text for exactly one of ``prompt`` (text), ``messages`` (a chat, through the model's
    chat template) or ``prompt_token_ids``. ``request_id`` is the client's own: it only has to be
    unique among the client's unfinished requests. ``model`` is a served model's name (``Pong.models``) or
    a LoRA adapter loaded on one (docs/lora.md); left out, the first served model answers."""

    request_id: str
    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    prompt_token_ids: list[int] | None = None
    sampling: SamplingParams = msgspec.field(default_factory=SamplingParams)
    priority: int = 0
    api_key: str | None = None  # required when the gateway is started with gateway_require_api_key


class Embed(_Msg):
    """Embed each of ``input`` (texts, tokenized as /v1/embeddings does) or ``input_token_ids`` with an
    embedding model (``model``: a served name; left out, the first served model). ``dimensions`` truncates
    (models with Matryoshka sizes); ``normalize`` overrides the model's sentence-transformers config. Answered
    with one ``Embeddings``, or ``RequestFailed`` (400 naming the field and the limit)."""

    request_id: str
    model: str | None = None
    input: list[str] | None = None
    input_token_ids: list[list[int]] | None = None
    dimensions: int | None = None
    normalize: bool | None = None
    priority: int = 0
    api_key: str | None = None


class Cancel(_Msg):
    """Stop one of this client's requests; the gateway answers with its last ``TextChunk``
    (``finish_reason`` ``abort``)."""

    request_id: str


class Ping(_Msg):
    """Ask the gateway whether the engine is up; answered with ``Pong``."""


GatewayRequest = Union[Generate, Embed, Cancel, Ping]


# ZMQ gateway -> service (streamed text out) -------------------------------------------------------
class Usage(msgspec.Struct, kw_only=True):
    """Every count is sent, 0 included, so a client in any language reads a defined value."""

    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0


class TextChunk(_Msg):
    """New text of a request. The last chunk has ``finish_reason`` (``stop``, ``length`` or
    ``abort``), ``stop_reason`` (the stop string or token id that ended it; null, but present, when
    none did) and ``usage``; the other chunks leave those three out.
    With ``sampling.prompt_logprobs`` the first chunk has ``prompt_logprobs``: prompt tokens 1.. (the
    first has no context), each with its rank and top-n."""

    request_id: str
    text: str
    token_ids: list[int] = []
    logprobs: list[TokenLogprobs] | None = None
    prompt_logprobs: list[TokenLogprobs] | None = None
    finish_reason: str | None = None
    stop_reason: str | int | None | msgspec.UnsetType = msgspec.UNSET  # left out of all but the last chunk
    usage: Usage | None = None


class Embeddings(_Msg):
    """The answer to an ``Embed``: one vector per input, in order (float32 values as floats)."""

    request_id: str
    data: list[list[float]]
    usage: Usage


class RequestFailed(_Msg):
    """The request ended with an error; ``status`` follows HTTP: 400 a bad request (the message names
    the field and the limit), 401 a missing or wrong API key, 408 a deadline passed, 429 too many
    requests in flight, a full queue or a key's quota (retry after ``retry_after`` seconds), 503 the
    engine is down or stopping."""

    request_id: str
    message: str
    status: int = 400
    retry_after: float | None = None


class Pong(_Msg):
    """``model`` and ``max_model_len`` are the first served model's (the one a ``Generate`` without
    ``model`` goes to); ``models`` names every served model; ``healthy`` is true while any serves."""

    healthy: bool
    model: str = ""
    max_model_len: int = 0
    message: str | None = None
    models: list[str] = []


GatewayReply = Union[TextChunk, Embeddings, RequestFailed, Pong]

_encoder = msgspec.msgpack.Encoder()
_frontend_decoder = msgspec.msgpack.Decoder(FrontendMessage)
_engine_decoder = msgspec.msgpack.Decoder(EngineMessage)
_gateway_request_decoder = msgspec.msgpack.Decoder(GatewayRequest)
_gateway_reply_decoder = msgspec.msgpack.Decoder(GatewayReply)


def encode(msg: _Msg) -> bytes:
    return _encoder.encode(msg)


def decode_frontend_message(data: bytes) -> FrontendMessage:
    return _frontend_decoder.decode(data)


def decode_engine_message(data: bytes) -> EngineMessage:
    return _engine_decoder.decode(data)


def decode_gateway_request(data: bytes) -> GatewayRequest:
    return _gateway_request_decoder.decode(data)


def decode_gateway_reply(data: bytes) -> GatewayReply:
    return _gateway_reply_decoder.decode(data)


CHANNELS = {
    "frontend_to_engine": FrontendMessage,
    "engine_to_frontend": EngineMessage,
    "client_to_gateway": GatewayRequest,
    "gateway_to_client": GatewayReply,
}


def protocol_schema() -> dict[str, Any]:
    """The JSON Schema of every message, one property per channel (docs/protocol.schema.json)."""
    schemas, defs = msgspec.json.schema_components(list(CHANNELS.values()), ref_template="#/$defs/{name}")
    return {
        "$schema": "https://json-schema.org/draft/2020-12/schema",
        "title": "kvloom wire protocol",
        "description": "msgpack-encoded messages over ZeroMQ; each channel carries one tagged union "
                       "whose 'type' field names the message. See docs/protocol.md.",
        "type": "object",
        "properties": dict(zip(CHANNELS, schemas)),
        "$defs": defs,
    }


def protocol_schema_text() -> str:
    return json.dumps(protocol_schema(), indent=2, sort_keys=True) + "\n"


if __name__ == "__main__":  # python -m kvloom.core.messages [OUT.json]: write the schema
    if len(sys.argv) > 1:
        with open(sys.argv[1], "w") as f:
            f.write(protocol_schema_text())
    else:
        sys.stdout.write(protocol_schema_text())
