"""Which request fields the HTTP API takes. Every field of OpenAI's and vLLM's completion and chat
request schemas is either implemented (a field of the request Struct) or refused here by name with a
reason; a field neither schema has is refused as unknown. Nothing is silently ignored: a client that
asks for JSON output or a tool call must not get free text that looks like success."""

from __future__ import annotations

from typing import Any, Callable

from kvloom.frontends.frontend_core import RequestError

_SAMPLER = "it needs the engine's new sampler (token masks); it is not supported yet"
_WHITESPACE = "a custom whitespace pattern is not supported: JSON output takes the grammar's whitespace"
_FUNCTIONS = "the deprecated functions API is not supported: send tools and tool_choice"
_PROMPT_LOGPROBS = "prompt logprobs are served by /v1/completions (echo with logprobs, or prompt_logprobs)"


def _off(value: Any) -> bool:
    """The value a client sends when it does not want the feature."""
    return value is None or value is False or value == [] or value == {} or value == ""


# field -> (reason, accepted(value, body)): a value that `accepted` allows is what kvloom does anyway.
Rule = tuple[str, Callable[[Any, dict], bool]]
_COMMON: dict[str, Rule] = {
    "best_of": ("best_of other than n is not supported", lambda v, b: v is None or v == b.get("n", 1)),
    "use_beam_search": ("beam search is not supported", lambda v, b: _off(v)),
    "length_penalty": ("length_penalty is for beam search, which is not supported", lambda v, b: v in (None, 1, 1.0)),
    "guided_decoding_backend": ("kvloom's structured outputs use xgrammar (guided_decoding_backend='xgrammar')",
                                lambda v, b: v in (None, "", "auto", "xgrammar")),
    "guided_whitespace_pattern": (_WHITESPACE, lambda v, b: _off(v)),
    "structural_tag": ("structural tags are not supported; use response_format, guided_* or tools",
                       lambda v, b: _off(v)),
    "allowed_token_ids": (_SAMPLER, lambda v, b: _off(v)),
    "bad_words": (_SAMPLER, lambda v, b: _off(v)),
    "logits_processors": ("custom logits processors are not supported", lambda v, b: _off(v)),
    "truncate_prompt_tokens": ("prompt truncation is not supported; send a shorter prompt", lambda v, b: v is None),
    "spaces_between_special_tokens": ("only spaces_between_special_tokens=true is supported",
                                      lambda v, b: v in (None, True)),
    "return_tokens_as_token_ids": ("returning tokens as 'token_id:N' is not supported", lambda v, b: _off(v)),
    "return_token_ids": ("returning token ids in the response is not supported", lambda v, b: _off(v)),
    "cache_salt": ("per-request prefix-cache salts are not supported", lambda v, b: _off(v)),
    "kv_transfer_params": ("KV transfer between engines is not supported", lambda v, b: _off(v)),
    "vllm_xargs": ("vllm_xargs (custom sampling extensions) are not supported", lambda v, b: _off(v)),
    "request_id": ("send the id as the X-Request-Id header instead", lambda v, b: _off(v)),
    "service_tier": ("service tiers are not supported", lambda v, b: v in (None, "auto", "default")),
    "store": ("storing completions is not supported", lambda v, b: _off(v)),
    "prompt_embeds": ("prompt embeddings are not supported; send text or token ids", lambda v, b: _off(v)),
    "mm_processor_kwargs": ("multimodal inputs are not supported", lambda v, b: _off(v)),
}
# Identifiers and hints with no effect on the output: taken and not acted on, as OpenAI's docs allow.
_HINTS = {"user", "metadata", "safety_identifier", "prompt_cache_key"}

COMPLETION_RULES: dict[str, Rule] = {
    **_COMMON,
    "suffix": ("suffix (fill-in-the-middle) is not supported: the served models have no infill template",
               lambda v, b: v is None),
    "add_special_tokens": ("completions always add the tokenizer's special tokens (add_special_tokens=true)",
                           lambda v, b: v in (None, True)),
}
CHAT_RULES: dict[str, Rule] = {
    **_COMMON,
    "prompt_logprobs": (_PROMPT_LOGPROBS, lambda v, b: v is None),
    "functions": (_FUNCTIONS, lambda v, b: _off(v)),
    "function_call": (_FUNCTIONS, lambda v, b: v in (None, "none")),
    "echo": ("echoing the last message is not supported", lambda v, b: _off(v)),
    "add_special_tokens": ("the chat template places the special tokens (add_special_tokens=false)",
                           lambda v, b: v in (None, False)),
    "documents": ("documents for retrieval-augmented templates are not supported", lambda v, b: _off(v)),
    "audio": ("audio output is not supported", lambda v, b: _off(v)),
    "modalities": ("only text output is supported", lambda v, b: _off(v) or v == ["text"]),
    "prediction": ("predicted outputs are not supported", lambda v, b: _off(v)),
    "reasoning_effort": ("reasoning effort is not supported", lambda v, b: v is None),
    "verbosity": ("verbosity is not supported", lambda v, b: v is None),
    "web_search_options": ("web search is not supported", lambda v, b: _off(v)),
}
MESSAGE_FIELDS = {"role", "content", "name", "tool_calls", "tool_call_id", "reasoning_content"}
MESSAGE_RULES = {"function_call": _FUNCTIONS, "audio": "audio is not supported", "refusal": None}
STREAM_OPTION_RULES = {"continuous_usage_stats": "usage in every chunk is not supported; include_usage "
                       "gives it once at the end"}


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
    "request_id": _COMMON["request_id"],
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
    for name, value in (options.items() if isinstance(options, dict) else ()):
        if name in STREAM_OPTION_RULES and not _off(value):
            raise RequestError(400, f"'stream_options.{name}' is not supported: {STREAM_OPTION_RULES[name]}",
                               f"stream_options.{name}")
        if name not in STREAM_OPTION_RULES and name != "include_usage":
            raise RequestError(400, f"unknown field 'stream_options.{name}'", f"stream_options.{name}")
    for i, message in enumerate(body.get("messages") or ()):
        for name, value in (message.items() if isinstance(message, dict) else ()):
            if name in MESSAGE_FIELDS or (name in MESSAGE_RULES and _off(value)):
                continue
            reason = MESSAGE_RULES.get(name) or "not a message field kvloom takes"
            raise RequestError(400, f"'messages[{i}].{name}' is not supported: {reason}", f"messages[{i}].{name}")
