"""The model registry: one file per family registers the Hugging Face ``architectures`` it serves, each a
``DecoderLM`` subclass of the shared skeleton (``decoder.py``) stating only what differs."""

from __future__ import annotations

import importlib

# The family files, imported on first use of the registry.
FAMILY_MODULES = ("llama", "mistral", "qwen2", "qwen3", "gemma2", "gemma3", "phi3", "mixtral", "qwen2_moe",
                  "qwen3_moe", "gpt_oss")

_REGISTRY: dict[str, type] = {}
_loaded = False


def register(*architectures: str):
    """Class decorator: the family serves these ``architectures`` (config.json's ``architectures[0]``)."""

    def add(cls):
        cls.architectures = tuple(architectures)
        for arch in architectures:
            if arch in _REGISTRY:
                raise ValueError(f"architecture {arch!r} is registered twice "
                                 f"({_REGISTRY[arch].__name__}, {cls.__name__})")
            _REGISTRY[arch] = cls
        return cls

    return add


def registry() -> dict[str, type]:
    """Every supported architecture and the model class that serves it."""
    global _loaded
    if not _loaded:
        for name in FAMILY_MODULES:
            importlib.import_module(f"{__name__}.{name}")
        _loaded = True
    return dict(_REGISTRY)


def supported_architectures() -> list[str]:
    return sorted(registry())


def architecture_of(config) -> str:
    """The config's architecture; ValueError naming it and listing the supported ones when none serves it."""
    archs = list(getattr(config, "architectures", None) or [])
    arch = archs[0] if archs else None
    if arch not in registry():
        raise ValueError(f"unsupported model architecture {arch!r}; supported: {supported_architectures()}")
    return arch


def model_class(config) -> type:
    return registry()[architecture_of(config)]


def decoder_config(config):
    """The config the decoder is built from: the text model's of a multimodal checkpoint whose family serves
    its text part (``decoder_config`` of the family), else ``config`` itself."""
    return model_class(config).decoder_config(config)
