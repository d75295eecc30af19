"""OpenAI request bodies translated into what the engine takes: sampling parameters, prompts, chat
messages and chat-template options."""

from __future__ import annotations

import json
from typing import Any

import msgspec

from kvloom.core.sampling_params import SamplingParams, StructuredOutputSpec
from kvloom.frontends import openai_protocol as api
from kvloom.frontends.errors import RequestError
from kvloom.frontends.tool_parsers import template_messages_tool_calls
from kvloom.frontends.validation import sampling_error


def sampling_params(req: api._GenerationRequest, max_tokens: int | None, logprobs: int | None,
                    structured: StructuredOutputSpec | None = None,
                    prompt_logprobs: int | None = None) -> SamplingParams:
    """``structured``: a constraint the caller derived (tool_choice); else the request's own, if any."""
    stop = [req.stop] if isinstance(req.stop, str) else list(req.stop or [])
    if structured is None:
        structured = structured_output(req)
    try:
        return SamplingParams(
            n=req.n, temperature=1.0 if req.temperature is None else req.temperature,
            top_p=1.0 if req.top_p is None else req.top_p, top_k=req.top_k, min_p=req.min_p, seed=req.seed,
            presence_penalty=req.presence_penalty or 0.0, frequency_penalty=req.frequency_penalty or 0.0,
            repetition_penalty=req.repetition_penalty, max_tokens=max_tokens, min_tokens=req.min_tokens,
            stop=stop, stop_token_ids=list(req.stop_token_ids), ignore_eos=req.ignore_eos, logprobs=logprobs,
            skip_special_tokens=req.skip_special_tokens, include_stop_str_in_output=req.include_stop_str_in_output,
            logit_bias=logit_bias(req.logit_bias), structured=structured, prompt_logprobs=prompt_logprobs,
        )
    except ValueError as e:
        raise sampling_error(e) from None


def check_echo(req: api.CompletionRequest) -> None:
    """``max_tokens=0`` only makes sense with ``echo`` (lm-eval-harness scores a prompt that way)."""
    if req.max_tokens == 0 and not req.echo:
        raise RequestError(400, "max_tokens=0 generates nothing, so it needs echo=true (the prompt and, with "
                           "logprobs, its logprobs)", "max_tokens")


def prompt_logprobs(req: api.CompletionRequest) -> int | None:
    """How many alternatives the engine scores at each prompt position: echo shows the prompt with the
    request's ``logprobs``, vLLM's ``prompt_logprobs`` asks for its own number; None when neither does."""
    wanted = [k for k in (req.logprobs if req.echo else None, req.prompt_logprobs) if k is not None]
    return max(wanted) if wanted else None


def split_prompts(prompt: str | list[Any]) -> list[str | list[int]]:
    """A completion ``prompt`` is text, token ids, or a batch of either."""
    if isinstance(prompt, str):
        return [prompt]
    if prompt and all(isinstance(p, str) for p in prompt):
        return list(prompt)
    if prompt and all(_is_token_id(p) for p in prompt):
        return [prompt]
    if prompt and all(isinstance(p, list) and p and all(_is_token_id(t) for t in p) for p in prompt):
        return list(prompt)
    raise RequestError(400, "prompt must be a string, a list of strings, a list of token ids or a list of lists "
                       "of token ids, and not empty", "prompt")


def _is_token_id(value: Any) -> bool:
    return type(value) is int  # not bool: JSON true is not token 1


def chat_template_options(req, default_template: str | None) -> dict[str, Any]:
    """A chat or /tokenize request's template options, as ``render_chat_template`` takes them. As vLLM,
    ``documents`` and ``reasoning_effort`` reach the template as variables (``enable_thinking`` too,
    unless the request's ``chat_template_kwargs`` set it)."""
    kwargs: dict[str, Any] = {}
    if getattr(req, "documents", None):
        kwargs["documents"] = req.documents
    effort = getattr(req, "reasoning_effort", None)
    if effort is not None:
        kwargs.update(reasoning_effort=effort, enable_thinking=effort != "none")
    kwargs.update(req.chat_template_kwargs or {})
    return dict(chat_template=req.chat_template, default_template=default_template,
                add_generation_prompt=req.add_generation_prompt, continue_final_message=req.continue_final_message,
                chat_template_kwargs=kwargs or None)


def truncate_prompt(ids: list[int], req: api._GenerationRequest, max_model_len: int) -> list[int]:
    """vLLM's ``truncate_prompt_tokens``: keep the last N prompt tokens (``truncation_side`` "right":
    the first N); -1 keeps max_model_len of them."""
    n = req.truncate_prompt_tokens
    if n is None:
        return ids
    if n == 0 or n > max_model_len:
        raise RequestError(400, f"truncate_prompt_tokens={n} must be -1 (max_model_len) or between 1 and "
                           f"max_model_len={max_model_len}", "truncate_prompt_tokens")
    keep = max_model_len if n == -1 else n
    if len(ids) <= keep:
        return ids
    return ids[:keep] if req.truncation_side == "right" else ids[len(ids) - keep:]


def echoed_message(req: api.ChatCompletionRequest) -> str:
    """vLLM's chat ``echo``: the reply starts with the last message's text when that message has the
    reply's role (the assistant's, or with add_generation_prompt=false the last message's own)."""
    if not req.echo or not req.messages:
        return ""
    last = req.messages[-1]
    if req.add_generation_prompt and last.role != "assistant":
        return ""
    content = last.content
    if isinstance(content, list):
        content = "".join(p.text or "" for p in content if p.type == "text")
    return content or ""


def chat_messages(messages: list[api.ChatMessageIn]) -> list[dict[str, Any]]:
    out = []
    for i, m in enumerate(messages):
        content = m.content
        if isinstance(content, list):
            bad = next((p.type for p in content if p.type != "text"), None)
            if bad is not None:
                raise RequestError(400, f"content part type {bad!r} is not supported (only 'text')",
                                   f"messages[{i}].content")
            content = "".join(p.text or "" for p in content)
        message: dict[str, Any] = {"role": m.role, "content": content or ""}
        if m.tool_calls:
            message["tool_calls"] = template_messages_tool_calls(m.tool_calls, i)
        if m.tool_call_id is not None:
            message["tool_call_id"] = m.tool_call_id
        if m.reasoning_content is not None:
            message["reasoning_content"] = m.reasoning_content
        out.append(message)
    return out


def logit_bias(bias: dict[str, float] | None) -> dict[int, float]:
    """OpenAI sends token ids as JSON object keys (strings); the engine checks them against the vocabulary."""
    out = {}
    for key, value in (bias or {}).items():
        try:
            token = int(key)
        except ValueError:
            raise RequestError(400, f"logit_bias key {key!r} must be a token id", "logit_bias") from None
        out[token] = value
    return out


# vLLM's structured_outputs field -> the engine's kind
_STRUCTURED_KEYS = {"json": "json", "regex": "regex", "choice": "choice", "grammar": "grammar",
                    "json_object": "json_object"}
# structured_outputs options that change nothing kvloom does, with the value that means so
_STRUCTURED_NEUTRAL = {"disable_fallback": (None, False, True), "disable_any_whitespace": (None, False, True),
                       "disable_additional_properties": (None, False, True), "backend": (None, "auto", "xgrammar"),
                       "whitespace_pattern": (None,), "structural_tag": (None,)}


def structured_output(req: api._GenerationRequest) -> StructuredOutputSpec | None:
    """The one output constraint a request asks for (response_format, a guided_* field or
    structured_outputs), checked for shape; the engine compiles it and reports a bad schema."""
    found: list[tuple[str, StructuredOutputSpec]] = []
    rf = req.response_format
    if rf is not None:
        spec = _response_format(rf)
        if spec is not None:
            found.append(("response_format", spec))
    if req.guided_json is not None:
        found.append(("guided_json", _json_spec(req.guided_json, "guided_json", strict=True)))
    if req.guided_regex is not None:
        found.append(("guided_regex", _text_spec("regex", req.guided_regex, "guided_regex")))
    if req.guided_choice is not None:
        found.append(("guided_choice", _choice_spec(req.guided_choice, "guided_choice")))
    if req.guided_grammar is not None:
        found.append(("guided_grammar", _text_spec("grammar", req.guided_grammar, "guided_grammar")))
    if req.structured_outputs is not None:
        spec = _structured_outputs(req.structured_outputs)
        if spec is not None:
            found.append(("structured_outputs", spec))
    if len(found) > 1:
        names = ", ".join(name for name, _ in found)
        raise RequestError(400, f"only one output constraint may be given, got {names}", found[1][0])
    return found[0][1] if found else None


def _response_format(rf: dict[str, Any]) -> StructuredOutputSpec | None:
    kind = rf.get("type")
    if kind == "text":
        return None
    if kind == "json_object":
        return StructuredOutputSpec(kind="json_object")
    if kind == "json_schema":
        js = rf.get("json_schema")
        if not isinstance(js, dict) or "schema" not in js and "json_schema" not in js:
            raise RequestError(400, "response_format.json_schema must be an object with a 'schema' (and a 'name')",
                               "response_format.json_schema")
        schema = js.get("schema", js.get("json_schema"))
        strict = js.get("strict")
        if strict is not None and not isinstance(strict, bool):
            raise RequestError(400, f"response_format.json_schema.strict={strict!r} must be a boolean",
                               "response_format.json_schema.strict")
        return _json_spec(schema, "response_format.json_schema.schema", strict=bool(strict))
    raise RequestError(400, f"response_format.type={kind!r} must be 'text', 'json_object' or 'json_schema'",
                       "response_format.type")


def _json_spec(schema: Any, param: str, strict: bool) -> StructuredOutputSpec:
    if isinstance(schema, str):
        try:
            schema = json.loads(schema)
        except ValueError as e:
            raise RequestError(400, f"{param} is not valid JSON: {e}", param) from None
    if schema is True:  # JSON Schema's "anything": any JSON object is the nearest grammar
        return StructuredOutputSpec(kind="json_object")
    if not isinstance(schema, dict):
        raise RequestError(400, f"{param} must be a JSON Schema object, not {type(schema).__name__}", param)
    return _checked(StructuredOutputSpec(kind="json", spec=json.dumps(schema), strict=strict), param)


def _text_spec(kind: str, text: Any, param: str) -> StructuredOutputSpec:
    if not isinstance(text, str) or not text:
        raise RequestError(400, f"{param} must be a non-empty string", param)
    return _checked(StructuredOutputSpec(kind=kind, spec=text), param)


def _choice_spec(choices: Any, param: str) -> StructuredOutputSpec:
    if not isinstance(choices, list) or not choices or not all(isinstance(c, str) and c for c in choices):
        raise RequestError(400, f"{param} must be a non-empty list of non-empty strings", param)
    return _checked(StructuredOutputSpec(kind="choice", spec=json.dumps(choices)), param)


def _structured_outputs(so: dict[str, Any]) -> StructuredOutputSpec | None:
    for key, value in so.items():
        if key not in _STRUCTURED_KEYS and key not in _STRUCTURED_NEUTRAL:
            raise RequestError(400, f"unknown field 'structured_outputs.{key}'", f"structured_outputs.{key}")
        if key in _STRUCTURED_NEUTRAL and value not in _STRUCTURED_NEUTRAL[key]:
            raise RequestError(400, f"'structured_outputs.{key}'={value!r} is not supported",
                               f"structured_outputs.{key}")
    given = [k for k in _STRUCTURED_KEYS if so.get(k) not in (None, False)]
    if len(given) > 1:
        raise RequestError(400, f"structured_outputs takes one constraint, got {', '.join(given)}",
                           "structured_outputs")
    if not given:
        return None
    key = given[0]
    param = f"structured_outputs.{key}"
    compact = so.get("disable_any_whitespace") is True
    if key == "json":
        return msgspec.structs.replace(_json_spec(so[key], param, strict=True), any_whitespace=not compact)
    if key == "json_object":
        return StructuredOutputSpec(kind="json_object", any_whitespace=not compact)
    if key == "choice":
        return _choice_spec(so[key], param)
    return _text_spec(key, so[key], param)


def _checked(spec: StructuredOutputSpec, param: str) -> StructuredOutputSpec:
    try:
        spec.validate()
    except ValueError as e:
        raise RequestError(400, str(e), param) from None
    return spec
