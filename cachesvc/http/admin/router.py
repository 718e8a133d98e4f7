"""The three routers the app mounts, each with the admin guard and the problem-JSON error mapping:
``/admin`` (every admin resource), ``/admin`` engines and models (this server's pool), and
vLLM's LoRA routes under ``/v1``."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import anyio
from litestar import Request, Response, Router
from litestar.di import Provide
from litestar.exceptions import ClientException

from cachesvc.cache.manager import CacheManager
from cachesvc.http.admin.adapters import AdapterController
from cachesvc.http.admin.builds import BuildController, PullController
from cachesvc.http.admin.bundles import BundleController
from cachesvc.http.admin.cache import CacheController
from cachesvc.http.admin.checkpoints import list_checkpoints, remove_checkpoint
from cachesvc.http.admin.engines import EngineController
from cachesvc.http.admin.fleet import FLEET_HANDLERS
from cachesvc.http.admin.loras import load_lora_adapter, unload_lora_adapter
from cachesvc.http.admin.models import ModelController
from cachesvc.http.admin.stats import get_stats, list_events
from cachesvc.http.auth import admin_guard
from cachesvc.http.errors import admin_exception_handlers
from inference.openai.body_checks import LARGE_BODY_BYTES, has_body, json_body_problem
from inference.serving.errors import ServingError
from inference.serving.model_pool import ModelPool


async def _reject_bad_json(request: Request) -> None:
    """``before_request``: 400 for a body nested too deep (msgspec would raise RecursionError) or
    text that is not valid Unicode (``body_checks.json_body_problem``)."""
    if not has_body(request.headers):
        return
    body = await request.body()
    if len(body) > LARGE_BODY_BYTES:
        problem = await anyio.to_thread.run_sync(json_body_problem, body)
    else:
        problem = json_body_problem(body)
    if problem is not None:
        raise ClientException(detail=problem.message)


def admin_router(*, admin_api_key: str | None, model_roots: tuple[Path, ...] | None = None) -> Router:
    """The ``/admin`` router: every admin route, its guard and its problem-JSON error mapping.

    The app must provide the ``manager`` dependency (``Provide(lambda: manager, sync_to_thread=False)``).
    """
    router = Router(
        path="/admin",
        route_handlers=[
            BundleController,
            BuildController,
            PullController,
            CacheController,
            get_stats,
            list_events,
            list_checkpoints,
            remove_checkpoint,
            AdapterController,
            *FLEET_HANDLERS,
        ],
        guards=[admin_guard(admin_api_key)],
        before_request=_reject_bad_json,
        dependencies={"model_roots": Provide(lambda: model_roots, sync_to_thread=False)},
        exception_handlers=admin_exception_handlers(),
        signature_namespace={"CacheManager": CacheManager, "Path": Path, "ModelPool": ModelPool},
    )
    drop_stale_options_handlers(router)
    return router


def drop_stale_options_handlers(router: Router) -> None:
    """Remove the OPTIONS handlers Litestar generated while registering handlers one by one.

    Litestar 2.25 creates a path's OPTIONS handler with the first handler registered there and
    keeps it when later handlers join the path, so ``Allow`` lists only the first method
    (``GET, OPTIONS`` for a path that also has DELETE). Without them, mounting this router
    builds each path from its complete method map and generates a correct OPTIONS handler.
    """
    for route in router.routes:
        handlers = getattr(route, "route_handlers", None)
        if not isinstance(handlers, list):
            continue
        handlers[:] = [
            h
            for h in handlers
            if not (set(h.http_methods) == {"OPTIONS"} and getattr(h.fn, "__name__", "") == "options_handler")
        ]


def _serving_problem(_: Any, exc: ServingError) -> Response[dict[str, Any]]:
    headers = dict(exc.headers or {})
    return Response(
        {
            "type": "about:blank",
            "title": exc.code or exc.type,
            "status": exc.status_code,
            "detail": exc.message,
        },
        status_code=exc.status_code,
        headers=headers,
        media_type="application/problem+json",
    )


def lora_router(*, admin_api_key: str | None) -> Router:
    """vLLM's runtime LoRA routes under ``/v1``, behind the admin key (they change what is served)."""
    router = Router(
        path="/v1",
        route_handlers=[load_lora_adapter, unload_lora_adapter],
        guards=[admin_guard(admin_api_key)],
        exception_handlers=admin_exception_handlers(),
        tags=["admin"],
    )
    drop_stale_options_handlers(router)
    return router


def serving_router(*, admin_api_key: str | None) -> Router:
    """``/admin/engines`` and ``/admin/models`` with the admin guard and error mapping.

    The app provides the ``manager`` and ``pool`` dependencies."""
    handlers = admin_exception_handlers()
    handlers[ServingError] = _serving_problem
    router = Router(
        path="/admin",
        route_handlers=[EngineController, ModelController],
        guards=[admin_guard(admin_api_key)],
        exception_handlers=handlers,
        signature_namespace={"CacheManager": CacheManager, "ModelPool": ModelPool},
    )
    drop_stale_options_handlers(router)
    return router


__all__ = ["admin_router", "lora_router", "serving_router"]
