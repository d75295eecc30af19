"""A chat request's messages to prompt tokens, with vLLM's template options: a per-request
``chat_template`` (else the server's ``--chat-template``, else the model's), ``chat_template_kwargs``,
``add_generation_prompt`` and ``continue_final_message``. Used by /v1/chat/completions and /tokenize."""

from __future__ import annotations

from typing import Any

from kvloom.frontends.frontend_core import RequestError

# Keys of chat_template_kwargs that would override what the request's own fields decide.
_RESERVED_KWARGS = {"messages", "add_generation_prompt", "continue_final_message", "chat_template", "tokenize"}


def render_chat(tokenizer, messages: list[dict[str, Any]], *, chat_template: str | None = None,
                default_template: str | None = None, add_generation_prompt: bool = True,
                continue_final_message: bool = False, chat_template_kwargs: dict[str, Any] | None = None) -> list[int]:
    if add_generation_prompt and continue_final_message:
        raise RequestError(400, "continue_final_message=true continues the last message, so it needs "
                           "add_generation_prompt=false", "continue_final_message")
    if continue_final_message and (not messages or messages[-1]["role"] != "assistant"):
        raise RequestError(400, "continue_final_message=true needs an assistant message last", "continue_final_message")
    kwargs = dict(chat_template_kwargs or {})
    clash = sorted(_RESERVED_KWARGS & set(kwargs))
    if clash:
        raise RequestError(400, f"chat_template_kwargs may not set {clash}: they are request fields",
                           "chat_template_kwargs")
    template = chat_template or default_template
    if template is not None:
        kwargs["chat_template"] = template
    if continue_final_message:
        kwargs["continue_final_message"] = True
    if template is None and not getattr(tokenizer, "chat_template", None):
        raise RequestError(400, "this model's tokenizer has no chat template: send one as chat_template "
                           "(or start the server with --chat-template FILE), or use /v1/completions", "messages")
    try:
        ids = tokenizer.apply_chat_template(messages, add_generation_prompt=add_generation_prompt, tokenize=True,
                                            **kwargs)
        return list(ids["input_ids"] if hasattr(ids, "keys") else ids)  # transformers 5 returns a BatchEncoding
    except Exception as e:  # noqa: BLE001 - jinja errors from a template are the user's input
        param = "chat_template" if chat_template else "messages"
        raise RequestError(400, f"the chat template could not render these messages: {e}", param) from e
