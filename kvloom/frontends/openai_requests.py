"""OpenAI request bodies translated into what the engine takes: sampling parameters, prompts, chat
messages and chat-template options."""

from __future__ import annotations

from typing import Any

import msgspec

from kvloom.core.sampling_params import SamplingParams
from kvloom.frontends import openai_protocol as api
from kvloom.frontends.errors import RequestError


def sampling_params(req: api._GenerationRequest, max_tokens: int | None, logprobs: int | None) -> SamplingParams:
    stop = [req.stop] if isinstance(req.stop, str) else list(req.stop or [])
    try:
        return SamplingParams(
            temperature=1.0 if req.temperature is None else req.temperature,
            top_p=1.0 if req.top_p is None else req.top_p, top_k=req.top_k, min_p=req.min_p, seed=req.seed,
            presence_penalty=req.presence_penalty or 0.0, frequency_penalty=req.frequency_penalty or 0.0,
            repetition_penalty=req.repetition_penalty, max_tokens=max_tokens, min_tokens=req.min_tokens,
            stop=stop, stop_token_ids=list(req.stop_token_ids), ignore_eos=req.ignore_eos, logprobs=logprobs,
            skip_special_tokens=req.skip_special_tokens, include_stop_str_in_output=req.include_stop_str_in_output,
        )
    except ValueError as e:  # SamplingParams names the field first: "top_k=-5 must be ..."
        field = str(e).split("=", 1)[0]
        raise RequestError(400, str(e), field if field.isidentifier() else None) from e


def choice_sampling(sp: SamplingParams, i: int) -> SamplingParams:
    # n choices from one seeded request must differ from each other yet be reproducible.
    return sp if sp.seed is None or i == 0 else msgspec.structs.replace(sp, seed=(sp.seed + i) % 2**63)


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
    """A chat or /tokenize request's template options, as ``render_chat_template`` takes them."""
    return dict(chat_template=req.chat_template, default_template=default_template,
                add_generation_prompt=req.add_generation_prompt, continue_final_message=req.continue_final_message,
                chat_template_kwargs=req.chat_template_kwargs)


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
        out.append({"role": m.role, "content": content or ""})
    return out
