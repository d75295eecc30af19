"""The OpenAI-compatible HTTP API's request and response bodies as msgspec Structs. The types hold the
shapes; the limits of what reaches the engine's sampling are checked by the one validation every door
shares (SamplingParams and validation.py), so a value over a limit gets the same 400 on HTTP and the
gateway. Fields only HTTP has keep their limits here (``Meta``)."""

from __future__ import annotations

import time
from typing import Annotated, Any, Literal

import msgspec
from msgspec import Meta, Struct

MAX_LOGPROBS = 20  # the sampler's limit (SamplingParams.logprobs), vLLM's default max_logprobs


class StreamOptions(Struct, kw_only=True):
    include_usage: bool | None = False
    continuous_usage_stats: bool | None = False  # vLLM's: usage on every chunk too (with include_usage)

    @property
    def usage_every_chunk(self) -> bool:
        return bool(self.include_usage and self.continuous_usage_stats)


# Fields vLLM's request models take as nullable: null means the default, as there.
_NULL_MEANS_DEFAULT = {"n": 1, "stream": False, "top_k": 0, "min_p": 0.0, "repetition_penalty": 1.0,
                       "stop_token_ids": [], "echo": False}


class _GenerationRequest(Struct, kw_only=True):
    """Fields shared by /v1/completions and /v1/chat/completions, including a few widely used
    extensions (``top_k``, ``min_p``, ``repetition_penalty``, ``min_tokens``, ``ignore_eos``, ...)."""

    model: str | None = None
    n: int | None = 1
    temperature: float | None = None
    top_p: float | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    seed: int | None = None
    stop: str | list[str] | None = None
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    logit_bias: dict[str, float] | None = None
    best_of: int | None = None
    response_format: dict[str, Any] | None = None
    # vLLM's structured-output extensions (the guided_* fields and the newer structured_outputs)
    guided_json: dict[str, Any] | bool | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    guided_decoding_backend: str | None = None
    structured_outputs: dict[str, Any] | None = None
    # extensions
    top_k: int | None = 0
    min_p: float | None = 0.0
    repetition_penalty: float | None = 1.0
    min_tokens: int = 0
    ignore_eos: bool = False
    stop_token_ids: list[int] | None = []
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    priority: int = 0
    timeout: float | None = None  # seconds; may shorten the server's request_timeout (docs/admission.md)
    request_id: str | None = None  # vLLM's: the response's id, as the X-Request-Id header gives it
    # vLLM's: keep the last (truncation_side "left") or first N prompt tokens; -1: max_model_len of them
    truncate_prompt_tokens: Annotated[int, Meta(ge=-1)] | None = None
    truncation_side: Literal["left", "right"] | None = None
    return_tokens_as_token_ids: bool | None = None  # logprobs name tokens "token_id:N" (vLLM's)
    add_special_tokens: bool | None = None  # None: completions add them, a chat's template places them
    return_token_ids: bool | None = None  # vLLM's: the prompt's and each choice's token ids in the response
    stream_interval: Annotated[int, Meta(ge=1)] | None = None  # vLLM's: tokens per streamed chunk, at least

    def __post_init__(self) -> None:
        for name, default in _NULL_MEANS_DEFAULT.items():
            if getattr(self, name, default) is None:
                setattr(self, name, default)


class CompletionRequest(_GenerationRequest, kw_only=True):
    prompt: str | list[Any]  # text, token ids, or a batch of either
    max_tokens: int | None = 16  # 0: only with echo (the prompt scored, nothing generated)
    logprobs: int | None = None  # OpenAI's 5 is vLLM's 20 here
    echo: bool | None = False  # the prompt before the output, with its logprobs when logprobs is given
    suffix: str | None = None
    prompt_logprobs: int | None = None  # vLLM's extension


class ContentPart(Struct, kw_only=True):
    type: str
    text: str | None = None


class ChatMessageIn(Struct, kw_only=True):
    role: str
    content: str | list[ContentPart] | None = None
    name: str | None = None
    tool_calls: list[dict[str, Any]] | None = None  # an assistant's earlier calls
    tool_call_id: str | None = None  # a tool message: which call it answers
    reasoning_content: str | None = None  # an assistant's earlier reasoning, for templates that show it


class ChatCompletionRequest(_GenerationRequest, kw_only=True):
    messages: Annotated[list[ChatMessageIn], Meta(min_length=1)]
    max_tokens: int | None = None
    max_completion_tokens: Annotated[int, Meta(ge=1)] | None = None
    logprobs: bool | None = False
    top_logprobs: Annotated[int, Meta(ge=0, le=MAX_LOGPROBS)] | None = None
    tools: list[Any] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    # vLLM's chat-template extensions
    chat_template: str | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    prompt_logprobs: int | None = None  # vLLM's; not streamed
    echo: bool | None = False  # vLLM's: the reply starts with the last message when it has the reply's role
    documents: list[dict[str, Any]] | None = None  # for templates that render retrieval documents
    reasoning_effort: str | None = None  # given to the chat template, as vLLM does
    return_prompt_text: bool | None = None  # vLLM's: the rendered chat in the response (the first chunk)
    include_reasoning: bool = True  # vLLM's: false leaves the reasoning out (--reasoning-parser)

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.logprobs is None:  # a completion's logprobs=null means none; a chat's is a boolean
            self.logprobs = False


# --- responses -------------------------------------------------------------------------------------
class PromptTokensDetails(Struct):
    cached_tokens: int = 0


class UsageInfo(Struct):
    prompt_tokens: int = 0
    completion_tokens: int = 0
    total_tokens: int = 0
    prompt_tokens_details: PromptTokensDetails | None = None


class CompletionLogprobs(Struct):
    """OpenAI's legacy shape; with echo, the prompt's first token has ``None`` for its logprob and top."""

    tokens: list[str]
    token_logprobs: list[float | None]
    top_logprobs: list[dict[str, float] | None] | None
    text_offset: list[int]


class PromptLogprob(Struct):
    """vLLM's prompt_logprobs entry: one token's logprob, its rank (1: the most likely) and its text."""

    logprob: float
    rank: int | None
    decoded_token: str


class _Choice(Struct, kw_only=True):
    index: int
    finish_reason: str | None = None
    stop_reason: str | int | None = None  # the stop string or stop token id that ended it


class _Completion(Struct, kw_only=True):
    id: str
    model: str
    created: int = msgspec.field(default_factory=lambda: int(time.time()))
    usage: UsageInfo | None = None


class CompletionChoice(_Choice, kw_only=True):
    text: str
    logprobs: CompletionLogprobs | None = None
    # vLLM's prompt_logprobs: per prompt token (None for the first), token id (as text) -> its entry
    prompt_logprobs: list[dict[str, PromptLogprob] | None] | None = None
    token_ids: list[int] | None = None  # with return_token_ids: this choice's (a stream chunk's) tokens
    prompt_token_ids: list[int] | None = None  # with return_token_ids (a stream: its first chunk)


class CompletionResponse(_Completion, kw_only=True):
    """Also the shape of each streamed chunk (``object`` stays ``text_completion``)."""

    choices: list[CompletionChoice]
    object: str = "text_completion"


class TopLogprobOut(Struct):
    token: str
    logprob: float
    bytes: list[int]


class TokenLogprobOut(TopLogprobOut):
    top_logprobs: list[TopLogprobOut]


class ChatLogprobs(Struct):
    content: list[TokenLogprobOut] | None


class FunctionCallOut(Struct):
    name: str
    arguments: str  # JSON text


class ToolCallOut(Struct):
    id: str
    function: FunctionCallOut
    type: str = "function"


class ChatMessageOut(Struct):
    content: str | None
    role: str = "assistant"
    tool_calls: list[ToolCallOut] | None = None
    reasoning_content: str | msgspec.UnsetType = msgspec.UNSET  # with --reasoning-parser only


class ChatChoice(_Choice, kw_only=True):
    message: ChatMessageOut
    logprobs: ChatLogprobs | None = None
    token_ids: list[int] | None = None  # with return_token_ids


class ChatCompletionResponse(_Completion, kw_only=True):
    choices: list[ChatChoice]
    object: str = "chat.completion"
    prompt_logprobs: list[dict[str, PromptLogprob] | None] | None = None  # vLLM's, as a completion choice's
    prompt_token_ids: list[int] | None = None  # with return_token_ids
    prompt_text: str | None = None  # with return_prompt_text: the chat as the template rendered it


class DeltaFunctionCall(Struct, omit_defaults=True):
    name: str | None = None
    arguments: str | None = None


class DeltaToolCall(Struct, omit_defaults=True):
    """A streamed tool call: the first chunk has its id, type and name, later ones add arguments."""

    index: int
    id: str | None = None
    type: str | None = None
    function: DeltaFunctionCall | None = None


class DeltaMessage(Struct, omit_defaults=True):
    role: str | None = None
    content: str | None = None
    reasoning_content: str | None = None
    tool_calls: list[DeltaToolCall] | None = None


class ChatChunkChoice(_Choice, kw_only=True):
    delta: DeltaMessage
    logprobs: ChatLogprobs | None = None
    token_ids: list[int] | None = None  # with return_token_ids: this chunk's tokens


class ChatCompletionChunk(_Completion, kw_only=True):
    choices: list[ChatChunkChoice]
    object: str = "chat.completion.chunk"
    prompt_token_ids: list[int] | None = None  # with return_token_ids, on the first chunk
    prompt_text: str | None = None  # with return_prompt_text, on the first chunk


class ModelCard(Struct):
    id: str
    max_model_len: int
    created: int = msgspec.field(default_factory=lambda: int(time.time()))
    object: str = "model"
    owned_by: str = "kvloom"
    root: str | None = None  # a LoRA adapter's folder; a served model's own name
    parent: str | None = None  # a LoRA adapter's base model (None for a served model)


class ModelList(Struct):
    data: list[ModelCard]
    object: str = "list"


class ErrorInfo(Struct):
    message: str
    type: str
    param: str | None = None
    code: int | str | None = None


class ErrorResponse(Struct):
    error: ErrorInfo
