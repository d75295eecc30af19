"""Text handling shared by every frontend: tokenizer loading, chat templates, incremental
detokenization (safe across multi-byte characters) and stop strings."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from tokenizers.decoders import DecodeStream

from kvloom.core.model_files import cache_dir, resolve_model


TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")


def has_tokenizer(model: str) -> bool:
    """Whether the model ships a tokenizer (a config-only folder for dummy weights does not)."""
    path = resolve_model(model)
    return path.suffix == ".gguf" or any((path / name).exists() for name in TOKENIZER_FILES)


def load_tokenizer(model: str, tokenizer: str | None = None):
    """A Hugging Face fast tokenizer from a folder or from a GGUF file's embedded vocabulary.

    Converting a GGUF vocabulary takes seconds, so the converted tokenizer is cached as a folder.
    """
    from transformers import AutoTokenizer

    path = Path(tokenizer).expanduser() if tokenizer else resolve_model(model)
    if path.is_file() and path.suffix == ".gguf":
        stat = path.stat()
        cached = cache_dir() / "tokenizers" / f"{path.stem}-{stat.st_size}-{int(stat.st_mtime)}"
        if (cached / "tokenizer_config.json").exists():
            return AutoTokenizer.from_pretrained(str(cached))
        tok = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
        try:
            tok.save_pretrained(str(cached))
        except OSError:  # a read-only cache only costs the conversion next time
            pass
        return tok
    return AutoTokenizer.from_pretrained(str(path))


def render_chat_template(tokenizer, messages: list[dict[str, Any]], add_generation_prompt: bool = True) -> str:
    """The chat as the text the model reads; ``encode_rendered_chat`` of it equals apply_chat_template."""
    if not getattr(tokenizer, "chat_template", None):
        raise ValueError("this model's tokenizer has no chat template; send a plain completion prompt instead")
    return tokenizer.apply_chat_template(messages, add_generation_prompt=add_generation_prompt, tokenize=False)


def encode_rendered_chat(tokenizer, text: str) -> list[int]:
    # The template writes the special tokens itself, as apply_chat_template(tokenize=True) assumes.
    return list(tokenizer.encode(text, add_special_tokens=False))


def apply_chat_template(tokenizer, messages: list[dict[str, Any]], add_generation_prompt: bool = True,
                        **kwargs: Any) -> list[int]:
    if not getattr(tokenizer, "chat_template", None):
        raise ValueError("this model's tokenizer has no chat template; send a plain completion prompt instead")
    ids = tokenizer.apply_chat_template(messages, add_generation_prompt=add_generation_prompt, tokenize=True, **kwargs)
    if isinstance(ids, dict) or hasattr(ids, "keys"):  # transformers 5 returns a BatchEncoding
        ids = ids["input_ids"]
    return list(ids)


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
