"""The server process: ``cachesvc serve`` from its first log line to its exit status.

``serve(config)`` (vLLM's ``run_server``) does the heavy, failure-prone work before the HTTP
server starts (schema upgrade, reconcile, and with a model argument or the default model:
prepare, lease, engine load), so a bad model or a failed build exits non-zero with the reason and
nothing listens. Then it runs the app (:func:`cachesvc.serving.app.create_app`) under uvicorn until
SIGTERM/SIGINT, draining in-flight requests before uvicorn shuts down (:class:`_Server`).
"""

from __future__ import annotations

import asyncio
import logging
import signal
import sys
from collections.abc import Callable
from types import FrameType
from typing import Any

from cachesvc import __version__
from cachesvc.cache.manager import CacheManager
from cachesvc.errors import CacheError, ConfigError, QualityGateError
from cachesvc.http.metrics import MetricsState
from cachesvc.serving.app import create_app
from cachesvc.serving.default_model import fp32_fallback, startup_config
from cachesvc.serving.entry import open_cache
from cachesvc.serving.model_loading import EngineFactory, Runtime, load_runtime, make_pool
from cachesvc.settings.config import ServeConfig, cli_message
from inference.serving.model_pool import ModelPool

log = logging.getLogger("cachesvc.app")

#: Extra seconds uvicorn waits for connections after the app's drain, so the answers that end
#: the drain (503 bodies, final stream chunks) are written before any connection is cut.
_FLUSH_SECONDS = 10.0


def load_startup_runtime(config: ServeConfig, manager: CacheManager, engine_factory: EngineFactory | None,
                         metrics: MetricsState, *, default: bool) -> Runtime:
    """:func:`~cachesvc.serving.model_loading.load_runtime` of the startup model, observed by the serving
    metrics under its served name. The default model (``default``) falls back to fp32 where its
    file's precision fails the quality gate (:func:`cachesvc.serving.default_model.fp32_fallback`)."""
    observer = metrics.serving.for_model(config.served_name)
    try:
        return load_runtime(config, manager, engine_factory=engine_factory, observer=observer)
    except QualityGateError as exc:
        if not default:
            raise
        fp32 = fp32_fallback(config, exc)
        return load_runtime(fp32, manager, engine_factory=engine_factory, observer=observer)


def serve(
    config: ServeConfig,
    *,
    engine_factory: EngineFactory | None = None,
    default_model: Callable[[], tuple[str, str]] | None = None,
) -> int:
    """Run ``cachesvc serve``: reconcile, prepare and load the startup model (if any), then serve
    the whole catalog until SIGTERM/SIGINT.

    Without a model, ``default_model()`` names the model to prepare (a hit after the first run)
    and keep loaded, beside the catalog's other ready bundles, served on demand."""
    import uvicorn

    logging.basicConfig(
        level=getattr(logging, config.http.log_level.upper()),
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
        stream=sys.stderr,
        force=True,
    )
    logging.getLogger("alembic").setLevel(logging.WARNING)
    log.info("cachesvc %s: %s", __version__, config)
    try:
        manager = open_cache(config, serving=True)
    except CacheError as exc:
        log.error("cannot open the cache: %s", _describe(exc))
        return 1
    metrics = MetricsState(manager.queries)
    runtime: Runtime | None = None
    is_default = False
    try:
        report = manager.reconciler.reconcile()
        log.info(
            "reconcile: adopted %d, forgotten %d, staging removed %d, stale %d, ready again %d",
            len(report.adopted),
            len(report.forgotten),
            len(report.staging_removed),
            len(report.stale),
            len(report.restored),
        )
        if config.cache.clear_engine_cache:
            cleared = manager.evictor.clear()
            log.info("--clear-engine-cache: removed %d bundles", len(cleared.evicted))
        if config.build.model is None and default_model is not None:
            chosen = startup_config(config, manager, default_model)
            if chosen is not None:
                is_default = True
                config = chosen
        if config.build.model is not None:
            runtime = load_startup_runtime(config, manager, engine_factory, metrics, default=is_default)
    except (CacheError, ValueError, OSError, ImportError, AttributeError) as exc:
        log.error("cannot serve %s: %s", config.build.model or "the catalog", _describe(exc))
        manager.close()
        return 1
    pool = make_pool(
        config,
        manager,
        runtime=runtime,
        metrics=metrics,
        engine_factory=engine_factory,
    )
    app = create_app(config, manager, runtime=runtime, metrics=metrics, pool=pool, close_manager=True)
    server = _Server(
        uvicorn.Config(
            app,
            host=config.http.host,
            port=config.http.port,
            log_level=config.http.log_level,
            # Longer than the app's drain: uvicorn only waits for the last answers to be written.
            timeout_graceful_shutdown=int(config.serving.shutdown_grace_seconds + _FLUSH_SECONDS),
            lifespan="on",
        ),
        serving=pool,
        grace=config.serving.shutdown_grace_seconds,
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
        if runtime is not None:
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
    """uvicorn's server, draining the OpenAI server *before* uvicorn starts its own shutdown.

    uvicorn closes its listening socket as soon as it begins to shut down, so a drain run in
    the lifespan's shutdown would refuse new connections instead of answering 503, and would
    start only after uvicorn had already cut requests at its own timeout. So on the first
    SIGTERM/SIGINT: stop admitting (new ``/v1`` requests get 503 ``server_unavailable`` while
    the socket stays open), wait up to the grace period, fail what is left with proper answers,
    and only then let uvicorn shut down. A second signal skips the wait (uvicorn's behaviour).
    """

    def __init__(self, config: Any, *, serving: ModelPool, grace: float) -> None:
        super().__init__(config)
        self._serving = serving
        self._grace = grace
        self._drain: asyncio.Task[None] | None = None
        self._loop: asyncio.AbstractEventLoop | None = None

    async def startup(self, sockets: Any = None) -> None:
        self._loop = asyncio.get_running_loop()
        await super().startup(sockets)

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        loop = self._loop
        if (
            sig in (signal.SIGTERM, signal.SIGINT)
            and self._drain is None
            and not self.should_exit
            and loop is not None
            and self.started
        ):
            self._serving.begin_drain()  # a plain flag: safe inside a signal handler
            self._captured_signals.append(sig)  # uvicorn re-raises captured signals at the end
            loop.call_soon_threadsafe(self._start_drain)
            return
        super().handle_exit(sig, frame)

    def _start_drain(self) -> None:
        if self._drain is None:
            self._drain = asyncio.ensure_future(self._drain_then_exit())

    async def _drain_then_exit(self) -> None:
        try:
            if not await self._serving.drain(self._grace):
                log.warning(
                    "shutdown grace period (%.0f s) over; failing the requests still in flight with 503",
                    self._grace,
                )
                # Queued requests get a 503 body, running streams an error chunk and [DONE].
                await self._serving.stop()
                await self._serving.drain(_FLUSH_SECONDS)
        finally:
            self.should_exit = True


__all__ = ["load_startup_runtime", "serve"]
