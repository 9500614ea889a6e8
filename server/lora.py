"""vLLM's POST /v1/load_lora_adapter and /v1/unload_lora_adapter: LoRA adapters at run time.

Both answer 404 unless ``lora.allow_runtime_updates`` is set (vLLM leaves them unrouted
then), and 403 to a key whose tenant is not in ``server.admin_tenants`` when that is set. A ``lora_path`` must lie, once symbolic links and ``..`` are resolved, inside one of
``lora.allowed_dirs``, and so must everything the adapter directory holds; errors never echo
the resolved path or the allowed directories. The Engine's changes run in the engine task
between steps, one load or unload at a time; success is vLLM's plain-text line.
"""

from __future__ import annotations

import os

import structlog
from aiohttp import web

from heron.core.async_engine import EngineStoppedError
from heron.core.lora import AdapterBusyError, AdapterError
from heron.server.appkeys import ADAPTER_LOCK, ASYNC_ENGINE, CONFIG, MODEL_NAME
from heron.server.errors import APIError, bad_request, decode_body
from heron.server.middleware import tenant_of
from heron.server.protocol import LoadLoraAdapterRequest, UnloadLoraAdapterRequest

log = structlog.get_logger("heron.server")


async def load_lora_adapter(request: web.Request) -> web.Response:
    """Load the PEFT adapter at ``lora_path`` as ``lora_name``; requests whose ``model`` is
    ``lora_name`` then use it. 400: the name is taken, or the adapter is bad (missing
    files, rank above ``lora.max_rank``, a module the model lacks, wrong shapes: the
    loader's message); 403: the path is outside ``lora.allowed_dirs``."""
    app = request.app
    _check_allowed(request)
    req = await decode_body(request, LoadLoraAdapterRequest)
    name, engine = req.lora_name, app[ASYNC_ENGINE]
    path = allowed_path(req.lora_path, app[CONFIG].lora.allowed_dirs)
    async with app[ADAPTER_LOCK]:  # NOTE: the name check and the load must not interleave
        if name == app[MODEL_NAME] or name in engine.adapters:
            raise bad_request(f"`{name}` is the base model's name; choose another `lora_name`"
                              if name == app[MODEL_NAME] else
                              f"the LoRA adapter `{name}` has already been loaded",
                              param="lora_name", code="adapter_exists")
        try:
            await engine.load_adapter(name, path)
        except AdapterError as e:
            raise bad_request(str(e), param="lora_path", code="invalid_adapter") from None
        except EngineStoppedError:
            raise APIError(503, "the engine is not running", code="engine_stopped") from None
    log.info("lora adapter loaded", adapter=name, path=path)
    return web.Response(text=f"Success: LoRA adapter '{name}' added successfully.")


async def unload_lora_adapter(request: web.Request) -> web.Response:
    """Unload ``lora_name``. NOTE: it does not wait for the requests using the adapter:
    while any is running or waiting the answer is 409 ``adapter_in_use`` and the adapter
    stays loaded (retry once they finished). 404: no adapter of that name is loaded."""
    app = request.app
    _check_allowed(request)
    req = await decode_body(request, UnloadLoraAdapterRequest)
    name, engine = req.lora_name, app[ASYNC_ENGINE]
    not_found = APIError(404, f"the LoRA adapter `{name}` cannot be found",
                         param="lora_name", code="adapter_not_found")
    async with app[ADAPTER_LOCK]:
        if name not in engine.adapters:
            raise not_found
        try:
            await engine.unload_adapter(name)
        except AdapterBusyError:
            raise APIError(409, f"the LoRA adapter `{name}` is in use by running or waiting "
                           "requests; unloading does not wait for them: retry once they "
                           "finished", param="lora_name", code="adapter_in_use") from None
        except KeyError:
            raise not_found from None
        except EngineStoppedError:
            raise APIError(503, "the engine is not running", code="engine_stopped") from None
    log.info("lora adapter unloaded", adapter=name)
    return web.Response(text=f"Success: LoRA adapter '{name}' removed successfully.")


def _check_allowed(request: web.Request) -> None:
    config = request.app[CONFIG]
    if not config.lora.allow_runtime_updates:
        raise APIError(404, "loading and unloading LoRA adapters at run time is disabled; "
                       "set `lora.allow_runtime_updates = true` (and `lora.allowed_dirs`) "
                       "in the server's configuration to enable it",
                       code="runtime_updates_disabled")
    admins = config.server.admin_tenants
    if admins and tenant_of(request) not in admins:
        raise APIError(403, "this API key may not load or unload LoRA adapters (its tenant "
                       "is not in `server.admin_tenants`)", code="not_an_admin")


def allowed_path(given: str, allowed_dirs: list[str]) -> str:
    """``given`` with symbolic links and ``..`` resolved, if it and every entry of it lie
    inside one of ``allowed_dirs`` (resolved the same way); else a 403 that names neither."""
    try:
        path = os.path.realpath(given)
    except (ValueError, OSError):  # a NUL byte, a name too long
        raise bad_request("`lora_path` is not a valid path", param="lora_path") from None
    roots = [os.path.realpath(d) for d in allowed_dirs]
    if not roots:
        raise _forbidden("no directory is allowed: set `lora.allowed_dirs`")
    if not _inside(path, roots):
        raise _forbidden("`lora_path` is outside the directories `lora.allowed_dirs` allows "
                         "(symbolic links and `..` are resolved first)")
    try:  # the loader reads the directory's files: a link among them must not lead out
        entries = [e.path for e in os.scandir(path)] if os.path.isdir(path) else []
    except OSError:
        entries = []  # unreadable: the loader says so
    if any(not _inside(os.path.realpath(e), roots) for e in entries):
        raise _forbidden("`lora_path` holds a symbolic link that leads outside the "
                         "directories `lora.allowed_dirs` allows")
    return path


def _inside(path: str, roots: list[str]) -> bool:
    return any(os.path.commonpath([path, root]) == root for root in roots)


def _forbidden(message: str) -> APIError:
    return APIError(403, message, param="lora_path", code="path_not_allowed")
