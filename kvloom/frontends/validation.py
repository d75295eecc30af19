"""The one check of a request, called by every door (HTTP, the ZMQ gateway, kvloom.LLM) before admission:
its prompt, sampling and priority against the served model's limits. A refusal is a RequestError (400)
whose message names the field, the value and the limit, the same text on every door."""

from __future__ import annotations

from dataclasses import dataclass

import msgspec

from kvloom.core.engine.pooling import check_dimensions
from kvloom.core.messages import PoolingInfo, PoolingParams
from kvloom.core.sampling_params import SamplingParams, check_priority
from kvloom.frontends.errors import RequestError

MAX_STOP_STRINGS = 16
MAX_STOP_STRING_CHARS = 1024  # the output holds back this much text while a stop string may still match
MAX_STOP_TOKEN_IDS = 1024
MAX_TEMPERATURE = 2.0  # OpenAI's bound (the engine itself takes up to 100)
MAX_POOLING_INPUTS = 2048  # OpenAI's bound on the inputs of one embeddings request
ENCODING_FORMATS = ("float", "base64")
TASK_ROUTES = {"generate": "/v1/completions, /v1/chat/completions", "embed": "/v1/embeddings",
               "score": "/v1/score or /v1/rerank"}


@dataclass(frozen=True)
class ModelLimits:
    """What a request is checked against: the served model's context and vocabulary (from EngineReady)."""

    max_model_len: int
    vocab_size: int
    task: str = "generate"  # what the model serves (EngineReady.task)
    pooling: PoolingInfo | None = None  # an embedding model's pooling and truncation sizes
    model_name: str = ""


@dataclass
class PreparedRequest:
    """A validated request: its prompt tokens and the sampling it runs with (``max_tokens`` resolved)."""

    prompt_token_ids: list[int]
    sampling: SamplingParams
    priority: int = 0
    api_key_name: str = ""  # the caller's key, whose quotas the engine keeps (admission.py)
    timeout: float | None = None  # run timeout in seconds (admission.check_timeout); None: the server's
    timeout_param: str = "request_timeout"  # where ``timeout`` came from, for the 408's message
    lora_name: str = ""  # the LoRA adapter to run with (empty: the base model)
    pooling: PoolingParams | None = None  # a pooling request (embed, score): prefill only, no text


def sampling_error(error: ValueError) -> RequestError:
    """The 400 of a SamplingParams that refused a value; its message starts with the field ("top_k=-5 ...").
    A RequestError (a ValueError too) already names its field and passes through unchanged."""
    if isinstance(error, RequestError):
        return error
    field = str(error).split("=", 1)[0]
    return RequestError(400, str(error), field if field.isidentifier() else None)


def check_token_ids(ids: list[int], vocab_size: int, param: str = "prompt") -> list[int]:
    # bool is an int subclass in Python, but true is not a token id (and the engine's decoder refuses it).
    bad = next((t for t in ids if type(t) is not int or not 0 <= t < vocab_size), None)
    if bad is not None:
        raise RequestError(400, f"token id {bad!r} is out of range [0, {vocab_size})", param)
    return ids


def check_sampling(sampling: SamplingParams, vocab_size: int) -> None:
    """The limits beyond SamplingParams' own ranges (which its constructor has checked): sizes that
    would make one request cost every other client time, and token ids of this vocabulary."""
    if sampling.temperature > MAX_TEMPERATURE:
        raise RequestError(400, f"temperature={sampling.temperature!r} must be in [0.0, {MAX_TEMPERATURE}]",
                           "temperature")
    if len(sampling.stop) > MAX_STOP_STRINGS:
        raise RequestError(400, f"stop has {len(sampling.stop)} strings; at most {MAX_STOP_STRINGS} are allowed",
                           "stop")
    long = next((s for s in sampling.stop if len(s) > MAX_STOP_STRING_CHARS), None)
    if long is not None:
        raise RequestError(400, f"a stop string of {len(long)} characters is over the limit of "
                           f"{MAX_STOP_STRING_CHARS}", "stop")
    if len(sampling.stop_token_ids) > MAX_STOP_TOKEN_IDS:
        raise RequestError(400, f"stop_token_ids has {len(sampling.stop_token_ids)} ids; at most "
                           f"{MAX_STOP_TOKEN_IDS} are allowed", "stop_token_ids")
    bad = next((t for t in sampling.stop_token_ids if t >= vocab_size), None)
    if bad is not None:
        raise RequestError(400, f"stop token id {bad} is out of range [0, {vocab_size})", "stop_token_ids")
    bad = next((t for t in sampling.logit_bias if t >= vocab_size), None)
    if bad is not None:
        raise RequestError(400, f"logit_bias token id {bad} is out of range [0, {vocab_size})", "logit_bias")


def validate_request(prompt_token_ids: list[int], sampling: SamplingParams, limits: ModelLimits, *,
                     priority: int = 0, max_tokens_param: str = "max_tokens",
                     prompt_param: str = "prompt", lora_name: str = "") -> PreparedRequest:
    """Check a request against the model's limits; ``max_tokens`` left None becomes what the context
    leaves. ``*_param`` name the fields as the door's request spells them. Raises RequestError."""
    check_task(limits, "generate")
    try:
        check_priority(priority)
    except ValueError as e:
        raise RequestError(400, str(e), "priority") from None
    check_sampling(sampling, limits.vocab_size)
    check_token_ids(prompt_token_ids, limits.vocab_size, prompt_param)
    n = len(prompt_token_ids)
    limit = limits.max_model_len
    if n == 0:
        raise RequestError(400, "the prompt is empty: at least one token is needed", prompt_param)
    max_tokens = sampling.max_tokens
    min_tokens = sampling.min_tokens
    if max_tokens is None:
        if n >= limit:
            raise RequestError(400, f"This model's maximum context length is {limit} tokens, and the prompt "
                               f"has {n} tokens, which leaves no room for a completion.", prompt_param)
        if min_tokens > limit - n:
            raise RequestError(400, f"min_tokens={min_tokens} is more than the {limit - n} tokens the "
                               f"context leaves for the completion ({limit} - {n} prompt tokens)", "min_tokens")
        sampling = msgspec.structs.replace(sampling, max_tokens=limit - n)
    elif n + max_tokens > limit:
        raise RequestError(400, f"This model's maximum context length is {limit} tokens. However, you "
                           f"requested {n + max_tokens} tokens ({n} in the prompt, {max_tokens} for the "
                           f"completion). Please reduce the prompt or {max_tokens_param}.", max_tokens_param)
    return PreparedRequest(prompt_token_ids, sampling, priority, lora_name=lora_name)


def check_task(limits: ModelLimits, task: str) -> None:
    """A 400 naming ``model`` when the served model does not do ``task`` (an embedding model asked for text)."""
    if limits.task != task:
        name = f"`{limits.model_name}` " if limits.model_name else ""
        raise RequestError(400, f"The model {name}serves task={limits.task!r} ({TASK_ROUTES[limits.task]}), "
                           f"not {task!r}", "model")


def validate_pooling(prompts: list[list[int]], limits: ModelLimits, pooling: PoolingParams, *,
                     encoding_format: str = "float", priority: int = 0, input_param: str = "input"
                     ) -> list[PreparedRequest]:
    """Check a pooling request (embeddings; scores of a reranker): every input's token ids against the
    context and vocabulary, their number, ``dimensions`` against the model's truncation sizes and
    ``encoding_format``. One PreparedRequest per input. Raises RequestError."""
    check_task(limits, pooling.task)
    try:
        check_priority(priority)
    except ValueError as e:
        raise RequestError(400, str(e), "priority") from None
    if encoding_format not in ENCODING_FORMATS:
        raise RequestError(400, f"encoding_format={encoding_format!r} must be one of {list(ENCODING_FORMATS)}",
                           "encoding_format")
    if not prompts:
        raise RequestError(400, f"{input_param} is empty: give at least one input", input_param)
    if len(prompts) > MAX_POOLING_INPUTS:
        raise RequestError(400, f"{input_param} has {len(prompts)} items; at most {MAX_POOLING_INPUTS} are allowed "
                           "in one request", input_param)
    if pooling.dimensions is not None:
        info = limits.pooling or PoolingInfo()
        try:
            check_dimensions(pooling.dimensions, info, info.hidden_size)
        except ValueError as e:
            raise RequestError(400, str(e), "dimensions") from None
    limit = limits.max_model_len
    prepared = []
    for i, ids in enumerate(prompts):
        where = f"{input_param}[{i}]" if len(prompts) > 1 else input_param
        check_token_ids(ids, limits.vocab_size, input_param)
        if not ids:
            raise RequestError(400, f"{where} is empty: at least one token is needed", input_param)
        if len(ids) > limit:
            raise RequestError(400, f"This model's maximum context length is {limit} tokens, and {where} has "
                               f"{len(ids)} tokens. Please reduce the input.", input_param)
        prepared.append(PreparedRequest(ids, SamplingParams(max_tokens=1), priority, pooling=pooling))
    return prepared
