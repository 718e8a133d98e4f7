"""Model loading: the startup model's runtime, each model's serving handle, the model pool.

What the app serves is built here, before and while the app runs (vLLM's ``init_app_state``):
:func:`load_runtime` prepares (hit or build), leases and loads the model a ``serve MODEL`` starts
with; :func:`build_serving` turns one bundle into its per-model handle (engine, tokenizer,
speculative proposer, context cache, this server's limits); :func:`make_pool` builds the
:class:`~inference.serving.model_pool.ModelPool` over the catalog, whose loader
(:func:`handle_factory`) loads every other ready bundle on demand through the injected
``engine_factory`` (default: the backend registry).
"""

from __future__ import annotations

import functools
import importlib
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from cachesvc.cache.adapters import check_adapter_source
from cachesvc.cache.bundle_leases import Releasable
from cachesvc.cache.manager import BundleLease, CacheManager, CombinedLease
from cachesvc.cache.records import AdapterInfo, PrepareResult
from cachesvc.cache.store.layout import CacheLayout
from cachesvc.errors import CacheError, ConflictError, NotFoundError
from cachesvc.http.metrics import MetricsState
from cachesvc.serving.build_progress import BuildProgress
from cachesvc.serving.served_models import CatalogModels
from cachesvc.settings.config import ServeConfig
from cachesvc.settings.groups import ENGINE_FACTORY_ENV
from cachesvc.settings.rules import lora_module_pairs
from inference.build_profile import CHAIN_SPECULATIVE_METHODS, METHODS_WITH_DRAFT_BUNDLE
from inference.openai import ModelHandle, ServingOptions, load_tokenizer
from inference.runtime.protocol import Engine
from inference.serving.context_cache import PrefixStore, record_pool_bytes
from inference.serving.context_disk import DiskRecords
from inference.serving.model_pool import HandleFactory, ModelPool, ModelRef, PoolLimits
from inference.serving.speculative import ProposerFactory
from inference.serving.structured import GrammarLimits

log = logging.getLogger("cachesvc.app")

EngineFactory = Callable[..., Engine]


@dataclass
class Runtime:
    """What ``load_runtime`` loaded: the prepared bundle, its lease, the engine and its server."""

    prepared: PrepareResult
    lease: BundleLease
    engine: Engine
    serving: ModelHandle
    #: ``--lora-modules``: each served name's adapter lease (also held by ``lease``), for an
    #: unload at run time to let go of it.
    adapter_leases: dict[str, Releasable] = field(default_factory=dict)
    #: Seconds from the lease to a loaded engine (the pool's load time of this model).
    load_seconds: float = 0.0

    closed: bool = False

    def close(self) -> None:
        """Close the engine (and a draft engine) and release the lease(s) (idempotent)."""
        if self.closed:
            return
        self.closed = True
        try:
            self.serving.client.close_engine()
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
    if config.build.model is None:
        raise CacheError("no model to serve: pass a model id or checkpoint directory")
    # The full re-hash against the manifest happens here, once per start (every other load
    # checks sizes and sampled hashes): a corrupt bundle is rebuilt, never loaded.
    with BuildProgress() as progress:
        prepared, lease = manager.prepare_and_lease(
            config.build.model, config.profile_request(), progress=progress, full_verify=True,
        )
    started = time.monotonic()
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
            draft_dir=prepared.draft_bundle_dir,
        )
        engine = serving.engine
        try:
            adapters = load_lora_modules(config, manager, serving, prepared.model_dir)
        except BaseException:
            serving.client.close_engine()
            raise
        if adapters:
            lease = CombinedLease(lease, *adapters.values())
    except BaseException:
        lease.release()
        raise
    return Runtime(prepared, lease, engine, serving, adapters, time.monotonic() - started)


def load_lora_modules(config: ServeConfig, manager: CacheManager, serving: ModelHandle,
                      base_dir: Path) -> dict[str, Releasable]:
    """``--lora-modules``: each adapter prepared in the cache (converted once, checked against
    the base model), leased while loaded, loaded into the engine under its digest id, and its
    served name mapped to it; the leases returned by served name (released with the model's
    lease, or when the name is unloaded at run time)."""
    pairs = lora_module_pairs(config.serving.lora_modules)
    if not pairs:
        return {}
    engine: Any = serving.engine
    if not hasattr(engine, "load_adapter"):
        raise CacheError(f"the {engine.info.backend} engine of this bundle cannot load LoRA adapters")
    leases: dict[str, Releasable] = {}
    try:
        for name, source in pairs:
            leases[name] = attach_adapter(manager, serving, base_dir, name, source)[1]
    except BaseException:
        for held in leases.values():
            held.release()
        raise
    return leases


def attach_adapter(manager: CacheManager, serving: ModelHandle, base_dir: Path, name: str,
                   source: str) -> tuple[AdapterInfo, Releasable]:
    """Serve adapter ``source`` as ``name`` on ``serving``'s engine: prepared in the cache,
    leased (the lease returned: hold it while the engine has the adapter), loaded under its
    digest id unless it already is, its use recorded, the name mapped to it."""
    info = manager.adapters.prepare(source, base_dir)
    lease = manager.adapters.lease(info.id)
    try:
        engine: Any = serving.engine
        if info.id not in engine.adapters:
            engine.load_adapter(info.id, info.path)
    except BaseException:
        lease.release()
        raise
    manager.adapters.touch(info.id)
    serving.lora_names[name] = info.id
    log.info("LoRA adapter %s (rank %d, %s) serves as %r", info.id, info.rank, ", ".join(info.targets), name)
    return info, lease


class LoraAdapters:
    """The startup model's LoRA adapters by served name, loaded and unloaded at run time
    (``POST /v1/load_lora_adapter``, vLLM's), next to those ``--lora-modules`` loaded at start.

    A loaded adapter is prepared in the cache (converted once, checked against the base model),
    leased while loaded, and answers as a model whose ``parent`` is the startup model. Unloading
    is refused while a running request uses the adapter; ``--max-loras`` bounds how many are
    loaded. Blocking: call it from a worker thread."""

    def __init__(self, config: ServeConfig, manager: CacheManager, runtime: Runtime | None,
                 source: CatalogModels, pool: ModelPool) -> None:
        self._config, self._manager, self._runtime = config, manager, runtime
        self._source, self._pool = source, pool
        # By served name: --lora-modules' (also released with the model's lease) and run-time ones.
        self._leases: dict[str, Releasable] = dict(runtime.adapter_leases) if runtime is not None else {}
        self._lock = threading.Lock()

    @property
    def parent(self) -> str:
        """The served name adapters run on."""
        return self._config.served_name

    def _handle(self) -> ModelHandle:
        runtime = self._runtime
        if runtime is None or not runtime.prepared.bundle_id:
            raise ConflictError("LoRA adapters load into the startup model: start the server with a model "
                                "and --enable-lora", reason="no_lora")
        if not getattr(runtime.engine, "lora", False):
            raise ConflictError(f"the bundle of {self._config.served_name!r} was built without LoRA inputs; "
                                "restart the server with --enable-lora (or --lora-modules)", reason="no_lora")
        return runtime.serving

    def load(self, name: str, source: str) -> AdapterInfo:
        """Load adapter ``source`` as the served name ``name``; a local path is held to the rule
        of every request-named path (under ``--allowed-model-roots``, no link out of them),
        as ``POST /admin/lora-adapters`` is."""
        check_adapter_source("lora_path", source, self._config.model_roots())
        with self._lock:
            handle = self._handle()
            assert self._runtime is not None
            taken = set(self._source.startup) | set(self._pool.loaded_names())
            if name in handle.lora_names or name in taken:
                raise ConflictError(f"the name {name!r} is already served; unload it or pick another",
                                    reason="name_taken")
            max_loras = self._config.serving.max_loras
            if len(set(handle.lora_names.values())) >= max_loras:
                raise ConflictError(f"{max_loras} LoRA adapters are loaded (--max-loras); "
                                    "unload one first", reason="max_loras")
            info, self._leases[name] = attach_adapter(
                self._manager, handle, self._runtime.prepared.model_dir, name, source)
            self._source.parents[name] = self._config.served_name
            self._source.startup[name] = self._runtime.prepared.bundle_id
            return info

    def unload(self, name: str) -> None:
        """Stop serving ``name`` (and free the adapter when no other name uses it)."""
        with self._lock:
            handle = self._handle()
            assert self._runtime is not None
            adapter = handle.lora_names.get(name)
            if adapter is None:
                raise NotFoundError(f"no LoRA adapter is served as {name!r}")
            engine: Any = self._runtime.engine
            if list(handle.lora_names.values()).count(adapter) == 1:
                try:
                    engine.unload_adapter(adapter)
                except ValueError as exc:
                    raise ConflictError(f"LoRA adapter {name!r} is in use by a running request; retry "
                                        f"when it ends ({exc})", reason="in_use") from None
            del handle.lora_names[name]
            self._source.parents.pop(name, None)
            self._source.startup.pop(name, None)
            lease = self._leases.pop(name, None)
            if lease is not None:
                lease.release()
            log.info("LoRA adapter %s no longer served as %r", adapter, name)

    def close(self) -> None:
        """Release the adapters' leases (the engine is closed by then; releasing is idempotent)."""
        with self._lock:
            for lease in self._leases.values():
                lease.release()
            self._leases.clear()


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
    draft_dir: Any = None,
) -> ModelHandle:
    """Load one bundle's engine and wrap it in its per-model handle (tokenizer, scheduler,
    parsers) with this server's limits; the engine is closed again when that fails.

    A bundle built with speculative decoding (``speculative`` in its ``engine.json``) gets its
    proposer; ``draft_model`` loads the draft bundle ``draft_dir`` next to it."""
    engine = engine_factory(bundle_dir, max_slots=config.build.max_batch_size)
    closers: list[Callable[[], None]] = []
    try:
        proposer = _proposer(config, engine_factory, bundle_dir, draft_dir, closers)
        tokenizer = load_tokenizer(bundle_dir)
        info = engine.info
        options = ServingOptions(
            served_model_name=name,
            max_model_len=min(info.max_kv_capacity, config.build.max_kv_cache_capacity),
            max_input_len=min(info.max_input_len, config.build.max_input_len),
            max_batch_size=min(info.max_slots, config.build.max_batch_size),
            max_queued_requests=config.serving.max_queued_requests,
            queue_timeout=config.serving.queue_timeout,
            reasoning_parser=config.serving.reasoning_parser,
            tool_call_parser=config.serving.tool_call_parser,
            enable_auto_tool_choice=config.serving.enable_auto_tool_choice,
            model_type=info.model_type,
            media=config.http.media_policy(),
            image_cache_bytes=config.serving.image_feature_cache_bytes,
            grammar_limits=GrammarLimits(
                max_schema_bytes=config.serving.max_schema_bytes,
                max_schema_properties=config.serving.max_schema_properties,
                compile_timeout=config.serving.grammar_compile_timeout,
            ),
            capabilities={
                "bundle_id": bundle_id,
                "backend": info.backend,
                "precision": info.precision,
                "device": info.device,
                "memory_bytes": info.memory_bytes,
            },
        )
        return ModelHandle(
            engine,
            tokenizer,
            options,
            observer=observer,
            context_cache=_context_cache(config, bundle_id),
            prefill_chunk=config.serving.prefill_chunk,
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
    from inference.serving.speculative import proposer_factory

    record = read_meta(bundle_dir).get("speculative")
    if not isinstance(record, dict) or record.get("method") not in CHAIN_SPECULATIVE_METHODS:
        return None
    spec = config.build.speculative_config
    options = dict(record)
    steps: int | None = None
    if spec is not None and spec.method == record["method"]:
        options.update({k: v for k, v in spec.to_dict().items() if v is not None and k != "model"})
        steps = config.build.effective_draft_step
    draft = None
    if record["method"] in METHODS_WITH_DRAFT_BUNDLE:
        if draft_dir is None:
            log.warning("bundle %s speculates with a draft model whose bundle is not ready here; "
                        "decoding without speculation", bundle_dir)
            return None
        draft = engine_factory(draft_dir, max_slots=config.build.max_batch_size)
        closers.append(draft.close)
    return proposer_factory(options, num_speculative_tokens=steps, draft_engine=draft)


def handle_factory(
    config: ServeConfig, engine_factory: EngineFactory | None, metrics: MetricsState | None
) -> HandleFactory[ModelHandle]:
    """The pool's loader: a model's handle from its bundle, with its own metrics label."""
    factory = engine_factory or _default_engine_factory

    def build(ref: ModelRef) -> ModelHandle:
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


def context_pool_bytes(config: ServeConfig) -> int:
    """The memory each loaded model's context-reuse record pool may take (0 with reuse off)."""
    if not config.serving.enable_context_reuse:
        return 0
    return record_pool_bytes(config.serving.context_cache_partial_kv_snapshot_pool_bytes)


def _context_cache(config: ServeConfig, bundle_id: str) -> PrefixStore | None:
    """The prefix store of ``--enable-context-reuse``, namespaced by the bundle (so records never
    serve another model or build); None when reuse is off."""
    if not config.serving.enable_context_reuse:
        return None
    return PrefixStore(
        f"bundle:{bundle_id}",
        max_records=config.serving.context_cache_max_records,
        max_bytes=config.serving.context_cache_partial_kv_snapshot_pool_bytes,
        disk=context_disk(config, bundle_id),
    )


def context_disk(config: ServeConfig, bundle_id: str) -> DiskRecords | None:
    """The bundle's records on disk (``<cache-dir>/context/<bundle_id>/``, removed with the
    bundle), or None with ``--context-cache-disk-bytes 0``. The folder is held to the cache's rule
    for folders it deletes in (:meth:`CacheLayout.checked_context_dir`: no link), at open and
    before every write or removal there. A folder refused or a cache root that cannot be read
    leaves the bundle's records in memory only (one warning saying why); a failed write, the
    record it was for (counted, logged once per outage)."""
    if config.serving.context_cache_disk_bytes <= 0:
        return None
    layout = CacheLayout(config.cache.cache_dir)
    try:
        return DiskRecords(layout.context_dir(bundle_id), max_bytes=config.serving.context_cache_disk_bytes,
                           dir_mode=layout.dir_mode(),  # made on the first write
                           guard=functools.partial(layout.checked_context_dir, bundle_id))
    except (OSError, CacheError, ValueError) as exc:
        log.warning("context records of bundle %s stay in memory only (context reuse on disk is off for "
                    "it): %s", bundle_id, exc)
        return None


def engine_factory_from_spec(spec: str | None) -> EngineFactory | None:
    """Test-only entry to the engine seam for a child ``cachesvc serve`` process.

    ``serve(config, engine_factory=...)`` and ``create_app(..., engine_factory=...)`` are the
    seam; a test that spawns the real console script cannot pass a callable, so
    ``cachesvc serve`` (the CLI only) passes ``CACHESVC_ENGINE_FACTORY=module:callable``
    (:func:`cachesvc.settings.groups.engine_factory_spec`) here and injects the callable through the same
    parameter. The callable takes ``(bundle_dir, *, max_slots)`` and returns an ``Engine``.
    Backends belong in ``inference.runtime.registry``, not here. None: no spec.
    """
    if not spec:
        return None
    module_name, _, attr = spec.partition(":")
    if not module_name or not attr:
        raise CacheError(f"{ENGINE_FACTORY_ENV} must look like 'module:callable', got {spec!r}")
    factory = getattr(importlib.import_module(module_name), attr)
    if not callable(factory):
        raise CacheError(f"{ENGINE_FACTORY_ENV} {spec!r} is not callable")
    return factory


def make_pool(
    config: ServeConfig,
    manager: CacheManager,
    *,
    runtime: Runtime | None = None,
    metrics: MetricsState | None = None,
    engine_factory: EngineFactory | None = None,
) -> ModelPool[ModelHandle]:
    """The model pool over the catalog, with the startup model (``runtime``) adopted and kept."""
    source = CatalogModels(
        manager, max_slots=config.build.max_batch_size, context_bytes=context_pool_bytes(config)
    )
    pool = ModelPool(
        source,
        handle_factory(config, engine_factory, metrics),
        PoolLimits(
            max_loaded=config.serving.max_loaded_models,
            memory_budget=config.serving.memory_budget_bytes,
            keep_alive=config.serving.keep_alive,
            queue_timeout=config.serving.queue_timeout,
            unload_grace=config.serving.shutdown_grace_seconds,
            max_queued=config.serving.max_queued_requests,
        ),
        observer=metrics.pool if metrics is not None else None,
    )
    if runtime is not None:
        names = [config.served_name, runtime.serving.options.served_model_name]
        if config.build.model is not None:
            names.append(config.build.model)
        names = list(dict.fromkeys(names))
        for adapter in runtime.serving.lora_names:  # --lora-modules: names of the same bundle
            source.parents[adapter] = config.served_name
            names.append(adapter)
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
            memory_bytes=runtime.serving.client.memory_bytes,
            context_bytes=runtime.serving.client.memory_bytes - info.memory_bytes,
            images=runtime.serving.vision is not None,
        )
        pool.adopt(
            ref, runtime.serving, runtime.lease, keep_alive=-1, names=names, load_seconds=runtime.load_seconds
        )
        pool.primary = config.served_name
    return pool


__all__ = [
    "EngineFactory",
    "Runtime",
    "build_serving",
    "engine_factory_from_spec",
    "handle_factory",
    "load_runtime",
    "make_pool",
]
