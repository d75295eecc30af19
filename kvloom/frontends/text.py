"""Text handling shared by every frontend: tokenizer loading, chat templates, incremental
detokenization (safe across multi-byte characters) and stop strings."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from tokenizers.decoders import DecodeStream

from kvloom.core.model.tokenizer import TOKENIZER_FILES, has_tokenizer, load_tokenizer  # noqa: F401 (re-exported)


class ChatTemplateError(ValueError):
    """A chat the template cannot render; ``param`` names the request field at fault."""

    def __init__(self, message: str, param: str = "messages") -> None:
        super().__init__(message)
        self.param = param


# Keys of chat_template_kwargs that would override what the request's own fields decide.
_RESERVED_KWARGS = {"messages", "add_generation_prompt", "continue_final_message", "chat_template", "tokenize"}


def render_chat_template(tokenizer, messages: list[dict[str, Any]], *, add_generation_prompt: bool = True,
                         chat_template: str | None = None, default_template: str | None = None,
                         continue_final_message: bool = False,
                         chat_template_kwargs: dict[str, Any] | None = None) -> str:
    """The chat as the text the model reads, with vLLM's template options: a per-request
    ``chat_template`` (else the server's ``default_template``, else the model's), ``chat_template_kwargs``,
    ``add_generation_prompt`` and ``continue_final_message``. ``encode_rendered_chat`` of it equals
    ``apply_chat_template(tokenize=True)``."""
    if add_generation_prompt and continue_final_message:
        raise ChatTemplateError("continue_final_message=true continues the last message, so it needs "
                                "add_generation_prompt=false", "continue_final_message")
    if continue_final_message and (not messages or messages[-1]["role"] != "assistant"):
        raise ChatTemplateError("continue_final_message=true needs an assistant message last", "continue_final_message")
    kwargs = dict(chat_template_kwargs or {})
    clash = sorted(_RESERVED_KWARGS & set(kwargs))
    if clash:
        raise ChatTemplateError(f"chat_template_kwargs may not set {clash}: they are request fields",
                                "chat_template_kwargs")
    template = chat_template or default_template
    if template is None and not getattr(tokenizer, "chat_template", None):
        raise ChatTemplateError("this model's tokenizer has no chat template: send one as chat_template "
                                "(or start the server with --chat-template FILE), or use a plain completion prompt")
    if template is not None:
        kwargs["chat_template"] = template
    if continue_final_message:
        kwargs["continue_final_message"] = True
    try:
        return tokenizer.apply_chat_template(messages, add_generation_prompt=add_generation_prompt, tokenize=False,
                                             **kwargs)
    except Exception as e:  # noqa: BLE001 - jinja errors from a template are the user's input
        raise ChatTemplateError(f"the chat template could not render these messages: {e}",
                                "chat_template" if chat_template else "messages") from e


def encode_rendered_chat(tokenizer, text: str) -> list[int]:
    # The template writes the special tokens itself, as apply_chat_template(tokenize=True) assumes.
    return list(tokenizer.encode(text, add_special_tokens=False))


def apply_chat_template(tokenizer, messages: list[dict[str, Any]], add_generation_prompt: bool = True,
                        **options: Any) -> list[int]:
    """The chat's prompt tokens (``render_chat_template`` then ``encode_rendered_chat``)."""
    text = render_chat_template(tokenizer, messages, add_generation_prompt=add_generation_prompt, **options)
    return encode_rendered_chat(tokenizer, text)


class IncrementalText:
    """Turns a request's output tokens into text as they arrive and applies stop strings.

    Text that could still turn out to be the start of a stop string is held back, so a stream never
    shows a stop string it then has to take back.
    """

    def __init__(self, tokenizer, stop: list[str] | None = None, skip_special_tokens: bool = True,
                 include_stop_str_in_output: bool = False) -> None:
        self._tokenizer = tokenizer
        self._backend = tokenizer.backend_tokenizer
        self._skip_special = skip_special_tokens
        self._stream = DecodeStream(skip_special_tokens=skip_special_tokens)
        self.token_ids: list[int] = []
        self.stop = list(stop or [])
        self.include_stop = include_stop_str_in_output
        self._hold = max((len(s) for s in self.stop), default=1) - 1
        self.text = ""  # everything decoded so far (before stop truncation)
        self.emitted = 0  # characters of ``text`` already handed out
        self.stopped_by: str | None = None

    def add_tokens(self, token_ids: list[int], final: bool = False) -> str:
        """Decode ``token_ids``; returns the newly visible text. After a stop string hits,
        ``stopped_by`` is set and the text ends at (or after, if asked) the stop string."""
        if self.stopped_by is not None:
            return ""
        self.token_ids.extend(token_ids)
        for t in token_ids:
            piece = self._stream.step(self._backend, t)
            if piece:
                self.text += piece
        if final:
            # The stream holds back bytes of an unfinished character; at the end they decode as
            # replacement characters, exactly as a one-shot decode of all the tokens would show them.
            full = self._tokenizer.decode(self.token_ids, skip_special_tokens=self._skip_special)
            if full.startswith(self.text):
                self.text = full
        if self.stop:
            search_from = max(0, self.emitted - self._hold)
            hits = [(i, s) for s in self.stop if (i := self.text.find(s, search_from)) != -1]
            if hits:
                idx, s = min(hits)
                self.stopped_by = s
                self.text = self.text[: idx + len(s)] if self.include_stop else self.text[:idx]
                final = True
        visible = len(self.text) if final else max(self.emitted, len(self.text) - self._hold)
        new = self.text[self.emitted : visible]
        self.emitted = visible
        return new


def _byte_level_alphabet() -> dict[str, int]:
    """GPT-2's byte-level BPE alphabet: the printable character that stands for each byte."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    chars, extra = {}, 0
    for b in range(256):
        if b in printable:
            chars[chr(b)] = b
        else:
            chars[chr(256 + extra)] = b
            extra += 1
    return chars


_BYTE_LEVEL = _byte_level_alphabet()


def _uses_byte_level(tokenizer) -> bool:
    decoder = getattr(getattr(tokenizer, "backend_tokenizer", None), "decoder", None)
    return decoder is not None and "ByteLevel" in repr(decoder)


def token_bytes(tokenizer, token_id: int) -> bytes:
    """The bytes one token stands for. Decoding a token alone that holds part of a UTF-8 character
    gives U+FFFD; its vocabulary entry still says which bytes it is (byte-level BPE maps each byte to
    one character, SentencePiece's byte fallback spells them ``<0xE2>``)."""
    piece = tokenizer.convert_ids_to_tokens(int(token_id))
    if isinstance(piece, str) and token_id not in tokenizer.all_special_ids:
        if len(piece) == 6 and piece.startswith("<0x") and piece.endswith(">"):
            return bytes([int(piece[3:5], 16)])
        if _uses_byte_level(tokenizer) and all(c in _BYTE_LEVEL for c in piece):
            return bytes(_BYTE_LEVEL[c] for c in piece)
    return tokenizer.decode([int(token_id)], skip_special_tokens=False).encode()


def load_chat_template(value: str) -> str:
    """``--chat-template``: a file holding a Jinja chat template, or the template itself (as vLLM takes it)."""
    path = Path(value).expanduser()
    if path.is_file():
        return path.read_text()
    if "{{" in value or "{%" in value:
        return value
    raise ValueError(f"chat_template={value!r} is neither a file nor a Jinja template")
