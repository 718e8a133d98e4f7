"""The Litestar app: OpenAI-style completions, the admin API, metrics and health in one process.

``serve(config)`` does the heavy, failure-prone work before the HTTP server starts (schema
upgrade, reconcile, and with a model argument: prepare, lease, engine load), so a bad model or a
failed build exits non-zero with the reason and nothing listens. ``create_app`` wires one app
around a :class:`~inference.openai.pool.ModelPool` that serves every ready bundle of the catalog,
loading engines on demand through the injected ``engine_factory``; the startup model (if any)
stays loaded. On shutdown the pool drains every loaded model, closes the engines and releases
every bundle lease.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
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
from litestar import Litestar, Response, Router, get
from litestar.config.allowed_hosts import AllowedHostsConfig
from litestar.config.cors import CORSConfig
from litestar.di import Provide
from litestar.openapi import OpenAPIConfig, ResponseSpec
from litestar.openapi.plugins import JsonRenderPlugin

from cachesvc import __version__
from cachesvc.config import ServeConfig, cli_message
from cachesvc.entry import open_cache
from cachesvc.errors import CacheError, CatalogUnavailableError, ConfigError, QualityGateError
from cachesvc.fleet import NodeAgent
from cachesvc.http.admin import admin_router
from cachesvc.http.auth import admin_guard
from cachesvc.http.dashboard import dashboard_router
from cachesvc.http.errors import admin_exception_handlers
from cachesvc.http.metrics import MetricsState, metrics_route
from cachesvc.http.serving import serving_router
from cachesvc.manager import BundleLease, CacheManager, CombinedLease
from cachesvc.records import PrepareResult
from cachesvc.served_models import CatalogModels
from inference.build_profile import CHAIN_SPECULATIVE_METHODS, METHODS_WITH_DRAFT_BUNDLE
from inference.context_cache import PrefixStore
from inference.openai import OpenAIServing, ServingOptions, load_tokenizer, openai_router
from inference.openai.pool import HandleFactory, ModelPool, ModelRef, PoolLimits
from inference.runtime.protocol import Engine
from inference.speculative import ProposerFactory
from inference.structured import GrammarLimits

log = logging.getLogger("cachesvc.app")

#: Seconds in-flight requests get to finish after SIGTERM/SIGINT; then what is left is failed
#: with a proper answer (503 ``server_unavailable``, or an error chunk and ``[DONE]`` in a
#: stream). ``CACHESVC_SHUTDOWN_GRACE_SECONDS`` overrides it (tests, orchestrators with a
#: shorter kill timeout).
SHUTDOWN_GRACE_SECONDS = float(os.environ.get("CACHESVC_SHUTDOWN_GRACE_SECONDS", "30"))
#: Extra seconds uvicorn waits for connections after the app's drain, so the answers that end
#: the drain (503 bodies, final stream chunks) are written before any connection is cut.
_FLUSH_SECONDS = 10.0
#: How long the desired-state converger waits for one model load before reporting it failed.
DESIRED_LOAD_TIMEOUT_SECONDS = 600.0

EngineFactory = Callable[..., Engine]


@dataclass
class Runtime:
    """What ``load_runtime`` loaded: the prepared bundle, its lease, the engine and its server."""

    prepared: PrepareResult
    lease: BundleLease
    engine: Engine
    serving: OpenAIServing

    closed: bool = False

    def close(self) -> None:
        """Close the engine (and a draft engine) and release the lease(s) (idempotent)."""
        if self.closed:
            return
        self.closed = True
        try:
            self.serving.close_engine()
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
    # The full re-hash against the manifest happens here, once per start (every other load
    # checks sizes and sampled hashes): a corrupt bundle is rebuilt, never loaded.
    prepared, lease = manager.prepare_and_lease(
        config.model,
        config.profile_request(),
        progress=lambda s, f: log.info("prepare: %s %3.0f%%", s, f * 100),
        full_verify=True,
    )
    try:
        if prepared.draft_bundle_id is not None:  # speculative draft_model: its own bundle, leased too
            lease = CombinedLease(lease, manager.lease(prepared.draft_bundle_id))
        engine_factory = engine_factory or _default_engine_factory
        log.info("loading engine from %s", prepared.bundle_dir)
        serving = build_serving(
            config,
            engine_factory,
            prepared.bundle_dir,
            prepared.bundle_id,
            name=config.served_name,
            observer=observer,
            check_model_name=False,
            draft_dir=prepared.draft_bundle_dir,
        )
        engine = serving.engine
    except BaseException:
        lease.release()
        raise
    return Runtime(prepared, lease, engine, serving)


def _load_startup_runtime(config: ServeConfig, manager: CacheManager, engine_factory: EngineFactory | None,
                          metrics: MetricsState, *, default: bool) -> Runtime:
    """:func:`load_runtime` of the startup model. The default model of a first run is built at its
    file's precision (int4 for SmolLM2's Q4_1) only where that passes the quality gate on this
    CPU; otherwise it falls back to fp32 with one line saying why."""
    observer = metrics.serving.for_model(config.served_name)
    try:
        return load_runtime(config, manager, engine_factory=engine_factory, observer=observer)
    except QualityGateError as exc:
        if not default or config.precision != "auto":
            raise
        log.warning("%s; serving the default model at fp32 instead", exc)
        fp32 = dataclasses.replace(config, precision="fp32")
        return load_runtime(fp32, manager, engine_factory=engine_factory, observer=observer)


def _default_engine_factory(bundle_dir: Any, *, max_slots: int) -> Engine:
    # Imported here: the registry imports a runtime (onnxruntime) only when a bundle loads.
    from inference.runtime.registry import load_engine

    return load_engine(bundle_dir, max_slots=max_slots)


def build_serving(
    config: ServeConfig,
    engine_factory: EngineFactory,
    bundle_dir: Any,
    bundle_id: str,
    *,
    name: str,
    observer: Any = None,
    check_model_name: bool = False,
    draft_dir: Any = None,
) -> OpenAIServing:
    """Load one bundle's engine and wrap it in its per-model handle (tokenizer, scheduler,
    parsers) with this server's limits; the engine is closed again when that fails.

    A bundle built with speculative decoding (``speculative`` in its ``engine.json``) gets its
    proposer; ``draft_model`` loads the draft bundle ``draft_dir`` next to it."""
    engine = engine_factory(bundle_dir, max_slots=config.max_batch_size)
    closers: list[Callable[[], None]] = []
    try:
        proposer = _proposer(config, engine_factory, bundle_dir, draft_dir, closers)
        tokenizer = load_tokenizer(bundle_dir)
        info = engine.info
        options = ServingOptions(
            served_model_name=name,
            max_model_len=min(info.max_kv_capacity, config.max_kv_cache_capacity),
            max_input_len=min(info.max_input_len, config.max_input_len),
            max_batch_size=min(info.max_slots, config.max_batch_size),
            max_queued_requests=config.max_queued_requests,
            queue_timeout=config.queue_timeout,
            reasoning_parser=config.reasoning_parser,
            tool_call_parser=config.tool_call_parser,
            enable_auto_tool_choice=config.enable_auto_tool_choice,
            check_model_name=check_model_name,
            model_type=info.model_type,
            grammar_limits=GrammarLimits(
                max_schema_bytes=config.max_schema_bytes,
                max_schema_properties=config.max_schema_properties,
                compile_timeout=config.grammar_compile_timeout,
            ),
            capabilities={
                "bundle_id": bundle_id,
                "backend": info.backend,
                "precision": info.precision,
                "device": info.device,
                "memory_bytes": info.memory_bytes,
            },
        )
        return OpenAIServing(
            engine,
            tokenizer,
            options,
            observer=observer,
            context_cache=_context_cache(config, bundle_id),
            prefill_chunk=_prefill_chunk(),
            proposer=proposer,
            closers=closers,
        )
    except BaseException:
        engine.close()
        for close in closers:
            close()
        raise


def _proposer(
    config: ServeConfig,
    engine_factory: EngineFactory,
    bundle_dir: Any,
    draft_dir: Any,
    closers: list[Callable[[], None]],
) -> ProposerFactory | None:
    """The speculative proposer of a bundle built with ``ngram`` or ``draft_model`` (None for
    other bundles). The launch's ``--speculative-config`` options (lookup window, tokens per step)
    apply when its method is the bundle's."""
    from inference.runtime.registry import read_meta
    from inference.speculative import proposer_factory

    record = read_meta(bundle_dir).get("speculative")
    if not isinstance(record, dict) or record.get("method") not in CHAIN_SPECULATIVE_METHODS:
        return None
    spec = config.speculative_config
    options = dict(record)
    steps: int | None = None
    if spec is not None and spec.method == record["method"]:
        options.update({k: v for k, v in spec.to_dict().items() if v is not None and k != "model"})
        steps = config.effective_draft_step
    draft = None
    if record["method"] in METHODS_WITH_DRAFT_BUNDLE:
        if draft_dir is None:
            log.warning("bundle %s speculates with a draft model whose bundle is not ready here; "
                        "decoding without speculation", bundle_dir)
            return None
        draft = engine_factory(draft_dir, max_slots=config.max_batch_size)
        closers.append(draft.close)
    return proposer_factory(options, num_speculative_tokens=steps, draft_engine=draft)


def handle_factory(
    config: ServeConfig, engine_factory: EngineFactory | None, metrics: MetricsState | None
) -> HandleFactory:
    """The pool's loader: a model's handle from its bundle, with its own metrics label."""
    factory = engine_factory or _default_engine_factory

    def build(ref: ModelRef) -> OpenAIServing:
        observer = metrics.serving.for_model(ref.name) if metrics is not None else None
        return build_serving(
            config,
            factory,
            ref.bundle_dir,
            ref.bundle_id,
            name=ref.name,
            observer=observer,
            draft_dir=ref.draft_bundle_dir,
        )

    return build


def _prefill_chunk() -> int:
    """``CACHESVC_PREFILL_CHUNK``: prompt tokens prefilled per scheduler step (default 256).

    Smaller chunks let running streams decode more often while a long prompt is prefilled;
    larger ones prefill that prompt a little faster."""
    raw = os.environ.get("CACHESVC_PREFILL_CHUNK", "256")
    try:
        value = int(raw)
    except ValueError:
        value = 0
    if value < 1:
        raise ValueError(f"CACHESVC_PREFILL_CHUNK must be a positive integer, got {raw!r}")
    return value


def _context_cache(config: ServeConfig, bundle_id: str) -> PrefixStore | None:
    """The prefix store of ``--enable-context-reuse``, namespaced by the bundle (so records never
    serve another model or build); None when reuse is off."""
    if not config.enable_context_reuse:
        return None
    return PrefixStore(
        f"bundle:{bundle_id}",
        max_records=config.context_cache_max_records,
        max_bytes=config.context_cache_partial_kv_snapshot_pool_bytes,
    )


def engine_factory_from_env() -> EngineFactory | None:
    """Test-only entry to the engine seam for a child ``cachesvc serve`` process.

    ``serve(config, engine_factory=...)`` and ``create_app(..., engine_factory=...)`` are the
    seam; a test that spawns the real console script cannot pass a callable, so
    ``cachesvc serve`` (the CLI only) reads ``CACHESVC_ENGINE_FACTORY=module:callable`` and
    injects it through the same parameter. The callable takes ``(bundle_dir, *, max_slots)``
    and returns an ``Engine``. Backends belong in ``inference.runtime.registry``, not here.
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

    watch = _BundleWatch(manager, pool)
    # Fleet: this node's heartbeat row and its desired-state reconciler, for the app's lifetime.
    app_loop: list[asyncio.AbstractEventLoop] = []  # set when the app starts

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

    agent = NodeAgent(
        manager,
        interval=config.heartbeat_seconds,
        loaded_models=pool.loaded_names,
        allowed_roots=config.model_roots(),
        load_model=load_desired,
        event_retention=(config.event_retention_days, config.event_retention_rows),
    )

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
            finished = await pool.drain(SHUTDOWN_GRACE_SECONDS)
            if not finished:
                log.warning("shutdown grace period over; cutting in-flight requests")
            await pool.stop()
            await pool.close()
            if runtime is not None:
                runtime.closed = True  # the pool closed its engine and released its lease
            if close_manager:
                manager.close()

    handlers: list[Any] = [
        health,
        ready,
        admin_router(admin_api_key=config.admin_api_key, model_roots=config.model_roots()),
        dashboard_router(),
        serving_router(admin_api_key=config.admin_api_key),
        metrics_route(metrics, admin_api_key=config.admin_api_key),
        openai_router(pool, api_key=config.api_key),
    ]
    origins = config.cors_origins()
    return Litestar(
        route_handlers=handlers,
        # DNS rebinding: a page whose name resolves to 127.0.0.1 still sends its own Host.
        allowed_hosts=AllowedHostsConfig(allowed_hosts=list(config.allowed_host_headers())),
        # Browsers may call /v1 from these origins; admin routes refuse any foreign Origin in
        # their guard, so the app-wide CORS headers open nothing there.
        cors_config=CORSConfig(allow_origins=list(origins)) if origins else None,
        dependencies={
            "manager": Provide(lambda: manager, sync_to_thread=False),
            "pool": Provide(lambda: pool, sync_to_thread=False),
        },
        middleware=[metrics.middleware()],
        lifespan=[lifespan],
        openapi_config=OpenAPIConfig(
            title="cachesvc",
            version=__version__,
            description="Engine-bundle cache admin API, cache metrics and OpenAI-style completions.",
            path="/schema",
            # The JSON only: the HTML viewers load their scripts from a CDN (blank offline, and
            # a third party learns who reads the docs). With an admin key, the schema needs it.
            render_plugins=[JsonRenderPlugin()],
            openapi_router=Router(
                path="/schema",
                route_handlers=[],
                include_in_schema=False,
                guards=[admin_guard(config.admin_api_key)] if config.admin_api_key else [],
                exception_handlers=admin_exception_handlers(),
            ),
        ),
    )


def make_pool(
    config: ServeConfig,
    manager: CacheManager,
    *,
    runtime: Runtime | None = None,
    metrics: MetricsState | None = None,
    engine_factory: EngineFactory | None = None,
) -> ModelPool:
    """The model pool over the catalog, with the startup model (``runtime``) adopted and kept."""
    source = CatalogModels(manager, max_slots=config.max_batch_size)
    pool = ModelPool(
        source,
        handle_factory(config, engine_factory, metrics),
        PoolLimits(
            max_loaded=config.max_loaded_models,
            memory_budget=config.memory_budget_bytes,
            keep_alive=config.keep_alive,
            queue_timeout=config.queue_timeout,
            unload_grace=SHUTDOWN_GRACE_SECONDS,
            max_queued=config.max_queued_requests,
        ),
        observer=metrics.pool if metrics is not None else None,
    )
    if runtime is not None:
        names = [config.served_name, runtime.serving.options.served_model_name]
        if config.model is not None:
            names.append(config.model)
        names = list(dict.fromkeys(names))
        for name in names:
            source.startup[name] = runtime.prepared.bundle_id
        info = runtime.engine.info
        ref = ModelRef(
            name=config.served_name,
            bundle_id=runtime.prepared.bundle_id,
            bundle_dir=runtime.prepared.bundle_dir,
            backend=info.backend,
            precision=info.precision,
            max_model_len=runtime.serving.options.max_model_len,
            memory_bytes=info.memory_bytes,
        )
        pool.adopt(ref, runtime.serving, runtime.lease, keep_alive=-1, names=names)
        pool.primary = config.served_name
    return pool


class _BundleWatch:
    """Takes a loaded model out of service when its bundle is found corrupt.

    This process learns it at once (a verify through the admin API calls the manager's
    listener); another process (``cachesvc bundles verify``) only through the catalog, which
    is polled every ``interval`` seconds for every loaded bundle. Either way ``/v1`` answers
    503 with the reason for that model, and once its running requests are done the engine is
    unloaded and the lease released, so the bundle can be rebuilt.
    """

    def __init__(self, manager: CacheManager, pool: ModelPool, interval: float = 5.0) -> None:
        self.manager = manager
        self.pool = pool
        self.interval = interval
        self._loop: asyncio.AbstractEventLoop | None = None
        self._poller: asyncio.Task[None] | None = None
        manager.verifier.add_corrupt_listener(self._on_corrupt)

    def start(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._poller = asyncio.ensure_future(self._poll())

    async def stop(self) -> None:
        if self._poller is not None and not self._poller.done():
            self._poller.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._poller
        self._loop = None

    def _on_corrupt(self, bundle_id: str, detail: str) -> None:
        # Called from whichever thread verified the bundle.
        loop = self._loop
        if loop is not None and not loop.is_closed():
            loop.call_soon_threadsafe(self._take_down, bundle_id, detail)

    async def _poll(self) -> None:
        while True:
            await asyncio.sleep(self.interval)
            for status in self.pool.engines():
                bid = status.bundle_id
                try:
                    info = await asyncio.to_thread(self.manager.catalog.get_bundle, bid)
                except CatalogUnavailableError:
                    continue  # logged once per outage by the catalog's health tracker
                except Exception:  # a busy or broken catalog must not take the model down
                    log.warning("could not read the state of bundle %s", bid, exc_info=True)
                    continue
                if info is None or info.state != "ready":
                    self._take_down(
                        bid, (info.error if info is not None else None) or "no longer in the catalog"
                    )

    def _take_down(self, bundle_id: str, detail: str) -> None:
        if self.pool.find(bundle_id) is None:
            return
        reason = (
            f"the model's bundle {bundle_id} failed verification ({detail}); it is no longer served. "
            "Rebuild it (restart the server, or POST /admin/builds)"
        )
        log.error("%s", reason)
        self.pool.take_down(bundle_id, reason)


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
        level=getattr(logging, config.log_level.upper()),
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
        stream=sys.stderr,
        force=True,
    )
    logging.getLogger("alembic").setLevel(logging.WARNING)
    log.info("cachesvc %s: %s", __version__, config)
    for flag, given in (
        (
            "--context-cache-recurrent-snapshot-pool-bytes (these models keep no recurrent state)",
            config.context_cache_recurrent_snapshot_pool_bytes != 0,
        ),
        ("--draft-top-k", config.draft_top_k is not None),
        (
            "--draft-step (only ngram and draft_model speculate in this version)",
            config.draft_step is not None
            and (
                config.speculative_config is None
                or config.speculative_config.method not in CHAIN_SPECULATIVE_METHODS
            ),
        ),
        ("--verify-tree-size", config.verify_tree_size is not None),
        ("--allowed-local-media-path", config.allowed_local_media_path is not None),
    ):
        if given:
            log.warning("%s is accepted for compatibility but has no effect in this version", flag)
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
        if config.clear_engine_cache:
            cleared = manager.evictor.clear()
            log.info("--clear-engine-cache: removed %d bundles", len(cleared.evicted))
        if config.model is None and default_model is not None:
            # A first run (no ready bundle) prepares the default model; a later run whose catalog
            # holds it starts with it again: it is loaded before /health/ready says 200, and the
            # build flags given (--max-input-len, --speculative-config, ...) apply to its bundle
            # (a hit when they name the profile it has). A catalog without it is served as it is.
            model, name = default_model()
            empty = not manager.queries.list_bundles(state="ready", limit=1).items
            if empty or manager.queries.list_bundles(state="ready", model=model, limit=1).items:
                log.info("no model given: serving the default model %s%s", model,
                         "" if empty else " and the catalog")
                is_default = True
                config = dataclasses.replace(config, model=model,
                                             served_model_name=config.served_model_name or name)
        if config.model is not None:
            runtime = _load_startup_runtime(config, manager, engine_factory, metrics, default=is_default)
    except (CacheError, ValueError, OSError, ImportError, AttributeError) as exc:
        log.error("cannot serve %s: %s", config.model or "the catalog", _describe(exc))
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
            host=config.host,
            port=config.port,
            log_level=config.log_level,
            # Longer than the app's drain: uvicorn only waits for the last answers to be written.
            timeout_graceful_shutdown=int(SHUTDOWN_GRACE_SECONDS + _FLUSH_SECONDS),
            lifespan="on",
        ),
        serving=pool,
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

    def __init__(self, config: Any, *, serving: ModelPool) -> None:
        super().__init__(config)
        self._serving = serving
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
            if not await self._serving.drain(SHUTDOWN_GRACE_SECONDS):
                log.warning(
                    "shutdown grace period (%.0f s) over; failing the requests still in flight with 503",
                    SHUTDOWN_GRACE_SECONDS,
                )
                # Queued requests get a 503 body, running streams an error chunk and [DONE].
                await self._serving.stop()
                await self._serving.drain(_FLUSH_SECONDS)
        finally:
            self.should_exit = True


__all__ = ["EngineFactory", "Runtime", "build_serving", "create_app", "load_runtime", "make_pool", "serve"]
