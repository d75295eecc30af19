"""Loading a model's tokenizer files: a Hugging Face folder's, or the vocabulary a GGUF file embeds (converted
once and cached). Neutral ground for the frontends and the engine's structured outputs."""

from __future__ import annotations

from pathlib import Path

from kvloom.core.model.files import cache_dir, resolve_model

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
