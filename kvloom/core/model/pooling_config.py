"""An embedding model's pooling as its sentence-transformers files state it (``modules.json``, the Pooling
module's ``config.json``, a Normalize module), and the truncation (Matryoshka) sizes its config allows."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

POOLING_TYPES = ("last", "mean", "cls")
# sentence-transformers' pooling_mode_* keys, as kvloom's pooling types
_ST_MODES = {"pooling_mode_lasttoken": "last", "pooling_mode_mean_tokens": "mean", "pooling_mode_cls_token": "cls"}


@dataclass(frozen=True)
class PoolingConfig:
    """How an embedding model turns a prompt's final hidden states into one vector: ``pooling`` over the
    positions, then L2 ``normalize``; ``matryoshka_dimensions`` (empty: no truncation; ``None`` in the list's
    place: any size up to the hidden size) are the sizes a request's ``dimensions`` may truncate to."""

    pooling: str = "last"
    normalize: bool = True
    matryoshka: bool = False
    matryoshka_dimensions: tuple[int, ...] = field(default_factory=tuple)


def _read_json(path: Path) -> dict | list | None:
    try:
        return json.loads(path.read_text())
    except FileNotFoundError:
        return None
    except ValueError as e:
        raise ValueError(f"{path}: not valid JSON ({e})") from None


def read_pooling_config(folder: str | Path, hf_config=None) -> PoolingConfig | None:
    """The folder's pooling when it is a sentence-transformers model (``modules.json`` listing a Pooling
    module), else None. ValueError names a pooling mode kvloom does not serve."""
    folder = Path(folder)
    if not folder.is_dir():
        return None
    modules = _read_json(folder / "modules.json")
    if not isinstance(modules, list):
        return None
    types = {str(m.get("type", "")).rsplit(".", 1)[-1]: m for m in modules if isinstance(m, dict)}
    if "Pooling" not in types:
        return None
    st = _read_json(folder / types["Pooling"].get("path", "1_Pooling") / "config.json") or {}
    modes = [mode for key, mode in _ST_MODES.items() if st.get(key)]
    other = sorted(k for k, v in st.items() if k.startswith("pooling_mode_") and v and k not in _ST_MODES)
    if other or len(modes) > 1:
        raise ValueError(f"{folder}: pooling {other or modes} is not served; kvloom pools one of "
                         f"{list(POOLING_TYPES)} (sentence-transformers' lasttoken, mean_tokens or cls_token)")
    return PoolingConfig(modes[0] if modes else "mean", "Normalize" in types, *matryoshka_of(hf_config))


def matryoshka_of(hf_config) -> tuple[bool, tuple[int, ...]]:
    """Whether the model's config allows truncated embeddings, and the sizes it lists (empty: any size)."""
    dims = getattr(hf_config, "matryoshka_dimensions", None) if hf_config is not None else None
    flag = bool(getattr(hf_config, "is_matryoshka", False)) if hf_config is not None else False
    return bool(dims) or flag, tuple(int(d) for d in dims or ())
