"""The models one ``engine`` server serves: ``[[models]]`` tables of the config file or repeated
``--model NAME=PATH`` flags, each an engine config of its own under a served name, and the check that
their memory shares fit the device before anything loads."""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass
from typing import Any

from kvloom.core.config import ConfigError, EngineConfig

# Memory an OS and the frontends keep on the CPU beside the engines' KV caches and weights.
CPU_RESERVE_GIB = 2.0
CPU_DEFAULT_KV_GIB = 1.0  # EngineConfig's CPU default when kv_cache_memory_gib is unset


@dataclass
class ServedModel:
    """One model of the server: the name clients send as ``model`` and its engine settings."""

    name: str
    engine: EngineConfig

    def to_dict(self) -> dict[str, Any]:
        return {"name": self.name, "engine": dataclasses.asdict(self.engine)}

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "ServedModel":
        return cls(data["name"], EngineConfig(**data["engine"]))


def split_model_flag(value: str) -> tuple[str | None, str]:
    """``NAME=PATH`` as (NAME, PATH); a plain path (or one whose ``=`` is part of an existing file) as
    (None, PATH)."""
    name, sep, path = value.partition("=")
    if not sep or "/" in name or os.path.exists(value):
        return None, value
    if not name or not path:
        raise ConfigError(f"--model {value!r}: give NAME=PATH with both parts, e.g. --model small=/models/qwen3")
    return name, path


def models_from_flags(values: list[str], base: EngineConfig) -> list[ServedModel]:
    """Repeated ``--model`` flags: each NAME=PATH (a bare path is served under its path)."""
    models = []
    for value in values:
        name, path = split_model_flag(value)
        models.append(ServedModel(name or path, base.replace(model=path)))
    return checked(models)


def models_from_tables(tables: Any, base: EngineConfig) -> list[ServedModel]:
    """The config file's ``[[models]]`` tables: ``name`` and ``model`` each, and any engine key
    (dtype, max_model_len, plugins, quantization, gpu_memory_utilization, kv_cache_memory_gib, ...) that
    overrides the file's top-level engine keys for that model."""
    if not isinstance(tables, list) or not all(isinstance(t, dict) for t in tables) or not tables:
        raise ConfigError("models must be a list of [[models]] tables, each with name and model keys")
    models = []
    for i, table in enumerate(tables):
        table = dict(table)
        name, path = table.pop("name", None), table.get("model")
        if not isinstance(name, str) or not name:
            raise ConfigError(f"[[models]] table {i + 1} needs a name (the model name clients send)")
        if not isinstance(path, str) or not path:
            raise ConfigError(f"[[models]] table {name!r} needs a model (a path, as --model takes it)")
        for key in ("data_parallel_size", "models"):
            if key in table:
                raise ConfigError(f"[[models]] table {name!r}: {key} is a server-wide key, not a per-model one")
        overrides = EngineConfig.from_dict(table)  # unknown keys are named here
        given = {k: getattr(overrides, k) for k in {f.name for f in dataclasses.fields(EngineConfig)}
                 if k in table or (k == "plugin_options" and "plugins" in table)}
        engine = base.replace(**given)
        engine.validate()
        models.append(ServedModel(name, engine))
    return checked(models)


def checked(models: list[ServedModel]) -> list[ServedModel]:
    names = [m.name for m in models]
    dup = next((n for n in names if names.count(n) > 1), None)
    if dup is not None:
        raise ConfigError(f"the served model name {dup!r} is given twice; each model needs its own name")
    return models


def check_memory_shares(models: list[ServedModel], device: str, total_cpu_gib: float | None = None) -> None:
    """Models on one device must fit it together: on GPUs their ``gpu_memory_utilization`` shares add up
    to at most 1; on the CPU their KV caches leave the host some memory. One model is checked by its engine."""
    if len(models) < 2:
        return
    if device == "cuda":
        total = sum(m.engine.gpu_memory_utilization for m in models)
        if total > 1.0 + 1e-9:
            shares = ", ".join(f"{m.name}={m.engine.gpu_memory_utilization:g}" for m in models)
            raise ConfigError(f"the models' gpu_memory_utilization shares add up to {total:g} ({shares}), over "
                              "the 1.0 of one GPU: give each model its share, e.g. 0.6 and 0.3")
        return
    total_cpu_gib = host_memory_gib() if total_cpu_gib is None else total_cpu_gib
    kv = {m.name: m.engine.kv_cache_memory_gib or CPU_DEFAULT_KV_GIB for m in models}
    spare = total_cpu_gib - CPU_RESERVE_GIB
    if sum(kv.values()) > spare:
        sizes = ", ".join(f"{n}={g:g}" for n, g in kv.items())
        raise ConfigError(f"the models' kv_cache_memory_gib add up to {sum(kv.values()):g} GiB ({sizes}), more "
                          f"than the {spare:.1f} GiB this host can spare ({total_cpu_gib:.1f} GiB less "
                          f"{CPU_RESERVE_GIB:g})")


def host_memory_gib() -> float:
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30
