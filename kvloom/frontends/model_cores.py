"""The frontend cores of every served model, by served name: what the HTTP server and the ZMQ gateway
look a request's ``model`` up in (each core has the model's router over its replicas, its tokenizer and
its limits). One place for it, so both frontends start the same cores and answer an unknown name alike.
A ``model`` may also name a LoRA adapter loaded in a served model's engine (``resolve_model``)."""

from __future__ import annotations

from typing import Any

from kvloom.core.config import EngineConfig
from kvloom.frontends.config import ServerConfig
from kvloom.frontends.errors import RequestError
from kvloom.frontends.frontend_core import FrontendCore, start_frontend_core


async def start_model_cores(engine_address: str | list[str], engine: EngineConfig, server: ServerConfig,
                            secret: str | None = None, models: list[dict[str, Any]] | None = None
                            ) -> dict[str, FrontendCore]:
    """Each served model's core, in the order served (the first answers requests that name none).
    ``models``: several served models (``{"name", "engine", "addresses"}`` each, from the launcher),
    else the one model at ``engine_address`` (an engine, or its replicas)."""
    if models is None:
        cores = [await start_frontend_core(engine_address, engine, server, secret)]
    else:
        # One after another: the engines load at once anyway, and transformers' lazy imports are not
        # safe from two tokenizer-loading threads at the same time.
        cores = [await start_frontend_core(m["addresses"], EngineConfig(**m["engine"]),
                                           server.replace(served_model_name=m["name"]), secret)
                 for m in models]
    return {core.ready.model_name: core for core in cores}


async def resolve_model(cores: dict[str, FrontendCore], model: str | None) -> tuple[FrontendCore, str]:
    """The core and LoRA adapter (empty for none) a request's ``model`` names: a served model, else an
    adapter of one. An adapter name this process has not seen is asked of the engines (another API worker
    may have loaded it); a name nobody serves is a 404 naming what is served."""
    if model is None or model in cores:
        return core_for(cores, model), ""
    found = _adapter_core(cores, model)
    if found is None:
        for core in cores.values():
            await core.refresh_adapters()
        found = _adapter_core(cores, model)
    if found is None:
        core_for(cores, model)  # raises the 404
    return found, model


def _adapter_core(cores: dict[str, FrontendCore], name: str) -> FrontendCore | None:
    return next((core for core in cores.values() if name in core.adapters), None)


def core_for(cores: dict[str, FrontendCore], model: str | None) -> FrontendCore:
    """The core of the served model ``model`` names (None: the first model), or a 404 naming those served."""
    if model is None:
        return next(iter(cores.values()))
    core = cores.get(model)
    if core is None:
        served = ", ".join(f"`{name}`" for name in [*cores, *(a for c in cores.values() for a in c.adapters)])
        raise RequestError(404, f"The model `{model}` does not exist; this server serves {served}.", "model")
    return core


async def close_cores(cores: dict[str, FrontendCore]) -> None:
    for core in cores.values():
        await core.client.close()
