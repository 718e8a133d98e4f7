"""CacheManager: the one place that uses the catalog, the disk store and the builders together.

A facade over its sections: prepare (hit or build under the bundle's lock), leases, queries,
pin/verify/remove here; eviction in :mod:`cachesvc.eviction`, reconcile in
:mod:`cachesvc.reconcile`, background builds in :mod:`cachesvc.build_jobs`.

Rules (docs/architecture.md, "The cache"):
- Disk holds the bytes, the catalog the index; ``reconcile`` re-syncs them.
- Build on miss under the bundle's exclusive lock, into a unique staging dir, then publish
  atomically and only then mark the row ready. A crash leaves nothing or a complete bundle.
- A serving process holds a shared lease; eviction takes the exclusive lock non-blocking and
  skips what is leased or pinned.
- Eviction is LRU by catalog ``last_used_at``, from catalog sizes, planned then executed;
  ``stale`` bundles (built for another GPU or TensorRT version) are planned first.
"""

from __future__ import annotations

import errno
import logging
import os
import re
import socket
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import replace
from datetime import datetime, timedelta
from pathlib import Path
from typing import Any

from cachesvc.build_jobs import Build, BuildJobs
from cachesvc.builders import (
    Builder,
    ProgressFn,
    default_builders,
    resolve_backend,
    resolve_precision,
    stale_reason,
)
from cachesvc.catalog import Catalog, default_catalog_url, utcnow
from cachesvc.catalog.fleet import FleetCatalog
from cachesvc.checkpoints import (
    ResolvedCheckpoint,
    is_hub_id,
    looks_like_path,
    owned_checkpoint_path,
    remove_checkpoint_files,
    resolve_checkpoint,
)
from cachesvc.crashpoints import crash_point
from cachesvc.errors import (
    BuildError,
    CacheError,
    CatalogUnavailableError,
    CheckpointError,
    ConfigError,
    ConflictError,
    CorruptBundleError,
    InsufficientStorageError,
    LeasedError,
    NotFoundError,
    PinnedError,
)
from cachesvc.eviction import Evictor
from cachesvc.gguf_checkpoints import GGUF_SUFFIX, local_gguf, split_hub_gguf
from cachesvc.profiles import BuildOptions, BundleKey, ProfileRequest
from cachesvc.reconcile import Reconciler
from cachesvc.records import (
    BUNDLE_STATES,
    AliasInfo,
    BuildStatus,
    BundleDetail,
    BundleInfo,
    BundlePage,
    CacheStats,
    CatalogState,
    CheckpointInfo,
    CheckpointRemoval,
    EventInfo,
    EvictionPlan,
    EvictionResult,
    LeaseHolder,
    PrepareResult,
    ReconcileReport,
    VerifyResult,
)
from cachesvc.store import (
    BundleStore,
    CacheLayout,
    Lease,
    dir_size,
    quick_verify_bundle,
    read_manifest,
    verify_bundle,
)
from inference.build_profile import (
    METHODS_NEEDING_DRAFT_MODEL,
    METHODS_REFUSING_DRAFT_MODEL,
    METHODS_WITH_DRAFT_BUNDLE,
    QUANTIZED_PRECISIONS,
)
from inference.cpu_class import cpu_class

log = logging.getLogger("cachesvc.manager")


def _noop_progress(stage: str, fraction: float) -> None:
    return None


class BundleLease:
    """A shared lease on a bundle held by this process; release it when the engine unloads."""

    def __init__(self, manager: CacheManager, info: BundleInfo, lease: Lease) -> None:
        self._manager = manager
        self._lease = lease
        self.bundle = info
        self.bundle_id = info.id
        self.bundle_dir = manager.layout.root / info.path

    @property
    def held(self) -> bool:
        """True until released."""
        return self._lease.held

    def release(self) -> None:
        """Release the shared lock and drop the display row (idempotent)."""
        if not self._lease.held:
            return
        self._lease.release()
        try:
            self._manager.catalog.remove_lease(self.bundle_id, os.getpid())
        except CatalogUnavailableError:
            pass  # the catalog's health logs the outage; reconcile drops the stale row later
        except Exception:  # the lock is the truth; a stale row is cleaned by reconcile
            log.warning("could not remove the lease row of %s", self.bundle_id, exc_info=True)

    def __enter__(self) -> BundleLease:
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()


class CombinedLease(BundleLease):
    """A bundle's lease together with the leases of bundles loaded with it (a speculative
    draft): one ``release`` lets go of all of them."""

    def __init__(self, primary: BundleLease, *others: BundleLease) -> None:
        super().__init__(primary._manager, primary.bundle, primary._lease)
        self._others = others

    def release(self) -> None:
        """Release every lease (idempotent)."""
        try:
            super().release()
        finally:
            for other in self._others:
                other.release()


class CacheManager:
    """Prepare, lease, list, pin, verify, evict and reconcile engine bundles."""

    def __init__(
        self,
        layout: CacheLayout,
        catalog: Catalog,
        builders: Mapping[str, Builder],
        *,
        max_size_bytes: int,
        lock_timeout: float | None = None,
        offline: bool | None = None,
        gpu_disabled: bool = False,
    ) -> None:
        if max_size_bytes <= 0:
            raise ConfigError("max_size_bytes", "must be greater than 0")
        self.layout = layout
        self.catalog = catalog
        self.store = BundleStore(layout)
        self.builders = dict(builders)
        self.max_size_bytes = max_size_bytes
        self.lock_timeout = lock_timeout
        self.offline = offline
        #: The launch settings disable the GPU (``CACHESVC_DISABLE_GPU``): no TensorRT here.
        self.gpu_disabled = gpu_disabled
        self.evictor = Evictor(catalog, self.store, max_size_bytes=max_size_bytes, holders=self.holders)
        self.reconciler = Reconciler(catalog, self.store, holders=self.holders, gpu_disabled=gpu_disabled)
        self.builds = BuildJobs(self._prepare, catalog)
        #: Nodes and desired state (the same database; see cachesvc.fleet for the agent).
        self.fleet = FleetCatalog(catalog)
        self._stats_lock = threading.Lock()
        self._stats_cache: tuple[tuple[int, int, int, str], CacheStats] | None = None
        self._corrupt_listeners: list[Callable[[str, str], None]] = []

    @classmethod
    def open(
        cls,
        cache_dir: Path,
        *,
        catalog_url: str | None = None,
        max_size_bytes: int,
        builders: Mapping[str, Builder] | None = None,
        node: str | None = None,
        lock_timeout: float | None = None,
        offline: bool | None = None,
        upgrade: bool = True,
        claim_node: bool = False,
        gpu_disabled: bool = False,
    ) -> CacheManager:
        """Open (creating if needed) the cache at ``cache_dir`` and upgrade the catalog schema.

        One node per cache directory (its bundle rows describe this disk): the root records the
        node that owns it. ``claim_node`` (a server starting) records ``node`` (default: the host
        name) when none is recorded and refuses any other name; without it (commands run on the
        directory) the process acts as the recorded node, and a ``node`` given that is not the
        recorded one is refused. A refusal changes nothing on disk or in the catalog."""
        layout = CacheLayout(Path(cache_dir).expanduser().absolute())
        layout.ensure()
        node = _owning_node(layout, node, claim=claim_node)
        catalog = Catalog(catalog_url or default_catalog_url(layout.root), node=node)
        if upgrade:
            catalog.upgrade()
        return cls(
            layout,
            catalog,
            default_builders(layout.root, gpu_disabled=gpu_disabled) if builders is None else builders,
            max_size_bytes=max_size_bytes,
            lock_timeout=lock_timeout,
            offline=offline,
            gpu_disabled=gpu_disabled,
        )

    def close(self) -> None:
        """Stop background builds from being started and dispose of the catalog engine."""
        self.builds.close()
        self.catalog.close()

    # -- prepare ---------------------------------------------------------------------------

    def resolve(self, model: str) -> ResolvedCheckpoint:
        """Resolve a model id or directory and record the checkpoint in the catalog."""
        ckpt = resolve_checkpoint(model, self.layout.checkpoints, offline=self.offline)
        self.catalog.upsert_checkpoint(
            digest=ckpt.digest,
            source=model,
            path=ckpt.path,
            size_bytes=ckpt.size_bytes,
            file_count=ckpt.file_count,
        )
        return ckpt

    def build_options(self, request: ProfileRequest, draft: ResolvedCheckpoint | None = None,
                      checkpoint_dir: Path | None = None) -> BuildOptions:
        """Resolve ``auto`` choices and versions into the concrete build profile (``auto``
        precision on the CPU keeps the precision of ``checkpoint_dir``'s weights)."""
        return self._build_options(request, draft.digest if draft else None, checkpoint_dir)

    def catalog_bundle_id(self, model: str, request: ProfileRequest) -> str:
        """The id the bundle of ``model`` built with ``request`` has, from the catalog alone: no
        hashing, no download, no row written. NotFoundError when a checkpoint (``model`` or the
        draft) was never resolved here; the bundle itself may or may not exist."""
        digest, path = self._known_checkpoint("model", model)
        draft = self._known_checkpoint("draft_model", request.draft_model)[0] if request.draft_model else None
        return BundleKey.of(digest, self._build_options(request, draft, path)).id

    def _known_checkpoint(self, field: str, model: str) -> tuple[str, Path]:
        wanted = model.rstrip("/")
        for ckpt in self.catalog.list_checkpoints():
            if wanted in (ckpt.source.rstrip("/"), str(ckpt.path)):
                return ckpt.digest, Path(ckpt.path)
        raise NotFoundError(
            f"{field} {model!r} is not a checkpoint in the catalog; build it first (POST /admin/builds)"
        )

    def _build_options(self, request: ProfileRequest, draft_digest: str | None,
                       checkpoint_dir: Path | None) -> BuildOptions:
        backend = resolve_backend(request.backend, self.builders, gpu_disabled=self.gpu_disabled)
        precision = resolve_precision(request.precision, backend, checkpoint_dir)
        builder = self.builders[backend]
        method = request.speculative_method
        if method in METHODS_NEEDING_DRAFT_MODEL and draft_digest is None:
            raise ConfigError("draft_model", f"method {method!r} needs a draft model")
        if method in METHODS_REFUSING_DRAFT_MODEL and draft_digest is not None:
            raise ConfigError("draft_model", f"method {method!r} uses no draft model; drop it")
        return BuildOptions(
            backend=backend,
            precision=precision,
            max_input_len=request.max_input_len,
            max_batch_size=request.max_batch_size,
            max_kv_cache_capacity=request.max_kv_cache_capacity,
            speculative_method=request.speculative_method,
            draft_digest=draft_digest,
            builder_version=builder.version,
            device_arch=getattr(builder, "device_arch", None) if backend == "tensorrt" else None,
            cpu_class=cpu_class() if backend == "onnxruntime" and precision in QUANTIZED_PRECISIONS else None,
        )

    def prepare(
        self, model: str, request: ProfileRequest | None = None, *, progress: ProgressFn | None = None
    ) -> PrepareResult:
        """Return a ready bundle for ``model`` built with ``request``: a hit, or a build on miss."""
        return self._prepare(model, request or ProfileRequest(), progress or _noop_progress, None)

    def _prepare(
        self,
        model: str,
        request: ProfileRequest,
        progress: ProgressFn,
        track: Build | None,
    ) -> PrepareResult:
        result = self._prepare_bundle(model, request, progress, track)
        if request.speculative_method in METHODS_WITH_DRAFT_BUNDLE and request.draft_model is not None:
            # The draft runs as an engine of its own: a bundle of the draft checkpoint with the
            # same profile minus speculation, cached (and evicted) like any other bundle.
            draft = self._prepare_bundle(request.draft_model, request.for_draft(), progress, None)
            result = replace(result, draft_bundle_id=draft.bundle_id, draft_bundle_dir=draft.bundle_dir)
        return result

    def _prepare_bundle(
        self,
        model: str,
        request: ProfileRequest,
        progress: ProgressFn,
        track: Build | None,
    ) -> PrepareResult:
        progress("resolve", 0.0)
        ckpt = self.resolve(model)
        draft = self.resolve(request.draft_model) if request.draft_model else None
        options = self.build_options(request, draft, ckpt.path)
        key = BundleKey.of(ckpt.digest, options)
        bid, rel = key.id, key.relpath
        if track is not None:
            track.status = replace(track.status, bundle_id=bid, profile=options.to_dict())
        hit = self._try_hit(bid, rel)
        if hit is not None:
            return PrepareResult(bid, hit, ckpt.path, draft.path if draft else None, built=False)
        with self.store.locks.exclusive(bid, timeout=self.lock_timeout):
            # Another process may have built it while we waited for the lock.
            hit = self._try_hit(bid, rel, adopt=True, model=model)
            if hit is not None:
                return PrepareResult(bid, hit, ckpt.path, draft.path if draft else None, built=False)
            seconds = self._build_locked(model, ckpt, draft, options, key, progress, track)
        self._prune_after_build(bid)
        return PrepareResult(
            bid,
            self.layout.root / rel,
            ckpt.path,
            draft.path if draft else None,
            built=True,
            build_seconds=seconds,
        )

    def _try_hit(self, bid: str, rel: Path, *, adopt: bool = False, model: str = "") -> Path | None:
        """A ready row whose files pass the quick check is a hit (records it); else None.

        The quick check (every file's size and a sampled hash) runs on every hit: a bundle
        whose bytes changed on disk is marked corrupt here and rebuilt, never served.

        With ``adopt`` (caller holds the exclusive lock), a published directory the catalog does
        not know is verified and adopted instead of rebuilt.
        """
        final = self.layout.root / rel
        info = self.catalog.get_bundle(bid)
        if info is not None and info.state == "stale":
            # Built for another GPU or TensorRT version: ready again if that is back (the
            # reconcile at the next start would say so too); else rebuilt under the lock.
            if self._stale_reason(info) is not None:
                return None
            info = self.catalog.set_stale(bid, None)
        if info is not None and info.state == "ready":
            if self._load_check(bid, final) is not None:
                return None
            self.catalog.record_hit(bid)
            return final
        if adopt and info is None and (final / "manifest.json").exists():
            try:
                manifest = read_manifest(final)
            except CorruptBundleError:
                return None
            if manifest.bundle_id == bid and verify_bundle(final, manifest).ok:
                self.reconciler.adopt(rel, manifest, model)
                self.catalog.record_hit(bid)
                return final
        return None

    def _load_check(self, bid: str, final: Path) -> str | None:
        """The quick check of a hit and of every engine load: every file's size and a sampled
        hash against the manifest. A mismatch marks the bundle corrupt (rebuilt by the next
        prepare, never served) and is returned; None when the bundle passes."""
        try:
            report = quick_verify_bundle(final, read_manifest(final))
            detail = "; ".join(f"{m.path}: {m.reason}" for m in report.mismatches[:10]) or None
        except CorruptBundleError as exc:
            detail = str(exc)
        if detail is not None:
            log.error("bundle %s failed the load check and will be rebuilt: %s", bid, detail)
            self._mark_corrupt(bid, detail)
        return detail

    def _build_locked(
        self,
        model: str,
        ckpt: ResolvedCheckpoint,
        draft: ResolvedCheckpoint | None,
        options: BuildOptions,
        key: BundleKey,
        progress: ProgressFn,
        track: Build | None,
    ) -> float:
        bid, rel = key.id, key.relpath
        builder = self.builders[options.backend]
        old = self.catalog.get_bundle(bid)
        final = self.layout.root / rel
        if old is not None and old.state in ("corrupt", "stale") and final.exists():
            # Never served: rebuilt in place (a stale bundle's builder says if this GPU cannot).
            self.store.remove(rel)
            self.layout.remove_context(bid)  # KV of the old build is not the new one's
            self.catalog.add_event(
                "evict",
                bundle_id=bid,
                model=old.model,
                reason=old.state,
                nbytes=old.size_bytes,
                detail=old.error,
            )
        self.catalog.begin_build(key, model=model)
        log.info("building bundle %s for %s (%s)", bid, model, options.name)
        staging = self.store.new_staging_dir(bid)
        if track is not None:
            track.staging = staging
        started = time.monotonic()
        try:
            progress("build", 0.0)
            engine = builder.build(ckpt.path, draft.path if draft else None, options, staging, progress)
            progress("publish", 0.95)
            manifest = self.store.publish(
                staging, key, versions=builder.versions(), engine={**engine, "source_model": model}
            )
        except BaseException as exc:
            seconds = time.monotonic() - started
            self.store.remove_staging(staging)
            reason = str(exc) or type(exc).__name__
            self.catalog.fail_build(bid, error=reason, seconds=seconds)
            log.error("build of %s failed after %.1fs: %s", bid, seconds, reason)
            if isinstance(exc, CacheError) or not isinstance(exc, Exception):
                raise
            if isinstance(exc, OSError) and exc.errno == errno.ENOSPC:
                raise InsufficientStorageError(
                    f"building {model} ({options.name}) ran out of disk space in {self.layout.root}; "
                    "nothing was kept. Free space (e.g. `cachesvc prune`) or use a --cache-dir on a "
                    "larger disk"
                ) from exc
            raise BuildError(f"building {model} ({options.name}) failed: {reason}") from exc
        seconds = time.monotonic() - started
        crash_point("build:published")
        if manifest.size_bytes > self.max_size_bytes:
            self.store.remove(rel)
            self.catalog.delete_bundle(
                bid, reason="lru", nbytes=manifest.size_bytes, detail="larger than the cap"
            )
            raise InsufficientStorageError(
                f"the bundle for {model} needs {manifest.size_bytes} bytes but the cache cap is "
                f"{self.max_size_bytes} bytes; raise --engine-cache-max-size-gb"
            )
        self.catalog.finish_build(
            bid, size_bytes=manifest.size_bytes, file_count=manifest.file_count, seconds=seconds
        )
        progress("done", 1.0)
        log.info("built bundle %s in %.1fs (%d bytes)", bid, seconds, manifest.size_bytes)
        return seconds

    def _prune_after_build(self, keep: str) -> None:
        result = self.prune(self.max_size_bytes, exclude=frozenset({keep}))
        if result.total_after > self.max_size_bytes:
            log.warning(
                "cache is %d bytes over its cap after pruning (the rest is leased, pinned or just built)",
                result.total_after - self.max_size_bytes,
            )

    # -- leases ----------------------------------------------------------------------------

    def lease(self, bid: str, *, timeout: float | None = None) -> BundleLease:
        """Take a shared lease on a ready bundle (blocks eviction by any process until released)
        for an engine to load it.

        Under the lease, the bundle gets the quick check of a cache hit (sizes and sampled
        hashes against its manifest): a bundle whose bytes changed since it was published is
        marked corrupt and refused here, so no engine ever loads it."""
        info = self.catalog.require_bundle(bid)
        if info.state != "ready":
            raise CorruptBundleError(f"bundle {bid} is {info.state}, not ready; prepare it again")
        lease = self.store.locks.lease(bid, timeout=timeout if timeout is not None else self.lock_timeout)
        # Eviction may have won the race between the catalog read and the lock.
        bundle_dir = self.layout.root / info.path
        if not (bundle_dir / "manifest.json").exists():
            lease.release()
            raise NotFoundError(f"bundle {bid} was evicted before it could be leased; prepare it again")
        try:
            detail = self._load_check(bid, bundle_dir)
        except BaseException:
            lease.release()
            raise
        if detail is not None:
            lease.release()
            raise CorruptBundleError(
                f"bundle {bid} does not match its manifest ({detail}); it is marked corrupt and "
                "the next prepare (POST /admin/builds, or a restart with this model) rebuilds it"
            )
        try:
            self.catalog.add_lease(bid, os.getpid())
        except BaseException:
            lease.release()  # a catalog outage here must not leave the bundle locked
            raise
        return BundleLease(self, info, lease)

    def prepare_and_lease(
        self,
        model: str,
        request: ProfileRequest | None = None,
        *,
        progress: ProgressFn | None = None,
        full_verify: bool = False,
    ) -> tuple[PrepareResult, BundleLease]:
        """Prepare then lease, retrying when an eviction slips in between.

        With ``full_verify`` (``serve`` start), the leased bundle is re-hashed against its whole
        manifest; a mismatch marks it corrupt and it is rebuilt once before giving up.
        """
        for attempt in range(3):
            result = self.prepare(model, request, progress=progress)
            try:
                lease = self.lease(result.bundle_id)
            except NotFoundError:
                if attempt == 2:
                    raise
                continue
            if not full_verify:
                return result, lease
            verified = self.verify(result.bundle_id)
            if verified.ok:
                return result, lease
            lease.release()
            if result.built or attempt == 2:
                raise CorruptBundleError(
                    f"bundle {result.bundle_id} does not match its manifest even after a rebuild: "
                    f"{verified.mismatches[:3]}; check the disk"
                )
        raise AssertionError("unreachable")

    def add_corrupt_listener(self, listener: Callable[[str, str], None]) -> None:
        """Call ``listener(bundle_id, detail)`` whenever this process marks a bundle corrupt."""
        self._corrupt_listeners.append(listener)

    def _mark_corrupt(self, bid: str, detail: str) -> None:
        try:
            self.catalog.set_verified(bid, ok=False, detail=detail)
        except NotFoundError:
            return
        for listener in list(self._corrupt_listeners):
            try:
                listener(bid, detail)
            except Exception:
                log.exception("corrupt-bundle listener failed")

    def holders(self, bid: str) -> list[LeaseHolder]:
        """Live lease holders of a bundle: this host's from the lock files, other nodes' from the catalog."""
        local = [
            LeaseHolder(pid=int(h["pid"]), host=str(h["host"]), since=str(h["since"]))
            for h in self.store.locks.holders(bid)
        ]
        here = {self.catalog.node, socket.gethostname()}
        remote = [h for h in self.catalog.leases(bid) if h.host not in here]
        return local + remote

    # -- queries ---------------------------------------------------------------------------

    def get_bundle(self, bid: str) -> BundleInfo:
        """One bundle (NotFoundError when unknown)."""
        return self.catalog.require_bundle(bid)

    def draft_bundle(self, info: BundleInfo) -> BundleInfo | None:
        """The draft checkpoint's own bundle that ``info`` speculates with (``draft_model``), when
        it is ready on this node; None for bundles without one or when it is missing."""
        profile = dict(info.profile)
        if profile.get("speculative_method") not in METHODS_WITH_DRAFT_BUNDLE or not info.draft_digest:
            return None
        options = BuildOptions(**{**profile, "speculative_method": None, "draft_digest": None})
        draft = self.catalog.get_bundle(BundleKey.of(info.draft_digest, options).id)
        return draft if draft is not None and draft.state == "ready" else None

    def bundle_dir(self, info: BundleInfo) -> Path:
        """Absolute directory of a bundle."""
        return self.layout.root / info.path

    def bundle_detail(self, bid: str, *, events: int = 20) -> BundleDetail:
        """A bundle with its manifest summary, files, lease holders and recent events."""
        info = self.catalog.require_bundle(bid)
        manifest: dict[str, Any] | None = None
        files: tuple[dict[str, Any], ...] = ()
        try:
            m = read_manifest(self.bundle_dir(info))
        except CorruptBundleError:
            m = None
        if m is not None:
            manifest = {
                "layout_version": m.layout_version,
                "bundle_id": m.bundle_id,
                "checkpoint_digest": m.checkpoint_digest,
                "draft_digest": m.draft_digest,
                "backend": m.backend,
                "versions": dict(m.versions),
                "engine": dict(m.engine),
                "created_at": m.created_at,
                "size_bytes": m.size_bytes,
                "file_count": m.file_count,
            }
            files = tuple({"path": f.path, "size": f.size, "sha256": f.sha256} for f in m.files)
        return BundleDetail(
            bundle=info,
            manifest=manifest,
            files=files,
            holders=tuple(self.holders(bid)),
            events=tuple(self.catalog.events(bundle_id=bid, limit=events)),
        )

    def list_bundles(self, **filters: Any) -> BundlePage:
        """Filter, sort and page bundles (see ``Catalog.list_bundles``)."""
        state = filters.get("state")
        if state is not None and state not in BUNDLE_STATES:
            raise ConfigError("state", f"must be one of {', '.join(BUNDLE_STATES)}, got {state!r}")
        return self.catalog.list_bundles(**filters)

    def catalog_version(self) -> int:
        """Grows with every catalog change a bundle listing can show (cache key for readers)."""
        return self.catalog.version()

    # -- served names --------------------------------------------------------------------

    def set_alias(self, name: str, *, bundle_id: str | None = None, model: str | None = None) -> AliasInfo:
        """Point the served name ``name`` at a bundle, or at a checkpoint (its most recently used
        ready bundle). The target must be in the catalog."""
        if not name.strip() or name.strip() != name:
            raise ConfigError("name", f"must be a non-blank name, got {name!r}")
        if bundle_id is not None:
            self.catalog.require_bundle(bundle_id)
        elif model is not None and not self.catalog.list_bundles(model=model, node=self.node, limit=1).items:
            raise NotFoundError(
                f"no bundle of {model!r} is in the catalog; build it first (POST /admin/builds)"
            )
        return self.catalog.set_alias(name, bundle_id=bundle_id, model=model)

    def remove_alias(self, name: str) -> None:
        """Delete a served name (NotFoundError when unknown)."""
        self.catalog.remove_alias(name)

    def aliases(self) -> list[AliasInfo]:
        """Every operator-given served name."""
        return self.catalog.aliases()

    def record_engine_event(
        self,
        kind: str,
        bundle_id: str,
        *,
        model: str | None = None,
        reason: str | None = None,
        seconds: float | None = None,
        nbytes: int | None = None,
    ) -> None:
        """Append a ``load``/``unload`` event of a serving process to the audit log."""
        self.catalog.add_event(
            kind, bundle_id=bundle_id, model=model, reason=reason, seconds=seconds, nbytes=nbytes
        )

    def list_checkpoints(self) -> list[CheckpointInfo]:
        """Resolved checkpoints with their bundle ids."""
        return self.catalog.list_checkpoints()

    def find_checkpoint(self, ref: str, *, by_path: bool = True) -> CheckpointInfo:
        """The catalog's checkpoint named by ``ref``: its digest or a unique prefix of it (at least
        8 hex characters) or, with ``by_path``, its path or the model string it was resolved
        from. NotFoundError when none matches; ConfigError (field ``checkpoint``) when a prefix
        matches several."""
        wanted = ref.strip()
        known = self.catalog.list_checkpoints()
        if re.fullmatch(r"[0-9a-f]{8,64}", wanted):
            matches = [c for c in known if c.digest.startswith(wanted)]
            if len(matches) == 1:
                return matches[0]
            if len(matches) > 1:
                raise ConfigError(
                    "checkpoint",
                    f"{wanted!r} is the start of {len(matches)} checkpoint digests; give more characters",
                )
        if by_path and wanted:
            as_path = os.path.abspath(os.path.expanduser(wanted))
            for c in known:
                if wanted.rstrip("/") == c.source.rstrip("/") or as_path == os.path.abspath(c.path):
                    return c
        raise NotFoundError(
            f"no checkpoint {ref!r} in the catalog (`cachesvc checkpoints ls` / GET /admin/checkpoints "
            "list them by digest)"
        )

    def remove_checkpoint(self, ref: str, *, with_bundles: bool = False, by_path: bool = True
                          ) -> CheckpointRemoval:
        """Remove a checkpoint from the cache: its catalog row, its files when they are the
        cache's own (a hub download or converted GGUF under ``checkpoints/``; a user's directory
        is only forgotten) and, with ``with_bundles``, this node's bundles of it (those built
        from it and those that use it as their speculative draft).

        Refused (ConflictError, nothing changed) while a bundle of it is pinned or leased, when
        it has bundles and ``with_bundles`` is false, or when other nodes hold bundles of it
        (their files are on their disks: remove those there first). Events: ``evict`` (reason
        ``manual``) per bundle, then ``checkpoint_rm`` with the bytes deleted.
        """
        ckpt = self.find_checkpoint(ref, by_path=by_path)
        digest, short = ckpt.digest, ckpt.digest[:16]
        bundles = self.catalog.checkpoint_bundles(digest)
        mine = [b for b in bundles if b.node == self.node]
        others = sorted({b.node for b in bundles if b.node != self.node})
        pinned = [b.id for b in mine if b.pinned]
        if pinned:
            raise PinnedError(
                f"checkpoint {short} has {len(pinned)} pinned bundle(s) ({', '.join(pinned)}); "
                "unpin them first (`cachesvc bundles unpin ID`)"
            )
        leased = [b.id for b in mine if self.store.locks.is_locked(b.id)]
        if leased:
            holders = [h for bid in leased for h in self.holders(bid)]
            who = ", ".join(f"pid {h.pid} on {h.host}" for h in holders) or "another process"
            raise LeasedError(
                f"checkpoint {short} has bundle(s) in use ({', '.join(leased)}) by {who}; "
                "stop serving them first",
                holders=[{"pid": h.pid, "host": h.host, "since": h.since} for h in holders],
            )
        if others:
            raise ConflictError(
                f"checkpoint {short} has bundles on other nodes ({', '.join(others)}); remove them "
                "there first (a node only deletes files on its own disk)",
                reason="other_nodes",
            )
        if mine and not with_bundles:
            raise ConflictError(
                f"checkpoint {short} has {len(mine)} bundle(s) ({', '.join(b.id for b in mine)}); "
                "remove them with it: --with-bundles (CLI) or ?with_bundles=true (HTTP)",
                reason="has_bundles",
            )
        removed: list[str] = []
        bundle_bytes = 0
        for b in mine:
            # Re-checks pin and lease under the bundle's exclusive lock (a lease may have
            # started since): a conflict stops here with the checkpoint row still in place.
            bundle_bytes += self.evictor.remove(b.id)
            removed.append(b.id)
        row = self.catalog.checkpoint_row(digest)
        owned = (
            row is not None
            and row[1] == self.node
            and owned_checkpoint_path(self.layout.checkpoints, ckpt.path)
        )
        file_bytes = 0
        if owned:
            try:
                file_bytes = remove_checkpoint_files(self.layout.checkpoints, self.layout.trash, ckpt.path)
            except OSError as exc:
                raise CacheError(f"could not delete checkpoint {short} at {ckpt.path}: {exc}") from exc
            detail = f"deleted {ckpt.path}"
        else:
            detail = f"forgotten; files at {ckpt.path} left in place (not the cache's own)"
        self.catalog.delete_checkpoint(digest, nbytes=file_bytes, detail=detail)
        log.info("checkpoint %s removed (%s; %d bundle(s))", short, detail, len(removed))
        return CheckpointRemoval(
            digest=digest,
            source=ckpt.source,
            path=ckpt.path,
            bundles_removed=tuple(removed),
            bundle_bytes=bundle_bytes,
            files_deleted=owned,
            file_bytes=file_bytes,
        )

    def events(
        self,
        *,
        kind: str | None = None,
        since: datetime | None = None,
        limit: int = 100,
        bundle_id: str | None = None,
        node: str | None = None,
    ) -> list[EventInfo]:
        """The audit log, newest first (every node's unless ``node`` is given)."""
        return self.catalog.events(kind=kind, since=since, limit=limit, bundle_id=bundle_id, node=node)

    def catalog_state(self) -> CatalogState:
        """Whether the catalog database answers (``/health``)."""
        return self.catalog.state()

    def check_catalog(self) -> None:
        """Raise :class:`CatalogUnavailableError` unless the catalog takes a write now (a build
        is refused up front instead of being accepted and then failing)."""
        self.catalog.ping()

    def prune_events(self, *, max_age_days: float, max_rows: int) -> int:
        """Apply the audit log's retention to this node's events (0 disables a limit); the
        running totals behind stats and metrics are kept. Returns how many events went."""
        older_than = utcnow() - timedelta(days=max_age_days) if max_age_days > 0 else None
        removed = self.catalog.prune_events(older_than=older_than, keep_rows=max_rows or None)
        if removed:
            log.info("event retention: removed %d old events of node %s", removed, self.node)
        return removed

    @property
    def node(self) -> str:
        """This process's node name (on every bundle, lease and event row it writes)."""
        return self.catalog.node

    def stats(self, node: str | None = None) -> CacheStats:
        """Cache statistics from the catalog (they survive restarts, agree across processes).

        Every change stats can show is an event or a new checkpoint, so the result is reused
        until the catalog version or the checkpoint count moves (dashboards and /metrics poll).
        """
        node = node or self.node
        if node != self.node and not self.fleet.knows(node):
            raise NotFoundError(f"no node named {node!r} in the catalog (GET /admin/nodes lists them)")
        cap = self.max_size_bytes if node == self.node else (self.fleet.node_cap(node) or 0)
        key = (self.catalog.version(), self.catalog.checkpoint_count(), cap, node)
        with self._stats_lock:
            stats = None
            if self._stats_cache is not None and self._stats_cache[0] == key:
                stats = self._stats_cache[1]
        if stats is None:
            stats = self.catalog.stats(max_size_bytes=cap, node=node)
            with self._stats_lock:
                self._stats_cache = (key, stats)
        if node != self.node:
            return stats
        # On disk, not in the catalog: a conversion's leftovers have no row (reconcile removes them);
        # the bundles' context records (context/<bundle_id>/) count in the cache's size.
        return replace(stats, checkpoint_bytes=dir_size(self.layout.checkpoints),
                       size_bytes=stats.size_bytes + self.layout.context_bytes())

    # -- pin / verify / remove -------------------------------------------------------------

    def pin(self, bid: str) -> BundleInfo:
        """Protect a bundle from eviction."""
        return self.catalog.set_pinned(bid, True)

    def unpin(self, bid: str) -> BundleInfo:
        """Let a bundle be evicted again."""
        return self.catalog.set_pinned(bid, False)

    def _stale_reason(self, info: BundleInfo) -> str | None:
        """Why ``info``'s engine cannot run on this node now (see ``builders.stale_reason``)."""
        if info.backend != "tensorrt" and info.profile.get("cpu_class") is None:
            return None  # fp32 CPU bundles run anywhere: no manifest read on the hit path
        try:
            manifest = read_manifest(self.bundle_dir(info))
        except CorruptBundleError as exc:
            return str(exc)
        return stale_reason(info.backend, manifest.engine, gpu_disabled=self.gpu_disabled)

    def verify(self, bid: str) -> VerifyResult:
        """Re-hash a bundle against its manifest; a mismatch marks it corrupt (never served).

        Files that match but were built for another GPU or TensorRT version than this node has
        mark it ``stale``; a clean verify makes a corrupt or stale bundle ready again."""
        info = self.catalog.require_bundle(bid)
        if info.state == "building":
            raise LeasedError(f"bundle {bid} is being built; verify it when the build finishes")
        bundle_dir = self.bundle_dir(info)
        mismatches: tuple[dict[str, str], ...]
        try:
            report = verify_bundle(bundle_dir)
            files_checked, bytes_checked = report.files_checked, report.bytes_checked
            mismatches = tuple({"path": m.path, "reason": m.reason} for m in report.mismatches)
        except CorruptBundleError as exc:
            files_checked, bytes_checked = 0, 0
            mismatches = ({"path": "manifest.json", "reason": str(exc)},)
        ok = not mismatches
        detail = None if ok else "; ".join(f"{m['path']}: {m['reason']}" for m in mismatches[:10])
        if ok:
            stale = self._stale_reason(info)
            if stale is not None and self.store.locks.is_locked(bid):
                # Leased: a process on this node runs it, so it runs here (as reconcile holds).
                stale = None
            if stale is not None:
                log.warning("bundle %s is stale and will not be loaded: %s", bid, stale)
            updated = self.catalog.set_verified(bid, ok=True, detail=None, stale=stale)
        else:
            log.error("bundle %s is corrupt: %s", bid, detail)
            self._mark_corrupt(bid, detail or "corrupt")
            updated = self.catalog.require_bundle(bid)
        return VerifyResult(bid, ok, files_checked, bytes_checked, mismatches, updated.state)

    def remove(self, bid: str) -> int:
        """Evict one bundle now (reason ``manual``); returns bytes freed (see :mod:`cachesvc.eviction`)."""
        return self.evictor.remove(bid)

    # -- eviction --------------------------------------------------------------------------

    def plan_eviction(
        self, max_bytes: int | None = None, *, exclude: frozenset[str] = frozenset(), reason: str = "lru"
    ) -> EvictionPlan:
        """Plan an LRU eviction down to ``max_bytes`` (default: the cache cap). Changes nothing."""
        return self.evictor.plan(max_bytes, exclude=exclude, reason=reason)

    def execute_plan(self, plan: EvictionPlan) -> EvictionResult:
        """Carry out a plan; a bundle leased or pinned since planning is skipped, not deleted."""
        return self.evictor.execute(plan)

    def prune(
        self, max_bytes: int | None = None, *, dry_run: bool = False, exclude: frozenset[str] = frozenset()
    ) -> EvictionResult:
        """Evict least-recently-used idle bundles until the cache fits ``max_bytes``."""
        return self.evictor.prune(max_bytes, dry_run=dry_run, exclude=exclude)

    def clear(self, *, dry_run: bool = False) -> EvictionResult:
        """Remove every idle bundle (pinned and leased ones stay). Checkpoints are never touched."""
        return self.evictor.clear(dry_run=dry_run)

    # -- reconcile -------------------------------------------------------------------------

    def reconcile(self) -> ReconcileReport:
        """Re-sync catalog and disk (startup and on demand; see :mod:`cachesvc.reconcile`)."""
        return self.reconciler.reconcile()

    # -- background builds -----------------------------------------------------------------

    def start_build(
        self,
        model: str,
        request: ProfileRequest | None = None,
        *,
        allowed_roots: tuple[Path, ...] | None = None,
    ) -> BuildStatus:
        """Queue a build in the background; the same model and profile join the running build.

        What can be checked without resolving or building is checked first (a 400 at the API
        instead of a 202 that fails later): backend, precision, profile limits, the model's
        form, and for a local directory that it holds ``config.json`` and, with
        ``allowed_roots`` (the HTTP surface passes ``--allowed-model-roots``), where it lies.
        """
        request = request or ProfileRequest()
        backend = resolve_backend(request.backend, self.builders, gpu_disabled=self.gpu_disabled)
        resolve_precision(request.precision, backend)
        for name, value in (("model", model), ("draft_model", request.draft_model)):
            if value is not None:
                _check_model_name(name, value, allowed_roots)
        self.check_catalog()
        return self.builds.start(model, request)

    def check_model(self, field: str, model: str, allowed_roots: tuple[Path, ...] | None) -> None:
        """The checks ``start_build`` makes on a model name (desired state is checked the same way)."""
        _check_model_name(field, model, allowed_roots)

    def get_build(self, build_id: str) -> BuildStatus:
        """State of one background build (NotFoundError when unknown)."""
        return self.builds.get(build_id)

    def list_builds(self) -> list[BuildStatus]:
        """Builds started by this process, newest first."""
        return self.builds.all_builds()

    def wait_for_build(self, build_id: str, timeout: float = 600.0, poll: float = 0.05) -> BuildStatus:
        """Block until a background build finishes (tests and the CLI use this)."""
        return self.builds.wait(build_id, timeout, poll)


def _owning_node(layout: CacheLayout, node: str | None, *, claim: bool) -> str:
    """The node this process acts as on ``layout`` (see ``CacheManager.open``)."""
    recorded = layout.recorded_node()
    if recorded is None:
        wanted = node or socket.gethostname()
        if not claim:
            return wanted  # a command on a directory no server owns yet records nothing
        recorded = layout.record_node(wanted)
    elif node is None and not claim:
        return recorded  # commands on the directory act as its node
    else:
        wanted = node or socket.gethostname()
    if wanted != recorded:
        raise ConfigError(
            "node_name",
            f"the cache directory {layout.root} belongs to node {recorded!r} (recorded in "
            f"{layout.node_file}), not {wanted!r}; run as node {recorded!r} or use another cache "
            "directory (two nodes on one directory would delete each other's bundles)",
        )
    return recorded


#: Entries a local checkpoint directory may hold for the allowed-roots check (a checkpoint has
#: tens of files; bounding the walk keeps a request from listing a huge tree).
MAX_CHECKPOINT_ENTRIES = 10_000


def _check_model_name(field: str, model: str, allowed_roots: tuple[Path, ...] | None) -> None:
    """A hub id (or ``org/name/FILE.gguf``), or a local checkpoint under an allowed root: a
    directory with ``config.json``, a ``.gguf`` file, or a directory holding one.

    Paths are compared resolved (``..`` and links followed): the path given and, for a
    directory, every file and link in it, since the build opens them; a link inside an allowed
    root that leads out of every root is refused like a path outside."""
    if not looks_like_path(model):
        if any(part in ("", ".", "..") or "\\" in part for part in model.split("/")):
            raise ConfigError(
                field, f"{model!r} has an empty, '.' or '..' component; name a hub model or file plainly"
            )
        hub_gguf = split_hub_gguf(model)
        if not is_hub_id(hub_gguf[0] if hub_gguf else model):
            raise ConfigError(
                field,
                f"{model!r} is not a Hugging Face model id ('org/name': letters, digits, '-', '_', '.'; "
                "or 'org/name/FILE.gguf') nor an existing directory",
            )
        return
    path = Path(model).expanduser().resolve()
    if allowed_roots is not None:
        roots = tuple(root.resolve() for root in allowed_roots)
        listed = ", ".join(str(r) for r in allowed_roots)
        if not _inside(path, roots):
            raise ConfigError(
                field,
                f"{model!r} is outside the directories builds may read ({listed}); move the checkpoint "
                "there or start the server with --allowed-model-roots",
            )
        if path.is_dir():
            escaping = _link_out_of(path, roots)
            if escaping is not None:
                raise ConfigError(field, f"{model!r} holds {escaping} ({listed})")
    if path.is_file() and path.name.endswith(GGUF_SUFFIX):
        return
    if not path.is_dir():
        raise CheckpointError(f"no such directory: {model}")
    if not (path / "config.json").is_file() and local_gguf(path) is None:
        raise CheckpointError(
            f"{model} has no config.json and no .gguf file; pass a Hugging Face checkpoint directory "
            "(config.json next to the weights) or a GGUF file"
        )


def _inside(path: Path, roots: tuple[Path, ...]) -> bool:
    return any(path.is_relative_to(root) for root in roots)


def _link_out_of(directory: Path, roots: tuple[Path, ...]) -> str | None:
    """Why ``directory`` cannot be read within ``roots``: its first link that resolves outside
    them (or too many entries to check); None when every entry is inside. Links to
    directories are checked, not descended into."""
    seen = 0
    for parent, dirs, files in os.walk(directory, followlinks=False):
        for name in (*dirs, *files):
            seen += 1
            if seen > MAX_CHECKPOINT_ENTRIES:
                return (
                    f"more than {MAX_CHECKPOINT_ENTRIES} files: not a checkpoint directory, and too "
                    "many to check against the directories builds may read"
                )
            entry = Path(parent, name)
            if entry.is_symlink() and not _inside(entry.resolve(), roots):
                return (
                    f"{entry.relative_to(directory)}, a link leading outside the directories builds "
                    "may read; replace the link with the file itself"
                )
    return None
