"""vLLM's run-time LoRA routes: ``POST /v1/load_lora_adapter`` (``lora_name``, ``lora_path``,
``load_inplace``) and ``POST /v1/unload_lora_adapter`` (``lora_name``), behind the API key like every
other route. The engine reads and checks the adapter; its refusal (a bad folder, a name in use, an
adapter still running requests) comes back as a 400, 404 or 409 naming why."""

from __future__ import annotations

from typing import TYPE_CHECKING

from msgspec import Struct
from starlette.requests import Request
from starlette.responses import PlainTextResponse

from kvloom.frontends.engine_client import EngineUnavailable, UtilityError
from kvloom.frontends.errors import RequestError
from kvloom.frontends.frontend_core import FrontendCore

if TYPE_CHECKING:
    from kvloom.frontends.api_server import OpenAIServer


class LoadLoRAAdapterRequest(Struct, forbid_unknown_fields=True):
    lora_name: str
    lora_path: str
    load_inplace: bool = False  # replace an adapter of the same name (refused while it runs requests)
    model: str | None = None  # kvloom: the base model, where several served models take adapters


class UnloadLoRAAdapterRequest(Struct, forbid_unknown_fields=True):
    lora_name: str
    lora_int_id: int | None = None  # vLLM's; the name alone identifies an adapter here
    model: str | None = None


def _lora_cores(server: "OpenAIServer", model: str | None) -> FrontendCore:
    """The served model whose engine takes the adapter: the one with LoRA on, or the one ``model`` names."""
    if model is not None:
        core = server.core_for(model)
        if not core.ready.max_loras:
            raise RequestError(400, f"the model `{model}` is served without LoRA (start it with --enable-lora)",
                               "model")
        return core
    cores = [core for core in server.cores.values() if core.ready.max_loras]
    if not cores:
        raise RequestError(400, "no served model takes LoRA adapters: start the server with --enable-lora")
    if len(cores) > 1:
        names = ", ".join(f"`{c.ready.model_name}`" for c in cores)
        raise RequestError(400, f"several served models take LoRA adapters ({names}): name one in `model`", "model")
    return cores[0]


async def _call(core: FrontendCore, method: str, *args):
    core.check_available(0)
    try:
        return await core.client.utility(method, *args, timeout=120.0)
    except UtilityError as e:
        message = str(e).split(" failed: ", 1)[-1]
        status = {"not_found": 404, "conflict": 409}.get(e.kind, 400)
        raise RequestError(status, message, "lora_name") from None
    except EngineUnavailable as e:
        raise RequestError(503, f"the engine is unavailable: {e}") from None


async def load_lora_adapter(server: "OpenAIServer", request: Request) -> PlainTextResponse:
    req: LoadLoRAAdapterRequest = await server._parse(request, LoadLoRAAdapterRequest)
    core = _lora_cores(server, req.model)
    if not req.lora_name or not req.lora_path:
        raise RequestError(400, "both `lora_name` and `lora_path` must be non-empty", "lora_name")
    if req.lora_name in server.cores:
        raise RequestError(400, f"`{req.lora_name}` is a served model's name; give the adapter another", "lora_name")
    await core.refresh_adapters()
    if req.load_inplace and req.lora_name in core.adapters:
        await _call(core, "unload_lora_adapter", req.lora_name)
        core.adapters.pop(req.lora_name, None)
    card = await _call(core, "load_lora_adapter", req.lora_name, req.lora_path)
    core.adapters[req.lora_name] = card
    return PlainTextResponse(f"Success: LoRA adapter '{req.lora_name}' added successfully.")


async def unload_lora_adapter(server: "OpenAIServer", request: Request) -> PlainTextResponse:
    req: UnloadLoRAAdapterRequest = await server._parse(request, UnloadLoRAAdapterRequest)
    core = _lora_cores(server, req.model)
    await _call(core, "unload_lora_adapter", req.lora_name)
    core.adapters.pop(req.lora_name, None)
    return PlainTextResponse(f"Success: LoRA adapter '{req.lora_name}' removed successfully.")


def routes(server: "OpenAIServer") -> list:
    from starlette.routing import Route

    async def load_endpoint(request: Request):
        return await load_lora_adapter(server, request)

    async def unload_endpoint(request: Request):
        return await unload_lora_adapter(server, request)

    return [Route("/v1/load_lora_adapter", server._endpoint(load_endpoint), methods=["POST"]),
            Route("/v1/unload_lora_adapter", server._endpoint(unload_endpoint), methods=["POST"])]
