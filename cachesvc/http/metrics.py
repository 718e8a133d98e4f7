"""Prometheus metrics: cache numbers read from the catalog at scrape time, plus serving metrics.

Every app gets its own ``CollectorRegistry`` (never the global one), so two apps in one process
(tests, or a restart in place) never clash over metric names. Cache counters are not counted
in memory: a custom collector asks ``stats()`` (computed from the catalog's events) on every
scrape, so the numbers agree across processes sharing the catalog and survive restarts.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Iterable, Sequence
from typing import Annotated, Any, Protocol

from litestar import Response, get
from litestar.enums import ScopeType
from litestar.handlers import HTTPRouteHandler
from litestar.middleware import ASGIMiddleware
from litestar.params import QueryParameter
from litestar.types import ASGIApp, Message, Receive, Scope, Send
from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    generate_latest,
)
from prometheus_client.metrics_core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)
from prometheus_client.registry import Collector

from cachesvc.cache.records import (
    BUILD_SECONDS_BUCKETS,
    BUNDLE_STATES,
    EVICT_REASONS,
    CacheStats,
    CatalogState,
)
from cachesvc.errors import CatalogUnavailableError
from cachesvc.http.auth import admin_guard
from cachesvc.http.errors import admin_exception_handlers, problem_responses

TTFT_SECONDS_BUCKETS: tuple[float, ...] = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60)
REQUEST_SECONDS_BUCKETS: tuple[float, ...] = (
    0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120,
)  # fmt: skip


class StatsSource(Protocol):
    """What the cache collector needs (``CacheManager`` provides it)."""

    @property
    def node(self) -> str:
        """This process's node name."""
        ...

    def stats(self, node: str | None = None) -> CacheStats:
        """Cache statistics computed from the catalog (of ``node``; default this process's node)."""
        ...

    def catalog_state(self) -> CatalogState:
        """Whether the catalog took the last operation (a locked SQLite file still reads)."""
        ...


def build_duration_buckets(
    seconds: Iterable[float], bounds: Sequence[float] = BUILD_SECONDS_BUCKETS
) -> list[tuple[str, float]]:
    """Cumulative ``(le, count)`` buckets for a Prometheus histogram, ending with ``+Inf``."""
    values = sorted(seconds)
    buckets: list[tuple[str, float]] = []
    index = 0
    for bound in bounds:
        while index < len(values) and values[index] <= bound:
            index += 1
        buckets.append((_float_label(bound), float(index)))
    buckets.append(("+Inf", float(len(values))))
    return buckets


def _float_label(value: float) -> str:
    # Prometheus renders bucket bounds as floats ("1.0", "2.5"); match what Histogram emits.
    return repr(float(value))


class CacheStatsCollector(Collector):
    """Exposes ``stats()`` as Prometheus families, computed at scrape time."""

    def __init__(self, source: StatsSource, *, node: str | None = None) -> None:
        self._source = source
        self._node = node

    def describe(self) -> list[Metric]:
        """Metric names without samples, so registering never touches the catalog."""
        return self._families(None)

    def collect(self) -> list[Metric]:
        """Read the catalog and return every cache family (without samples while the catalog
        is down, so a scrape of this node still gets its serving metrics), and
        ``cachesvc_catalog_up``."""
        up = GaugeMetricFamily("cachesvc_catalog_up", "1 while the catalog database answers, else 0.")
        try:
            stats: CacheStats | None = self._source.stats(self._node)
        except CatalogUnavailableError:
            if self._node is not None:
                raise  # ?node= asks for nothing but the catalog: 503
            stats = None
        up.add_metric([], 1.0 if stats is not None and self._source.catalog_state().available else 0.0)
        return [*self._families(stats), up]

    @staticmethod
    def _families(stats: CacheStats | None) -> list[Metric]:
        hits = CounterMetricFamily(
            "cachesvc_cache_hits", "Bundle lookups served from the cache (catalog events)."
        )
        misses = CounterMetricFamily(
            "cachesvc_cache_misses", "Bundle lookups that needed a build (catalog events)."
        )
        evictions = CounterMetricFamily(
            "cachesvc_evictions", "Bundles evicted, by reason (catalog events).", labels=["reason"]
        )
        evicted_bytes = CounterMetricFamily(
            "cachesvc_evicted_bytes",
            "Bytes freed by evictions, by reason (catalog events).",
            labels=["reason"],
        )
        builds = CounterMetricFamily(
            "cachesvc_builds", "Finished builds, by result (catalog events).", labels=["result"]
        )
        size = GaugeMetricFamily(
            "cachesvc_cache_size_bytes", "Bytes held by bundles in the cache (catalog sizes)."
        )
        max_size = GaugeMetricFamily("cachesvc_cache_max_size_bytes", "Configured cache size cap in bytes.")
        bundles = GaugeMetricFamily("cachesvc_bundles", "Bundles in the catalog, by state.", labels=["state"])
        checkpoints = GaugeMetricFamily("cachesvc_checkpoints", "Resolved checkpoints in the catalog.")
        checkpoint_bytes = GaugeMetricFamily(
            "cachesvc_checkpoint_bytes", "Bytes under the cache's checkpoints/ (downloads, conversions)."
        )
        transfers = CounterMetricFamily(
            "cachesvc_registry_transfers",
            "Bundles pulled from or pushed to the OCI registry (catalog events).",
            labels=["direction"],
        )
        transfer_bytes = CounterMetricFamily(
            "cachesvc_registry_bytes",
            "Bytes pulled from or uploaded to the OCI registry (catalog events).",
            labels=["direction"],
        )
        families: list[Metric] = [
            hits,
            misses,
            evictions,
            evicted_bytes,
            builds,
            size,
            max_size,
            bundles,
            checkpoints,
            checkpoint_bytes,
            transfers,
            transfer_bytes,
        ]
        if stats is None:
            families.append(
                HistogramMetricFamily("cachesvc_build_duration_seconds", "Wall time of finished builds.")
            )
            return families
        hits.add_metric([], stats.hits)
        misses.add_metric([], stats.misses)
        # Every known reason/state gets a sample (zero included) so dashboards see stable series.
        for reason in sorted(set(EVICT_REASONS) | set(stats.evictions_by_reason)):
            evictions.add_metric([reason], stats.evictions_by_reason.get(reason, 0))
        for reason in sorted(set(EVICT_REASONS) | set(stats.evicted_bytes_by_reason)):
            evicted_bytes.add_metric([reason], stats.evicted_bytes_by_reason.get(reason, 0))
        builds.add_metric(["ok"], stats.builds_ok)
        builds.add_metric(["failed"], stats.builds_failed)
        size.add_metric([], stats.size_bytes)
        max_size.add_metric([], stats.max_size_bytes)
        for state in sorted(set(BUNDLE_STATES) | set(stats.bundles_by_state)):
            bundles.add_metric([state], stats.bundles_by_state.get(state, 0))
        checkpoints.add_metric([], stats.checkpoints)
        checkpoint_bytes.add_metric([], stats.checkpoint_bytes)
        transfers.add_metric(["pull"], stats.pulls)
        transfers.add_metric(["push"], stats.pushes)
        transfer_bytes.add_metric(["pull"], stats.pulled_bytes)
        transfer_bytes.add_metric(["push"], stats.pushed_bytes)
        families.append(
            HistogramMetricFamily(
                "cachesvc_build_duration_seconds",
                "Wall time of finished builds.",
                buckets=[
                    ("+Inf" if bound == float("inf") else _float_label(bound), float(count))
                    for bound, count in stats.build_buckets
                ]
                or [("+Inf", 0.0)],
                sum_value=stats.build_seconds_sum,
            )
        )
        return families


class ServingMetrics:
    """The serving metrics, labelled by ``model``: time to first token, generated tokens, queue
    depth, active requests. :meth:`for_model` gives one model's scheduler observer."""

    def __init__(self, registry: CollectorRegistry) -> None:
        self._ttft = Histogram(
            "cachesvc_time_to_first_token_seconds",
            "Time from admission to the first generated token.",
            ["model"],
            buckets=TTFT_SECONDS_BUCKETS,
            registry=registry,
        )
        self._tokens = Counter(
            "cachesvc_generated_tokens", "Completion tokens generated.", ["model"], registry=registry
        )
        self._queued = Gauge(
            "cachesvc_queue_depth", "Requests waiting for admission.", ["model"], registry=registry
        )
        self._active = Gauge(
            "cachesvc_active_requests", "Requests being generated now.", ["model"], registry=registry
        )
        # Speculative decoding, named after vLLM's spec_decode counters: acceptance rate is
        # accepted_tokens / draft_tokens, mean tokens per step emitted_tokens / drafts.
        self._drafts = Counter(
            "cachesvc_spec_decode_drafts", "Speculative verification steps.", ["model"], registry=registry
        )
        self._draft_tokens = Counter(
            "cachesvc_spec_decode_draft_tokens",
            "Tokens proposed for verification.",
            ["model"],
            registry=registry,
        )
        self._accepted = Counter(
            "cachesvc_spec_decode_accepted_tokens",
            "Proposed tokens the target kept.",
            ["model"],
            registry=registry,
        )
        self._emitted = Counter(
            "cachesvc_spec_decode_emitted_tokens",
            "Tokens emitted by verification steps (kept proposals plus one target token each).",
            ["model"],
            registry=registry,
        )
        self._context = ContextCacheCollector()
        registry.register(self._context)
        self._images = ImageCacheCollector()
        registry.register(self._images)

    def for_model(self, model: str) -> ModelServingMetrics:
        """The observer of one model's scheduler (``first_token``, ``tokens_generated``, ...)."""
        return ModelServingMetrics(self, model)

    def forget(self, model: str) -> None:
        """Drop the gauges of an unloaded model (its counters stay: they are totals)."""
        for gauge in (self._queued, self._active):
            with contextlib.suppress(KeyError):
                gauge.remove(model)
        self._context.forget(model)
        self._images.forget(model)


class ModelServingMetrics:
    """One model's view of :class:`ServingMetrics` (a scheduler observer)."""

    def __init__(self, metrics: ServingMetrics, model: str) -> None:
        self._m = metrics
        self.model = model

    def first_token(self, seconds: float) -> None:
        """Record one request's time to first token."""
        self._m._ttft.labels(self.model).observe(max(0.0, seconds))

    def tokens_generated(self, n: int) -> None:
        """Count ``n`` newly generated tokens."""
        if n > 0:
            self._m._tokens.labels(self.model).inc(n)

    def queue_changed(self, queued: int, active: int) -> None:
        """Set the current queue depth and number of active requests."""
        self._m._queued.labels(self.model).set(queued)
        self._m._active.labels(self.model).set(active)

    def speculative_step(self, proposed: int, accepted: int, emitted: int) -> None:
        """Count one speculative verification step."""
        self._m._drafts.labels(self.model).inc()
        self._m._draft_tokens.labels(self.model).inc(proposed)
        self._m._accepted.labels(self.model).inc(accepted)
        self._m._emitted.labels(self.model).inc(emitted)

    def context_cache_changed(self, stats: Any) -> None:
        """Keep this model's latest context-reuse counters (a ``ContextCacheStats``) for the next
        scrape."""
        self._m._context.update(self.model, stats)

    def image_cache_changed(self, stats: Any) -> None:
        """Keep this model's latest image-feature cache counters (an ``ImageCacheStats``)."""
        self._m._images.update(self.model, stats)


class PoolMetrics:
    """The model pool's observer: loaded models, loads, unloads by reason, load time."""

    def __init__(self, registry: CollectorRegistry, serving: ServingMetrics) -> None:
        self._serving = serving
        self._loaded = Gauge("cachesvc_loaded_models", "Engines loaded in this process.", registry=registry)
        self._loads = Counter("cachesvc_model_loads", "Engine loads.", ["model"], registry=registry)
        self._unloads = Counter(
            "cachesvc_model_unloads", "Engine unloads by reason.", ["model", "reason"], registry=registry
        )
        self._load_seconds = Histogram(
            "cachesvc_model_load_seconds",
            "Time to load an engine (lease, engine, tokenizer, scheduler).",
            buckets=(0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300),
            registry=registry,
        )

    def model_loaded(self, model: str, seconds: float, loaded: int) -> None:
        """A load finished."""
        self._loads.labels(model).inc()
        self._load_seconds.observe(seconds)
        self._loaded.set(loaded)

    def model_unloaded(self, model: str, reason: str, loaded: int) -> None:
        """An engine left memory."""
        self._unloads.labels(model, reason).inc()
        self._loaded.set(loaded)
        self._serving.forget(model)


class ContextCacheCollector(Collector):
    """Context reuse (``--enable-context-reuse``) per model (label ``model``): lookups, hits,
    tokens reused, records, bytes, and the records on disk apart (``disk_*``).

    Each loaded model's scheduler reports its own prefix store; one model's figures never
    replace another's. Counters are totals over the process: a model unloaded and loaded again
    continues from what its earlier engines counted; the gauges of an unloaded model go away.
    """

    _PREFIX = "cachesvc_context_cache_"
    _COUNTERS: tuple[tuple[str, str], ...] = (
        ("lookups", "Requests that looked for a cached prompt prefix."),
        ("hits", "Requests that resumed from a cached prompt prefix."),
        ("tokens_reused", "Prompt tokens not prefilled thanks to context reuse."),
        ("record_hits", "Prefix records copied back into a slot."),
        ("evictions", "Prefix records evicted (LRU) for the record or byte limit."),
        ("disk_hits", "Prefix records read back from disk (missed in memory, e.g. after a restart)."),
        ("disk_writes", "Prefix records written to disk."),
        ("disk_dropped", "Damaged prefix records found on disk and removed."),
        ("disk_evictions", "Prefix records removed from disk (LRU) for --context-cache-disk-bytes."),
        ("disk_write_failures", "Prefix records that could not be written to disk (a full or read-only "
         "disk, a refused folder); they stay in memory only."),
    )
    _GAUGES: tuple[tuple[str, str], ...] = (
        ("records", "Prefix records held."),
        ("bytes", "KV bytes held by prefix records."),
        ("max_records", "Configured record limit."),
        ("max_bytes", "Configured byte limit of the prefix records."),
        ("disk_records", "Prefix records on disk."),
        ("disk_bytes", "Bytes of the prefix records on disk."),
        ("disk_max_bytes", "Configured byte limit of the prefix records on disk (0: off)."),
    )

    def __init__(self) -> None:
        # Schedulers report from their own threads; scrapes read from the event loop's.
        self._lock = threading.Lock()
        self._latest: dict[str, Any] = {}
        self._base: dict[str, dict[str, float]] = {}

    def update(self, model: str, stats: Any) -> None:
        """``model``'s latest ``ContextCacheStats``."""
        with self._lock:
            self._latest[model] = stats

    def forget(self, model: str) -> None:
        """``model`` unloaded: its counters so far become the base of its next engine's."""
        with self._lock:
            stats = self._latest.pop(model, None)
            if stats is not None:
                base = self._base.setdefault(model, {})
                for name, _ in self._COUNTERS:
                    base[name] = base.get(name, 0.0) + float(getattr(stats, name))

    def describe(self) -> list[Metric]:
        return []

    def collect(self) -> list[Metric]:
        with self._lock:
            latest = dict(self._latest)
            base = {m: dict(b) for m, b in self._base.items()}
        if not latest and not base:
            return []
        out: list[Metric] = []
        for name, text in self._COUNTERS:
            fam = CounterMetricFamily(f"{self._PREFIX}{name}", text, labels=["model"])
            for model in sorted(latest.keys() | base.keys()):
                now = float(getattr(latest[model], name)) if model in latest else 0.0
                fam.add_metric([model], base.get(model, {}).get(name, 0.0) + now)
            out.append(fam)
        for name, text in self._GAUGES:
            gauge = GaugeMetricFamily(f"{self._PREFIX}{name}", text, labels=["model"])
            for model in sorted(latest):
                gauge.add_metric([model], float(getattr(latest[model], name)))
            out.append(gauge)
        return out


class ImageCacheCollector(ContextCacheCollector):
    """A vision-language model's image-feature cache (``--image-feature-cache-bytes``) per model:
    images looked up, found, encoded, evicted; entries and bytes held. Totals over the process,
    as the context-reuse figures."""

    _PREFIX = "cachesvc_image_cache_"
    _COUNTERS = (
        ("lookups", "Image parts looked up by digest in the feature cache."),
        ("hits", "Image parts found in the feature cache (neither decoded nor encoded again)."),
        ("encodes", "Images run through the vision encoder."),
        ("evictions", "Image features evicted (LRU) for the byte limit."),
    )
    _GAUGES = (
        ("entries", "Images whose features are held."),
        ("bytes", "Bytes of image features held."),
        ("max_bytes", "Configured byte limit of the image features (0: off)."),
    )


class HttpMetrics:
    """Request count and latency by route template (bounded cardinality), method and status."""

    def __init__(self, registry: CollectorRegistry) -> None:
        self.requests = Counter(
            "cachesvc_http_requests",
            "HTTP requests by route template, method and status.",
            labelnames=("route", "method", "status"),
            registry=registry,
        )
        self.duration = Histogram(
            "cachesvc_http_request_duration_seconds",
            "HTTP request latency by route template (until the last body byte).",
            labelnames=("route",),
            buckets=REQUEST_SECONDS_BUCKETS,
            registry=registry,
        )

    def observe(self, route: str, method: str, status: int, seconds: float) -> None:
        """Record one finished request."""
        self.requests.labels(route=route, method=method, status=str(status)).inc()
        self.duration.labels(route=route).observe(seconds)


class RequestMetricsMiddleware(ASGIMiddleware):
    """Counts and times every routed HTTP request under its route template."""

    scopes = (ScopeType.HTTP,)

    def __init__(self, metrics: HttpMetrics) -> None:
        self._metrics = metrics

    async def handle(self, scope: Scope, receive: Receive, send: Send, next_app: ASGIApp) -> None:
        """Wrap ``send`` to see the status; time until the handler returns."""
        status = 500
        started = time.perf_counter()

        async def send_wrapper(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = int(message["status"])
            await send(message)

        # The route template ("/admin/bundles/{bundle_id}"), never the raw path: raw paths
        # would create one series per bundle id.
        route = str(scope.get("path_template") or "unmatched")
        try:
            await next_app(scope, receive, send_wrapper)
        finally:
            method = str(scope.get("method", "GET"))
            self._metrics.observe(route, method, status, time.perf_counter() - started)


class MetricsState:
    """One app's metrics: its own registry, the cache collector, serving and HTTP metrics."""

    def __init__(self, stats_source: StatsSource | None = None) -> None:
        self.registry = CollectorRegistry()
        self.serving = ServingMetrics(self.registry)
        self.pool = PoolMetrics(self.registry, self.serving)
        self.http = HttpMetrics(self.registry)
        self._stats_source = stats_source
        if stats_source is not None:
            self.registry.register(CacheStatsCollector(stats_source))

    def middleware(self) -> RequestMetricsMiddleware:
        """The request-metrics middleware to add to the app (``middleware=[...]``)."""
        return RequestMetricsMiddleware(self.http)

    def exposition(self, node: str | None = None) -> bytes:
        """The Prometheus text exposition of every metric in this app's registry.

        With ``node``: only the catalog's cache families of that node (another node's serving
        and HTTP metrics live in its own process; scrape it for those)."""
        if node is None or self._stats_source is None or node == self._stats_source.node:
            return generate_latest(self.registry)
        registry = CollectorRegistry()
        registry.register(CacheStatsCollector(self._stats_source, node=node))
        return generate_latest(registry)


def metrics_route(state: MetricsState, *, admin_api_key: str | None) -> HTTPRouteHandler:
    """``GET /metrics``, guarded like the admin routes and answering errors as problem JSON."""

    # sync_to_thread: a scrape reads the catalog (SQLite), which must not block the event loop.
    @get(
        "/metrics",
        guards=[admin_guard(admin_api_key)],
        exception_handlers=admin_exception_handlers(),
        sync_to_thread=True,
        media_type=CONTENT_TYPE_LATEST,
        tags=["metrics"],
        operation_id="metrics",
        summary="Prometheus metrics (text exposition format)",
        responses=problem_responses(400, 404),
    )
    def metrics(
        node: Annotated[
            str | None,
            QueryParameter(
                min_length=1,
                max_length=255,
                description="Only the cache (catalog) metrics of this node of the fleet",
            ),
        ] = None,
    ) -> Response[bytes]:
        return Response(content=state.exposition(node), media_type=CONTENT_TYPE_LATEST)

    return metrics
