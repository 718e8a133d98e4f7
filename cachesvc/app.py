"""The Litestar app: OpenAI-style completions, the admin API, metrics and health in one process.

``serve(config)`` does the heavy, failure-prone work before the HTTP server starts (schema
upgrade, reconcile, prepare, lease, engine load), so a bad model or a failed build exits non-zero
with the reason and nothing listens. ``create_app`` wires what is loaded into one app; the
lifespan starts the scheduler and, on shutdown, drains in-flight requests, stops the scheduler,
closes the engine and releases the bundle lease.
"""

from __future__ import annotations

import importlib
import logging
import os
import signal
import sys
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass
from types import FrameType
from typing import Any

import anyio
from litestar import Litestar, Response, get
from litestar.di import Provide
from litestar.openapi import OpenAPIConfig, ResponseSpec
from litestar.openapi.plugins import ScalarRenderPlugin, SwaggerRenderPlugin

from cachesvc import __version__
from cachesvc.config import ServeConfig, cli_message
from cachesvc.entry import open_cache
from cachesvc.errors import CacheError, ConfigError
from cachesvc.fleet import NodeAgent
from cachesvc.http.admin import admin_router
from cachesvc.http.dashboard import dashboard_router
from cachesvc.http.metrics import MetricsState, metrics_route
from cachesvc.manager import BundleLease, CacheManager
from cachesvc.records import PrepareResult
from inference.openai import OpenAIServing, ServingOptions, load_tokenizer, openai_router
from inference.runtime import Engine

log = logging.getLogger("cachesvc.app")

#: Seconds in-flight requests get to finish after SIGTERM/SIGINT before they are cut.
SHUTDOWN_GRACE_SECONDS = 30.0

EngineFactory = Callable[..., Engine]


@dataclass
class Runtime:
    """What ``load_runtime`` loaded: the prepared bundle, its lease, the engine and its server."""

    prepared: PrepareResult
    lease: BundleLease
    engine: Engine
    serving: OpenAIServing

    def close(self) -> None:
        """Close the engine and release the lease (idempotent)."""
        try:
            self.engine.close()
        finally:
            self.lease.release()


def load_runtime(
    config: ServeConfig,
    manager: CacheManager,
    *,
    engine_factory: EngineFactory | None = None,
    observer: Any = None,
) -> Runtime:
    """Prepare (hit or build), lease, load the engine and build the OpenAI server for ``config``."""
    if config.model is None:
        raise CacheError("no model to serve: pass a model id or checkpoint directory")
    prepared, lease = manager.prepare_and_lease(
        config.model,
        config.profile_request(),
        progress=lambda s, f: log.info("prepare: %s %3.0f%%", s, f * 100),
    )
    try:
        if engine_factory is None:
            from inference.runtime import load_engine

            engine_factory = load_engine
        log.info("loading engine from %s", prepared.bundle_dir)
        engine = engine_factory(prepared.bundle_dir, max_slots=config.max_batch_size)
        try:
            tokenizer = load_tokenizer(prepared.bundle_dir)
            info = engine.info
            options = ServingOptions(
                served_model_name=config.served_name,
                max_model_len=min(info.max_kv_capacity, config.max_kv_cache_capacity),
                max_input_len=min(info.max_input_len, config.max_input_len),
                max_batch_size=min(info.max_slots, config.max_batch_size),
                max_queued_requests=config.max_queued_requests,
                queue_timeout=config.queue_timeout,
                reasoning_parser=config.reasoning_parser,
                tool_call_parser=config.tool_call_parser,
                enable_auto_tool_choice=config.enable_auto_tool_choice,
                api_key=config.api_key,
                model_type=info.model_type,
                capabilities={
                    "bundle_id": prepared.bundle_id,
                    "backend": info.backend,
                    "precision": info.precision,
                },
            )
            serving = OpenAIServing(engine, tokenizer, options, observer=observer)
        except BaseException:
            engine.close()
            raise
    except BaseException:
        lease.release()
        raise
    return Runtime(prepared, lease, engine, serving)


def engine_factory_from_env() -> EngineFactory | None:
    """The engine seam: ``CACHESVC_ENGINE_FACTORY=module:callable`` replaces ``load_engine``.

    The callable takes ``(bundle_dir, *, max_slots)`` and returns an ``Engine``. Tests use it to
    run the real server with a scripted engine; it is also how another runtime can be plugged in.
    """
    spec = os.environ.get("CACHESVC_ENGINE_FACTORY")
    if not spec:
        return None
    module_name, _, attr = spec.partition(":")
    if not module_name or not attr:
        raise CacheError(f"CACHESVC_ENGINE_FACTORY must look like 'module:callable', got {spec!r}")
    factory = getattr(importlib.import_module(module_name), attr)
    if not callable(factory):
        raise CacheError(f"CACHESVC_ENGINE_FACTORY {spec!r} is not callable")
    return factory


def create_app(
    config: ServeConfig,
    manager: CacheManager,
    *,
    runtime: Runtime | None = None,
    metrics: MetricsState | None = None,
    close_manager: bool = False,
) -> Litestar:
    """Wire one app: ``/v1`` (when a runtime is loaded), ``/admin``, ``/metrics``, ``/health``."""
    metrics = metrics or MetricsState(manager)
    serving = runtime.serving if runtime is not None else None

    @get("/health", sync_to_thread=False, tags=["health"], summary="Liveness, load and capabilities")
    def health() -> dict[str, Any]:
        if serving is None:
            return {
                "status": "ok",
                "model": None,
                "active_requests": 0,
                "queued_requests": 0,
                "capabilities": {},
            }
        return serving.health()

    @get(
        "/health/ready",
        sync_to_thread=False,
        tags=["health"],
        summary="200 once the engine is loaded",
        responses={
            503: ResponseSpec(data_container=dict[str, bool], description="Not ready: loading or draining")
        },
    )
    def ready() -> Response[dict[str, Any]]:
        ok = serving is not None and serving.ready
        return Response({"ready": ok}, status_code=200 if ok else 503)

    # Fleet: this node's heartbeat row and its desired-state reconciler, for the app's lifetime.
    agent = NodeAgent(
        manager,
        interval=config.heartbeat_seconds,
        loaded_models=lambda: [config.served_name] if serving is not None and serving.ready else [],
    )

    @asynccontextmanager
    async def lifespan(_: Litestar) -> AsyncIterator[None]:
        await anyio.to_thread.run_sync(agent.start)
        if serving is not None:
            await serving.start()
            log.info(
                "serving %s on bundle %s", config.served_name, runtime.prepared.bundle_id if runtime else ""
            )
        try:
            yield
        finally:
            if serving is not None and runtime is not None:
                finished = await serving.drain(SHUTDOWN_GRACE_SECONDS)
                if not finished:
                    log.warning("shutdown grace period over; cutting in-flight requests")
                await serving.stop()
                runtime.close()
                log.info("released the lease on %s", runtime.prepared.bundle_id)
            await anyio.to_thread.run_sync(agent.stop)
            if close_manager:
                manager.close()

    handlers: list[Any] = [
        health,
        ready,
        admin_router(admin_api_key=config.admin_api_key),
        dashboard_router(),
        metrics_route(metrics, admin_api_key=config.admin_api_key),
        openai_router(lambda: serving),
    ]
    return Litestar(
        route_handlers=handlers,
        dependencies={"manager": Provide(lambda: manager, sync_to_thread=False)},
        middleware=[metrics.middleware()],
        lifespan=[lifespan],
        openapi_config=OpenAPIConfig(
            title="cachesvc",
            version=__version__,
            description="Engine-bundle cache admin API, cache metrics and OpenAI-style completions.",
            path="/schema",
            render_plugins=[SwaggerRenderPlugin(), ScalarRenderPlugin()],
        ),
    )


def serve(config: ServeConfig) -> int:
    """Run ``cachesvc serve``: prepare and load first, then serve until SIGTERM/SIGINT."""
    import uvicorn

    logging.basicConfig(
        level=getattr(logging, config.log_level.upper()),
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
        stream=sys.stderr,
        force=True,
    )
    logging.getLogger("alembic").setLevel(logging.WARNING)
    log.info("cachesvc %s: %s", __version__, config)
    for flag, given in (
        ("--enable-context-reuse", config.enable_context_reuse),
        ("--draft-top-k", config.draft_top_k is not None),
        ("--draft-step", config.draft_step is not None),
        ("--verify-tree-size", config.verify_tree_size is not None),
        ("--allowed-local-media-path", config.allowed_local_media_path is not None),
    ):
        if given:
            log.warning("%s is accepted for compatibility but has no effect in this version", flag)
    try:
        manager = open_cache(config)
    except CacheError as exc:
        log.error("cannot open the cache: %s", _describe(exc))
        return 1
    metrics = MetricsState(manager)
    try:
        report = manager.reconcile()
        log.info(
            "reconcile: adopted %d, forgotten %d, staging removed %d",
            len(report.adopted),
            len(report.forgotten),
            len(report.staging_removed),
        )
        if config.clear_engine_cache:
            cleared = manager.clear()
            log.info("--clear-engine-cache: removed %d bundles", len(cleared.evicted))
        runtime = load_runtime(
            config, manager, engine_factory=engine_factory_from_env(), observer=metrics.serving
        )
    except (CacheError, ValueError, OSError, ImportError, AttributeError) as exc:
        log.error("cannot serve %s: %s", config.model, _describe(exc))
        manager.close()
        return 1
    app = create_app(config, manager, runtime=runtime, metrics=metrics, close_manager=True)
    server = _Server(
        uvicorn.Config(
            app,
            host=config.host,
            port=config.port,
            log_level=config.log_level,
            timeout_graceful_shutdown=int(SHUTDOWN_GRACE_SECONDS),
            lifespan="on",
        ),
        on_exit=runtime.serving.begin_drain,
    )
    # uvicorn restores the previous handlers after its graceful shutdown and re-raises the signal
    # it caught; with the defaults that kills the process (exit -15) or raises KeyboardInterrupt.
    # The shutdown already happened in full by then (a second signal during it makes uvicorn cut
    # the grace period short), so signals from here on are only absorbed while we close and exit.
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, _absorb_signal)
    try:
        server.run()
    finally:
        # Ignored, not handled, from here: Python resets signals with Python-level handlers to
        # their defaults while the interpreter shuts down, so a second SIGTERM (orchestrators
        # repeat them) would otherwise kill a process that has already shut down cleanly.
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, signal.SIG_IGN)
        runtime.close()  # idempotent; covers a server that failed to start
    return 0 if server.started else 1


def _describe(exc: BaseException) -> str:
    return cli_message(exc) if isinstance(exc, ConfigError) else str(exc)


def _absorb_signal(sig: int, frame: FrameType | None) -> None:
    log.info("received %s after shutdown; exiting", signal.Signals(sig).name)


def _server_base() -> type:
    import uvicorn

    return uvicorn.Server


class _Server(_server_base()):  # type: ignore[misc]
    """uvicorn's server, telling the OpenAI server to stop admitting as soon as a signal lands."""

    def __init__(self, config: Any, *, on_exit: Callable[[], None]) -> None:
        super().__init__(config)
        self._on_exit = on_exit

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        if sig in (signal.SIGTERM, signal.SIGINT):
            self._on_exit()
        super().handle_exit(sig, frame)


__all__ = ["Runtime", "create_app", "load_runtime", "serve"]
