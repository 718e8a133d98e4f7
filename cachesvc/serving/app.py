"""The Litestar app: OpenAI-style completions, the admin API, metrics and health in one process.

``create_app`` (vLLM's ``build_app``) wires one app around a
:class:`~inference.serving.model_pool.ModelPool` that serves every ready bundle of the catalog, loading
engines on demand through the injected ``engine_factory``; the startup model (if any) stays
loaded. Its lifespan runs the pool, the fleet agent and the bundle watch; on shutdown the pool
drains every loaded model, closes the engines and releases every bundle lease.

What the app serves is loaded in :mod:`cachesvc.serving.model_loading`; the process around it (``cachesvc
serve``: startup, signals, drain) is :mod:`cachesvc.serving.server`.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import anyio
from litestar import Litestar, Response, Router, get
from litestar.config.allowed_hosts import AllowedHostsConfig
from litestar.config.cors import CORSConfig
from litestar.di import Provide
from litestar.openapi import OpenAPIConfig, ResponseSpec

from cachesvc import __version__
from cachesvc.cache.manager import CacheManager
from cachesvc.fleet import NodeAgent
from cachesvc.http.admin.router import admin_router, lora_router, serving_router
from cachesvc.http.api_docs import RESPONSE_HEADERS, docs_asset, render_plugins
from cachesvc.http.auth import admin_guard
from cachesvc.http.dashboard import dashboard_router
from cachesvc.http.errors import admin_exception_handlers
from cachesvc.http.metrics import MetricsState, metrics_route
from cachesvc.serving.bundle_watch import BundleWatch
from cachesvc.serving.model_loading import EngineFactory, LoraAdapters, Runtime, make_pool
from cachesvc.serving.served_models import CatalogModels
from cachesvc.settings.config import ServeConfig
from inference.openai import openai_router
from inference.serving.model_pool import ModelPool

log = logging.getLogger("cachesvc.app")

#: How long the desired-state converger waits for one model load before reporting it failed.
DESIRED_LOAD_TIMEOUT_SECONDS = 600.0


def create_app(
    config: ServeConfig,
    manager: CacheManager,
    *,
    runtime: Runtime | None = None,
    metrics: MetricsState | None = None,
    engine_factory: EngineFactory | None = None,
    pool: ModelPool | None = None,
    close_manager: bool = False,
) -> Litestar:
    """Wire one app: ``/v1`` over the model pool, ``/admin`` (with ``/admin/engines`` and
    ``/admin/models``), ``/metrics``, ``/health``.

    ``runtime`` is a model loaded before the app (``serve MODEL``): it joins the pool and stays
    loaded. ``engine_factory`` loads every other model on demand (default: the backend registry)."""
    metrics = metrics or MetricsState(manager.queries)
    pool = pool or make_pool(config, manager, runtime=runtime, metrics=metrics, engine_factory=engine_factory)
    source = pool.source  # LoRA adapters at run time: names of the startup model in the catalog's names
    loras = (LoraAdapters(config, manager, runtime, source, pool) if isinstance(source, CatalogModels)
             else None)

    watch = BundleWatch(manager, pool)
    # Fleet: this node's heartbeat row and its desired-state reconciler, for the app's lifetime.
    app_loop: list[asyncio.AbstractEventLoop] = []  # set when the app starts
    agent = _node_agent(config, manager, pool, app_loop)

    @asynccontextmanager
    async def lifespan(_: Litestar) -> AsyncIterator[None]:
        app_loop.append(asyncio.get_running_loop())
        await pool.start()
        await anyio.to_thread.run_sync(agent.start)
        if runtime is not None:
            log.info("serving %s on bundle %s", config.served_name, runtime.prepared.bundle_id)
        watch.start()
        try:
            yield
        finally:
            await anyio.to_thread.run_sync(agent.stop)  # no desired-state load during the drain
            await watch.stop()
            finished = await pool.drain(config.serving.shutdown_grace_seconds)
            if not finished:
                log.warning("shutdown grace period over; cutting in-flight requests")
            await pool.stop()
            await pool.close()
            if loras is not None:
                loras.close()
            if runtime is not None:
                runtime.closed = True  # the pool closed its engine and released its lease
            if close_manager:
                manager.close()

    handlers: list[Any] = [
        *_health_routes(manager, pool),
        admin_router(admin_api_key=config.http.admin_api_key, model_roots=config.model_roots()),
        dashboard_router(),
        serving_router(admin_api_key=config.http.admin_api_key),
        lora_router(admin_api_key=config.http.admin_api_key),
        metrics_route(metrics, admin_api_key=config.http.admin_api_key),
        openai_router(pool, api_key=config.http.api_key),
    ]
    origins = config.http.cors_origins()
    return Litestar(
        route_handlers=handlers,
        # DNS rebinding: a page whose name resolves to 127.0.0.1 still sends its own Host.
        allowed_hosts=AllowedHostsConfig(allowed_hosts=list(config.http.allowed_host_headers())),
        # Browsers may call /v1 from these origins; admin routes refuse any foreign Origin in
        # their guard, so the app-wide CORS headers open nothing there.
        cors_config=CORSConfig(allow_origins=list(origins)) if origins else None,
        dependencies={
            "manager": Provide(lambda: manager, sync_to_thread=False),
            "pool": Provide(lambda: pool, sync_to_thread=False),
            "loras": Provide(lambda: loras, sync_to_thread=False),
        },
        middleware=[metrics.middleware()],
        lifespan=[lifespan],
        # The process's logging is set once, by ``cachesvc serve`` (--log-level, our format);
        # Litestar's default config would replace the root logger's handlers at startup (its
        # format, INFO whatever --log-level says). Errors are logged by our exception handlers.
        logging_config=None,
        openapi_config=_openapi_config(config.http.admin_api_key),
    )


def _health_routes(manager: CacheManager, pool: ModelPool) -> list[Any]:
    """``/health`` (liveness, load, capabilities, the catalog's last known state) and
    ``/health/ready``."""

    @get("/health", sync_to_thread=False, tags=["health"], summary="Liveness, load and capabilities")
    def health() -> dict[str, Any]:
        body = pool.health()
        body["catalog"] = manager.queries.catalog_state().to_dict()  # last known: /health never waits on it
        return body

    @get(
        "/health/ready",
        sync_to_thread=False,
        tags=["health"],
        summary="200 while requests are admitted (and the startup model is loaded)",
        responses={
            503: ResponseSpec(data_container=dict[str, bool], description="Not ready: loading or draining")
        },
    )
    def ready() -> Response[dict[str, Any]]:
        ok = pool.ready
        return Response({"ready": ok}, status_code=200 if ok else 503)

    return [health, ready]


def _node_agent(
    config: ServeConfig, manager: CacheManager, pool: ModelPool, app_loop: list[asyncio.AbstractEventLoop]
) -> NodeAgent:
    """This node's fleet agent; its desired-state loads go to ``pool`` on the app's loop
    (``app_loop``, filled when the app starts)."""

    def load_desired(bundle_id: str) -> None:
        """The converger's thread -> the pool on the app's loop: load ``bundle_id`` (desired
        ``load: true``) and keep it loaded (keep-alive -1) until an operator unloads it."""
        if not app_loop:
            raise RuntimeError("the server has not started yet")
        future = asyncio.run_coroutine_threadsafe(pool.preload(bundle_id, keep_alive=-1), app_loop[0])
        try:
            future.result(DESIRED_LOAD_TIMEOUT_SECONDS)
        except TimeoutError:
            future.cancel()
            raise RuntimeError(f"loading took longer than {DESIRED_LOAD_TIMEOUT_SECONDS:.0f} s") from None

    return NodeAgent(
        manager,
        interval=config.fleet.heartbeat_seconds,
        loaded_models=pool.loaded_names,
        allowed_roots=config.model_roots(),
        load_model=load_desired,
        event_retention=(config.fleet.event_retention_days, config.fleet.event_retention_rows),
    )


def _openapi_config(admin_api_key: str | None) -> OpenAPIConfig:
    """The OpenAPI document under ``/schema``, behind the admin key when there is one."""
    return OpenAPIConfig(
        title="cachesvc",
        version=__version__,
        description="Engine-bundle cache admin API, cache metrics and OpenAI-style completions.",
        path="/schema",
        # The JSON and two viewers whose scripts come from this server, never a CDN
        # (cachesvc.http.api_docs). With an admin key, all of it needs the key.
        render_plugins=render_plugins(),
        openapi_router=Router(
            path="/schema",
            route_handlers=[docs_asset],
            include_in_schema=False,
            guards=[admin_guard(admin_api_key)] if admin_api_key else [],
            exception_handlers=admin_exception_handlers(),
            response_headers=RESPONSE_HEADERS,
        ),
    )


__all__ = ["create_app"]
