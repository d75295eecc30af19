"""Which request fields the HTTP API takes. Every field of OpenAI's and vLLM's completion and chat
request schemas is either implemented (a field of the request Struct) or refused here by name with a
reason; a field neither schema has is refused as unknown. Nothing is silently ignored: a client that
asks for JSON output or a tool call must not get free text that looks like success."""

from __future__ import annotations

from typing import Any, Callable

from kvloom.frontends.frontend_core import RequestError

_SAMPLER = "it needs token masks in the engine's sampler, which kvloom does not have for it"
_WHITESPACE = "a custom whitespace pattern is not supported: JSON output takes the grammar's whitespace"
_FUNCTIONS = "the deprecated functions API is not supported: send tools and tool_choice"
_MULTIMODAL = "multimodal inputs are not supported"


def _off(value: Any) -> bool:
    """The value a client sends when it does not want the feature."""
    return value is None or value is False or value == [] or value == {} or value == ""


# field -> (reason, accepted(value, body)): a value that `accepted` allows is what kvloom does anyway.
Rule = tuple[str, Callable[[Any, dict], bool]]
_COMMON: dict[str, Rule] = {
    "best_of": ("best_of other than n is not supported", lambda v, b: v is None or v == (b.get("n") or 1)),
    "use_beam_search": ("beam search is not supported", lambda v, b: _off(v)),
    "length_penalty": ("length_penalty is for beam search, which is not supported", lambda v, b: v in (None, 1, 1.0)),
    "guided_decoding_backend": ("kvloom's structured outputs use xgrammar (guided_decoding_backend='xgrammar')",
                                lambda v, b: v in (None, "", "auto", "xgrammar")),
    "guided_whitespace_pattern": (_WHITESPACE, lambda v, b: _off(v)),
    "structural_tag": ("structural tags are not supported; use response_format, guided_* or tools",
                       lambda v, b: _off(v)),
    "allowed_token_ids": (_SAMPLER, lambda v, b: _off(v)),
    "bad_words": (_SAMPLER, lambda v, b: _off(v)),
    "logprob_token_ids": ("logprobs of chosen token ids are not supported; ask for the top logprobs",
                          lambda v, b: _off(v)),
    "logits_processors": ("custom logits processors are not supported", lambda v, b: _off(v)),
    "watermarking": ("watermarking is not supported", lambda v, b: _off(v)),
    "repetition_detection": ("repetition detection is not supported; use stop strings or max_tokens",
                             lambda v, b: _off(v)),
    "thinking_token_budget": ("thinking budgets are not supported: the reasoning parser splits the reasoning off, "
                              "it does not end it early",
                              lambda v, b: v in (None, -1)),
    "spaces_between_special_tokens": ("only spaces_between_special_tokens=true is supported",
                                      lambda v, b: v in (None, True)),
    "routed_experts_prompt_start": ("routed-expert data is not returned", lambda v, b: v in (None, 0)),
    "cache_salt": ("per-request prefix-cache salts are not supported", lambda v, b: _off(v)),
    "kv_transfer_params": ("KV transfer between engines is not supported", lambda v, b: _off(v)),
    "ec_transfer_params": ("encoder-cache transfer between engines is not supported", lambda v, b: _off(v)),
    "vllm_xargs": ("vllm_xargs (custom sampling extensions) are not supported", lambda v, b: _off(v)),
    "service_tier": ("service tiers are not supported", lambda v, b: v in (None, "auto", "default")),
    "store": ("storing completions is not supported", lambda v, b: _off(v)),
    "prompt_embeds": ("prompt embeddings are not supported; send text or token ids", lambda v, b: _off(v)),
    "mm_processor_kwargs": (_MULTIMODAL, lambda v, b: _off(v)),
    "media_io_kwargs": (_MULTIMODAL, lambda v, b: _off(v)),
}
# Taken and not acted on, as OpenAI's docs and vLLM allow: identifiers and hints with no effect on the
# output; return_token_offsets and return_mm_kwargs only act on vLLM's render endpoints; include_reasoning
# acts on chats (a field there), while a completion's text is never split into reasoning.
_HINTS = {"user", "metadata", "safety_identifier", "prompt_cache_key", "session_id", "return_token_offsets",
          "return_mm_kwargs", "include_reasoning"}

COMPLETION_RULES: dict[str, Rule] = {
    **_COMMON,
    "suffix": ("suffix (fill-in-the-middle) is not supported: the served models have no infill template",
               lambda v, b: v is None),
}
CHAT_RULES: dict[str, Rule] = {
    **_COMMON,
    "prompt_logprobs": ("prompt_logprobs cannot be streamed (a chat chunk has no field for them)",
                        lambda v, b: v is None or not b.get("stream")),
    "functions": (_FUNCTIONS, lambda v, b: _off(v)),
    "function_call": (_FUNCTIONS, lambda v, b: v in (None, "none")),
    "audio": ("audio output is not supported", lambda v, b: _off(v)),
    "modalities": ("only text output is supported", lambda v, b: _off(v) or v == ["text"]),
    "prediction": ("predicted outputs are not supported", lambda v, b: _off(v)),
    "verbosity": ("verbosity is not supported", lambda v, b: v is None),
    "web_search_options": ("web search is not supported", lambda v, b: _off(v)),
}
MESSAGE_FIELDS = {"role", "content", "name", "tool_calls", "tool_call_id", "reasoning_content"}
MESSAGE_RULES = {"function_call": _FUNCTIONS, "audio": "audio is not supported", "refusal": None,
                 "reasoning": None, "annotations": None}
STREAM_OPTIONS = {"include_usage", "continuous_usage_stats"}


def answer(name: str, struct: type, rules: dict[str, Rule]) -> str:
    """kvloom's answer to a request field: "implemented", "no effect" (a hint), "refused" (unless sent
    with its "off" value) or "unknown" (a 400 whatever its value)."""
    if name in rules:
        return "refused"
    if name in struct.__struct_fields__:
        return "implemented"
    return "no effect" if name in _HINTS else "unknown"


# Anthropic's Messages API (/v1/messages and its count_tokens)
ANTHROPIC_RULES: dict[str, Rule] = {
    "service_tier": ("service tiers are not supported", lambda v, b: v in (None, "auto", "standard_only")),
    "container": ("code-execution containers are not supported", lambda v, b: _off(v)),
    "mcp_servers": ("MCP servers are not supported: give the tools as tools", lambda v, b: _off(v)),
    "context_management": ("context management is not supported", lambda v, b: _off(v)),
    "speed": ("only the standard speed is served", lambda v, b: v in (None, "standard")),
    "diagnostics": ("prompt-cache diagnostics are not supported", lambda v, b: v is None),
    "inference_geo": ("kvloom serves where it runs: no inference_geo", lambda v, b: v is None),
    # identifiers and hints with no effect on the output (prefix caching is automatic)
    "cache_control": ("", lambda v, b: True),
    "user_profile_id": ("", lambda v, b: True),
    "workspace_id": ("", lambda v, b: True),
}
# OpenAI's Responses API (/v1/responses)
RESPONSES_RULES: dict[str, Rule] = {
    "background": ("background responses are not supported", lambda v, b: _off(v)),
    "conversation": ("conversations are not supported: chain responses with previous_response_id",
                     lambda v, b: _off(v)),
    "include": ("extra output data (include) is not supported", lambda v, b: _off(v)),
    "prompt": ("stored prompt templates are not supported", lambda v, b: _off(v)),
    "reasoning": ("reasoning effort and summaries are not supported (with --reasoning-parser the model's "
                  "reasoning comes as a reasoning item)",
                  lambda v, b: _off(v) or isinstance(v, dict) and all(x is None for x in v.values())),
    "truncation": ("only truncation='disabled' is supported: send a shorter input",
                   lambda v, b: v in (None, "disabled")),
    "top_logprobs": ("logprobs are not supported on /v1/responses yet", lambda v, b: v in (None, 0)),
    "max_tool_calls": ("max_tool_calls is not supported", lambda v, b: v is None),
    "stream_options": ("stream options are not supported", lambda v, b: _off(v)),
    "prompt_cache_retention": ("prompt cache retention is not supported (prefix caching is automatic)",
                               lambda v, b: v is None),
    "service_tier": _COMMON["service_tier"],
    "request_id": ("send the id as the X-Request-Id header instead", lambda v, b: _off(v)),
    "cache_salt": _COMMON["cache_salt"],
    "mm_processor_kwargs": _COMMON["mm_processor_kwargs"],
}


def check_fields(body: Any, struct: type, rules: dict[str, Rule], api: str = "OpenAI's or vLLM's") -> None:
    """Raise a 400 RequestError naming the first field of ``body`` (the request's JSON object) that
    kvloom does not implement, or that the API (``api``: whose request it is) does not define."""
    if not isinstance(body, dict):
        return  # the typed decode has refused it already
    known = set(struct.__struct_fields__)
    for name, value in body.items():
        rule = rules.get(name)
        if rule is not None:
            reason, accepted = rule
            if not accepted(value, body):
                raise RequestError(400, f"'{name}' is not supported: {reason}", name)
        elif name not in known and name not in _HINTS:
            raise RequestError(400, f"unknown field '{name}': not a field of {api} request "
                               "(see docs/compat.md for what kvloom takes)", name)
    options = body.get("stream_options")
    for name in (options if isinstance(options, dict) else ()):
        if name not in STREAM_OPTIONS:
            raise RequestError(400, f"unknown field 'stream_options.{name}'", f"stream_options.{name}")
    for i, message in enumerate(body.get("messages") or ()):
        for name, value in (message.items() if isinstance(message, dict) else ()):
            if name in MESSAGE_FIELDS or (name in MESSAGE_RULES and _off(value)):
                continue
            reason = MESSAGE_RULES.get(name) or "not a message field kvloom takes"
            raise RequestError(400, f"'messages[{i}].{name}' is not supported: {reason}", f"messages[{i}].{name}")
