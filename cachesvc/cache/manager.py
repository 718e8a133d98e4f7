"""CacheManager: the one place that uses the catalog, the disk store and the builders together.

Prepare (hit or build under the bundle's lock) and leases are here; the rest are its sections,
used as attributes: ``queries`` (read-only views, :mod:`cachesvc.cache.queries`), ``verifier``
(:mod:`cachesvc.cache.verification`), ``evictor`` (:mod:`cachesvc.cache.eviction`), ``reconciler``
(:mod:`cachesvc.cache.reconcile`), ``builds`` (background builds, :mod:`cachesvc.cache.build_jobs`),
``adapters`` (LoRA adapters converted into the cache, :mod:`cachesvc.cache.adapters`), ``registry``
(the fleet's OCI registry: push, pull, list, :mod:`cachesvc.cache.registry`), ``pulls`` (background
pulls), ``fleet`` (:mod:`cachesvc.cache.catalog.fleet`: nodes, desired state) and the ``catalog`` itself
(:mod:`cachesvc.cache.catalog`: one repository per table, ``catalog.bundles`` …) for reads.

Every admin write (pins, aliases, desired state, adapters, event retention, serving events)
goes through a method here or through a section (``adapters``, ``evictor``), with its checks:
the HTTP routes, the CLI, serving and the fleet agent never write ``manager.catalog`` rows
themselves (the agent's heartbeat, its own ``nodes`` row, is ``manager.fleet.heartbeat``).
The rules they keep: docs/cache.md.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Mapping
from dataclasses import replace
from pathlib import Path
from typing import Any

from cachesvc.cache.adapters import AdapterStore, check_adapter_source
from cachesvc.cache.build_jobs import Build, BuildJobs
from cachesvc.cache.builders import (
    Builder,
    BuildJob,
    ProgressFn,
    build_disk_bytes,
    default_builders,
    resolve_backend,
    resolve_precision,
)
from cachesvc.cache.bundle_leases import BundleLease, CombinedLease
from cachesvc.cache.catalog import Catalog, default_catalog_url
from cachesvc.cache.catalog.fleet import FleetCatalog
from cachesvc.cache.checkpoints import (
    ResolvedCheckpoint,
    check_image_limits,
    check_model_name,
    resolve_checkpoint,
)
from cachesvc.cache.crashpoints import crash_point
from cachesvc.cache.eviction import Evictor
from cachesvc.cache.fleet_records import DesiredSpec, DesiredState
from cachesvc.cache.profiles import BuildOptions, BundleKey, ProfileRequest
from cachesvc.cache.queries import CacheQueries
from cachesvc.cache.reconcile import Reconciler
from cachesvc.cache.records import (
    AdapterInfo,
    AliasInfo,
    BuildStatus,
    BundleInfo,
    CheckpointRemoval,
    PrepareResult,
)
from cachesvc.cache.registry import BundleRegistry, PullResult, RegistryRef, RegistrySettings, parse_ref
from cachesvc.cache.store import BundleStore, CacheLayout, read_manifest, verify_bundle
from cachesvc.cache.store.space import disk_full, human_size, require_free
from cachesvc.cache.verification import BundleVerifier
from cachesvc.errors import (
    BuildError,
    CacheError,
    ConfigError,
    CorruptBundleError,
    DiskFullError,
    InsufficientStorageError,
    NotFoundError,
    RegistryError,
    RegistryNotFoundError,
)
from inference.build_profile import DEFAULT_POOLING, METHODS_WITH_DRAFT_BUNDLE, QUANTIZED_PRECISIONS
from inference.cpu_class import cpu_class

__all__ = ["BundleLease", "CacheManager", "CombinedLease"]

log = logging.getLogger("cachesvc.manager")


def _noop_progress(stage: str, fraction: float) -> None:
    return None


class CacheManager:
    """Prepare and lease engine bundles; list, verify, evict and reconcile through its sections."""

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
        registry: RegistrySettings | None = None,
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
        #: Nodes and desired state (the same database; see cachesvc.fleet for the agent).
        self.fleet = FleetCatalog(catalog)
        #: The read-only views (listings, details, stats) the admin API, CLI and serving show.
        self.queries = CacheQueries(catalog, self.store, self.fleet, max_size_bytes=max_size_bytes)
        holders = self.queries.holders
        self.evictor = Evictor(catalog, self.store, max_size_bytes=max_size_bytes, holders=holders)
        self.reconciler = Reconciler(catalog, self.store, holders=holders, gpu_disabled=gpu_disabled)
        self.builds = BuildJobs(self._prepare, catalog)
        #: Background pulls from the registry (``POST /admin/pulls``), tracked like builds.
        self.pulls = BuildJobs(self._pull_job, catalog, kind="pull")
        #: The manifest checks: full verify, the quick check of every hit and load, staleness.
        self.verifier = BundleVerifier(catalog, self.store, gpu_disabled=gpu_disabled)
        #: LoRA adapters converted into the cache (:mod:`cachesvc.cache.adapters`); a new one prunes
        #: the cache back under its cap like a new bundle does.
        self.adapters = AdapterStore(
            catalog, self.store, holders=holders, offline=offline, lock_timeout=lock_timeout,
            after_add=self._prune_after_build,
        )
        #: The fleet's OCI registry (:mod:`cachesvc.cache.registry`): push, pull, list; with one
        #: configured, a miss is pulled from it before anything is built.
        self.registry = BundleRegistry(
            catalog, self.store, self.builders,
            settings=registry or RegistrySettings(), max_size_bytes=max_size_bytes,
        )

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
        registry: RegistrySettings | None = None,
    ) -> CacheManager:
        """Open (creating if needed) the cache at ``cache_dir`` and upgrade the catalog schema.

        One node per cache directory (its bundle rows describe this disk): the root records the
        node that owns it. ``claim_node`` (a server starting) records ``node`` (default: the host
        name) when none is recorded and refuses any other name; without it (commands run on the
        directory) the process acts as the recorded node, and a ``node`` given that is not the
        recorded one is refused. A refusal changes nothing on disk or in the catalog."""
        layout = CacheLayout(Path(cache_dir).expanduser().absolute())
        layout.ensure()
        node = layout.owning_node(node, claim=claim_node)
        catalog = Catalog(catalog_url or default_catalog_url(layout.root), node=node)
        if upgrade:
            catalog.upgrade()
        if claim_node:
            provisional = layout.unclaimed_node()
            if provisional is not None:
                # Commands ran here before any server claimed the directory: what they did
                # (bundles, adapters, events) is this node's, not a node of its own.
                taken = FleetCatalog(catalog).take_over(provisional)
                if taken:
                    log.info("node %s took over %d rows of the commands run before it (as %s)",
                             node, taken, provisional)
                layout.forget_unclaimed_node()
        return cls(
            layout,
            catalog,
            default_builders(layout.root, gpu_disabled=gpu_disabled) if builders is None else builders,
            max_size_bytes=max_size_bytes,
            lock_timeout=lock_timeout,
            offline=offline,
            gpu_disabled=gpu_disabled,
            registry=registry,
        )

    def close(self) -> None:
        """Stop background builds from being started and dispose of the catalog engine."""
        self.builds.close()
        self.pulls.close()
        self.catalog.close()

    # -- prepare ---------------------------------------------------------------------------

    def resolve(self, model: str) -> ResolvedCheckpoint:
        """Resolve a model id or directory and record the checkpoint in the catalog."""
        try:
            ckpt = resolve_checkpoint(model, self.layout.checkpoints, offline=self.offline)
        except DiskFullError as exc:
            # The GGUF conversion, a build's first stage, ran out of disk part way: recorded as
            # a bundle build that does (no row: the bundle's id needs the converted files).
            self.catalog.events.add("build_failed", model=model, seconds=0.0, detail=str(exc))
            raise
        self.catalog.checkpoints.upsert(
            digest=ckpt.digest,
            source=model,
            path=ckpt.path,
            size_bytes=ckpt.size_bytes,
            file_count=ckpt.file_count,
        )
        return ckpt

    def catalog_bundle_id(self, model: str, request: ProfileRequest) -> str:
        """The id the bundle of ``model`` built with ``request`` has, from the catalog alone: no
        hashing, no download, no row written. NotFoundError when a checkpoint (``model`` or the
        draft) was never resolved here; the bundle itself may or may not exist."""
        digest, options, _ = self._known_build(model, request)
        return BundleKey.of(digest, options).id

    def _known_build(self, model: str, request: ProfileRequest) -> tuple[str, BuildOptions, Path]:
        """The checkpoint digest, the build options and the checkpoint's path of ``model`` under
        ``request``, from the catalog alone (NotFoundError for a checkpoint never resolved here)."""
        digest, path = self._known_checkpoint("model", model)
        draft = self._known_checkpoint("draft_model", request.draft_model)[0] if request.draft_model else None
        return digest, self.build_options(request, draft, path), path

    def _known_checkpoint(self, field: str, model: str) -> tuple[str, Path]:
        wanted = model.rstrip("/")
        for ckpt in self.catalog.checkpoints.all():
            if wanted in (ckpt.source.rstrip("/"), str(ckpt.path)):
                return ckpt.digest, Path(ckpt.path)
        raise NotFoundError(
            f"{field} {model!r} is not a checkpoint in the catalog; build it first (POST /admin/builds)"
        )

    def build_options(self, request: ProfileRequest, draft_digest: str | None = None,
                      checkpoint_dir: Path | None = None) -> BuildOptions:
        """Resolve ``auto`` choices and versions into the concrete build profile (``auto``
        precision on the CPU keeps the precision of ``checkpoint_dir``'s weights)."""
        backend = resolve_backend(request.backend, self.builders, gpu_disabled=self.gpu_disabled)
        embed = request.task == "embed"
        # An embedding bundle is fp32 whatever the file holds (auto never picks int4 for it).
        precision = ("fp32" if embed and request.precision == "auto"
                     else resolve_precision(request.precision, backend, checkpoint_dir))
        builder = self.builders[backend]
        request.check_draft(draft_digest)
        if checkpoint_dir is not None:
            check_image_limits(checkpoint_dir, request.max_image_tokens, request.max_image_tokens_per_image)
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
            task=request.task,
            pooling=(request.pooling or DEFAULT_POOLING) if embed else None,
            lora=request.lora,
            kernels=request.kernels,
            kv_cache_dtype=request.kv_cache_dtype,
            max_image_tokens=request.max_image_tokens,
            max_image_tokens_per_image=request.max_image_tokens_per_image,
        )

    def prepare(
        self, model: str, request: ProfileRequest | None = None, *, progress: ProgressFn | None = None
    ) -> PrepareResult:
        """Return a ready bundle for ``model`` built with ``request``: a hit, or a build on miss."""
        return self._prepare(model, request or ProfileRequest(), progress or _noop_progress, None)

    def _prepare(
        self, model: str, request: ProfileRequest, progress: ProgressFn, track: Build | None
    ) -> PrepareResult:
        """The bundle of ``model`` and, for a speculative method with a draft engine, the draft's."""
        result = self._prepare_bundle(model, request, progress, track)
        if request.speculative_method in METHODS_WITH_DRAFT_BUNDLE and request.draft_model is not None:
            # The draft runs as an engine of its own: a bundle of the draft checkpoint with the
            # same profile minus speculation, cached (and evicted) like any other bundle.
            draft = self._prepare_bundle(request.draft_model, request.for_draft(), progress, None)
            result = replace(result, draft_bundle_id=draft.bundle_id, draft_bundle_dir=draft.bundle_dir)
        return result

    def _prepare_bundle(
        self, model: str, request: ProfileRequest, progress: ProgressFn, track: Build | None
    ) -> PrepareResult:
        """One bundle: a hit, or a build under its exclusive lock (``track``: a background build)."""
        progress("resolve", 0.0)
        ckpt = self.resolve(model)
        draft = self.resolve(request.draft_model) if request.draft_model else None
        options = self.build_options(request, draft.digest if draft else None, ckpt.path)
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
            pulled = self._try_pull(model, key, progress)
            if pulled is None:
                seconds = self._build_locked(model, ckpt, draft, options, key, progress, track)
        self._prune_after_build(bid)
        if pulled is not None:
            return PrepareResult(bid, pulled.bundle_dir, ckpt.path, draft.path if draft else None,
                                 built=False, pulled_from=pulled.ref)
        if self.registry.settings.push:
            self._push_quietly(bid)
        return PrepareResult(
            bid,
            self.layout.root / rel,
            ckpt.path,
            draft.path if draft else None,
            built=True,
            build_seconds=seconds,
        )

    def _try_pull(self, model: str, key: BundleKey, progress: ProgressFn) -> PullResult | None:
        """With a registry configured, pull the bundle of ``key`` from it (the caller holds the
        exclusive lock); None (and a local build) when it has none, or is down, or sends
        something refused: one log line says which."""
        ref = self.registry.settings.ref
        if ref is None:
            return None
        progress("pull", 0.0)
        try:
            return self.registry.pull_locked(ref.with_tag(key.id), expected=key, model=model)
        except RegistryNotFoundError:
            log.info("registry %s has no bundle %s; building it here", ref, key.id)
        except (RegistryError, InsufficientStorageError, OSError) as exc:
            log.warning("could not pull bundle %s from %s (%s); building it here", key.id, ref, exc)
            # A pull cut short keeps its staging directory to resume; the build replaces it.
            for bid, path in self.store.staging_dirs():
                if bid == key.id:
                    self.store.remove_staging(path)
        return None

    def pull(self, model: str | None = None, request: ProfileRequest | None = None, *,
             ref: str | None = None) -> PullResult:
        """Pull a bundle from the registry into the cache (no build either way).

        With ``model``: the bundle of ``model`` built with ``request`` for this node, looked up
        by its key (its id is the canonical tag) in ``ref`` (a namespace; default: the
        configured registry). Without: ``ref`` must name a tag (``oci://host/ns:TAG``), and the
        bundle it holds must fit this node. A bundle already here is a hit (``already``)."""
        if model is not None:
            return self._pull_model(model, request or ProfileRequest(), ref, None)[0]
        if not ref:
            raise ConfigError("ref", "give a model (--model) or a reference with a tag (oci://host/ns:TAG)")
        target = parse_ref(ref, field="ref")
        if target.tag is None:
            raise ConfigError("ref", f"{ref} names no tag; give oci://host/namespace:TAG or --model")
        with self.registry.client(target) as client:
            key = self.registry.check_fits(self.registry.fetch(target, client), str(target))
        return self._pull_key(key, target, None)

    def _pull_model(self, model: str, request: ProfileRequest, ref: str | None, track: Build | None
                    ) -> tuple[PullResult, ResolvedCheckpoint]:
        base = self.registry.resolve_ref(ref)  # bad input is refused before any hashing
        ckpt = self.resolve(model)
        draft = self.resolve(request.draft_model) if request.draft_model else None
        options = self.build_options(request, draft.digest if draft else None, ckpt.path)
        key = BundleKey.of(ckpt.digest, options)
        if track is not None:
            track.status = replace(track.status, bundle_id=key.id, profile=options.to_dict())
        return self._pull_key(key, base if base.tag else base.with_tag(key.id), model), ckpt

    def start_pull(self, model: str, request: ProfileRequest | None = None, *, ref: str | None = None,
                   allowed_roots: tuple[Path, ...] | None = None) -> BuildStatus:
        """Queue a pull of ``model``'s bundle in the background (``POST /admin/pulls``), after
        the checks that need no download (400s: the model name, the reference, a registry)."""
        request = request or ProfileRequest()
        check_model_name("model", model, allowed_roots)
        self.registry.resolve_ref(ref)
        self.catalog.ping()
        return self.pulls.start(model, request, ref=ref)

    def _pull_job(
        self, model: str, request: ProfileRequest, progress: ProgressFn, track: Build
    ) -> PrepareResult:
        progress("pull", 0.0)
        result, ckpt = self._pull_model(model, request, track.ref, track)
        progress("done", 1.0)
        return PrepareResult(result.bundle_id, result.bundle_dir, ckpt.path, None, built=False,
                             pulled_from=result.ref)

    def _pull_key(self, key: BundleKey, target: RegistryRef, model: str | None) -> PullResult:
        with self.store.locks.exclusive(key.id, timeout=self.lock_timeout):
            hit = self._try_hit(key.id, key.relpath, adopt=True, model=model or "")
            if hit is not None:
                info = self.catalog.bundles.require(key.id)
                return PullResult(key.id, str(target), hit, info.size_bytes, 0.0, info, already=True)
            result = self.registry.pull_locked(target, expected=key, model=model)
        self._prune_after_build(key.id)
        return result

    def _push_quietly(self, bid: str) -> None:
        """``--registry-push``: share a bundle just built; a failure is logged, never raised (the
        bundle is built and served either way)."""
        try:
            self.registry.push(bid)
        except (RegistryError, CacheError) as exc:
            log.warning("could not push bundle %s to %s: %s", bid, self.registry.settings.ref, exc)

    def _try_hit(self, bid: str, rel: Path, *, adopt: bool = False, model: str = "") -> Path | None:
        """A ready row whose files pass the quick check is a hit (records it); else None.

        The quick check (every file's size and a sampled hash) runs on every hit: a bundle
        whose bytes changed on disk is marked corrupt here and rebuilt, never served.

        With ``adopt`` (caller holds the exclusive lock), a published directory the catalog does
        not know is verified and adopted instead of rebuilt.
        """
        final = self.layout.root / rel
        info = self.catalog.bundles.get(bid)
        if info is not None and info.state == "stale":
            # Built for another GPU or TensorRT version: ready again if that is back (the
            # reconcile at the next start would say so too); else rebuilt under the lock.
            if self.verifier.stale_reason(info) is not None:
                return None
            info = self.catalog.bundles.set_stale(bid, None)
        if info is not None and info.state == "ready":
            if self.verifier.load_check(bid, final) is not None:
                return None
            self.catalog.bundles.record_hit(bid)
            return final
        if adopt and info is None and (final / "manifest.json").exists():
            try:
                manifest = read_manifest(final)
            except CorruptBundleError:
                return None
            if manifest.bundle_id == bid and verify_bundle(final, manifest).ok:
                self.reconciler.adopt(rel, manifest, model)
                self.catalog.bundles.record_hit(bid)
                return final
        return None

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
        old = self.catalog.bundles.get(bid)
        final = self.layout.root / rel
        if old is not None and old.state in ("corrupt", "stale") and final.exists():
            # Never served: rebuilt in place (a stale bundle's builder says if this GPU cannot).
            self.store.remove(rel)
            self.layout.remove_context(bid)  # KV of the old build is not the new one's
            self.catalog.events.add(
                "evict",
                bundle_id=bid,
                model=old.model,
                reason=old.state,
                nbytes=old.size_bytes,
                detail=old.error,
            )
        what = f"building {model} ({options.name})"
        needed = build_disk_bytes(ckpt.path, options)
        if needed is not None:  # refused before anything is written (the cap is checked after)
            require_free(self.layout.root, needed, what)
        self.catalog.bundles.begin_build(key, model=model)
        log.info("building bundle %s for %s (%s)", bid, model, options.name)
        staging = self.store.new_staging_dir(bid)
        if track is not None:
            track.staging = staging
        started = time.monotonic()
        try:
            progress("build", 0.0)
            engine = builder.build(
                BuildJob(ckpt.path, draft.path if draft else None, options, staging, progress,
                         checkpoint_digest=ckpt.digest)
            )
            progress("publish", 0.95)
            manifest = self.store.publish(
                staging, key, versions=builder.versions(), engine={**engine, "source_model": model}
            )
        except BaseException as exc:
            seconds = time.monotonic() - started
            self.store.remove_staging(staging)
            reason = str(exc) or type(exc).__name__
            self.catalog.bundles.fail_build(bid, error=reason, seconds=seconds)
            log.error("build of %s failed after %.1fs: %s", bid, seconds, reason)
            if isinstance(exc, CacheError) or not isinstance(exc, Exception):
                raise
            full = disk_full(exc, what, self.layout.root)
            if full is not None:
                raise full from exc
            raise BuildError(f"{what} failed: {reason}") from exc
        seconds = time.monotonic() - started
        crash_point("build:published")
        if manifest.size_bytes > self.max_size_bytes:
            self.store.remove(rel)
            self.catalog.bundles.delete(
                bid, reason="lru", nbytes=manifest.size_bytes, detail="larger than the cap"
            )
            raise InsufficientStorageError(
                f"the bundle for {model} needs {human_size(manifest.size_bytes)} but the cache cap is "
                f"{human_size(self.max_size_bytes)}; raise --engine-cache-max-size-gb"
            )
        self.catalog.bundles.finish_build(
            bid, size_bytes=manifest.size_bytes, file_count=manifest.file_count, seconds=seconds
        )
        progress("done", 1.0)
        log.info("built bundle %s in %.1fs (%d bytes)", bid, seconds, manifest.size_bytes)
        return seconds

    def _prune_after_build(self, keep: str) -> None:
        result = self.evictor.prune(self.max_size_bytes, exclude=frozenset({keep}))
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
        info = self.catalog.bundles.require(bid)
        if info.state != "ready":
            raise CorruptBundleError(f"bundle {bid} is {info.state}, not ready; prepare it again")
        lease = self.store.locks.lease(bid, timeout=timeout if timeout is not None else self.lock_timeout)
        # Eviction may have won the race between the catalog read and the lock.
        bundle_dir = self.layout.root / info.path
        if not (bundle_dir / "manifest.json").exists():
            lease.release()
            raise NotFoundError(f"bundle {bid} was evicted before it could be leased; prepare it again")
        try:
            detail = self.verifier.load_check(bid, bundle_dir)
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
            self.catalog.leases.add(bid, os.getpid())
        except BaseException:
            lease.release()  # a catalog outage here must not leave the bundle locked
            raise
        return BundleLease(self.catalog, info, bundle_dir, lease)

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
            verified = self.verifier.verify(result.bundle_id)
            if verified.ok:
                return result, lease
            lease.release()
            if result.built or attempt == 2:
                raise CorruptBundleError(
                    f"bundle {result.bundle_id} does not match its manifest even after a rebuild: "
                    f"{verified.mismatches[:3]}; check the disk"
                )
        raise AssertionError("unreachable")

    # -- admin writes: pins, served names, desired state, event retention ------------------

    def set_pinned(self, bundle_id: str, pinned: bool) -> BundleInfo:
        """Pin (protect from eviction) or unpin this node's bundle ``bundle_id``; a ``pin`` or
        ``unpin`` event when it changes. NotFoundError when this node has no such bundle."""
        return self.catalog.bundles.set_pinned(bundle_id, pinned)

    def set_alias(self, name: str, *, bundle_id: str | None = None, model: str | None = None) -> AliasInfo:
        """Serve ``name`` from a bundle, or a checkpoint (its last used ready bundle), in the catalog."""
        if not name.strip() or name.strip() != name:
            raise ConfigError("name", f"must be a non-blank name, got {name!r}")
        if bundle_id is not None:
            self.catalog.bundles.require(bundle_id)
        elif model is not None and not self.catalog.bundles.page(model=model, node=self.node, limit=1).items:
            raise NotFoundError(
                f"no bundle of {model!r} is in the catalog; build it first (POST /admin/builds)"
            )
        return self.catalog.aliases.set(name, bundle_id=bundle_id, model=model)

    def remove_alias(self, name: str) -> None:
        """Stop serving ``name`` (NotFoundError when there is no such alias).

        Deliberately without ``set_alias``'s name check: a name that could never have been set
        is simply not found (a 404, not a 400; the CLI's message says so), as it always was."""
        self.catalog.aliases.remove(name)

    def set_desired(self, node: str, spec: DesiredSpec) -> DesiredState:
        """Store the desired state of ``node`` (``*``: the fleet default), its generation bumped;
        each node's agent converges on it. ``spec`` was checked where it was read (the model
        names against ``--allowed-model-roots``, each profile like ``POST /admin/builds``)."""
        return self.fleet.set_desired(node, spec)

    def clear_desired(self, node: str) -> None:
        """Forget the desired state of ``node`` (it follows the fleet default again);
        NotFoundError when none is stored."""
        self.fleet.clear_desired(node)

    def apply_event_retention(self, *, max_age_days: float, max_rows: int) -> int:
        """Drop this node's events past the retention (0 disables a limit; the running totals
        behind stats stay); how many went."""
        return self.catalog.events.apply_retention(max_age_days=max_age_days, max_rows=max_rows)

    def record_event(self, kind: str, **fields: Any) -> None:
        """Append an event this node's serving saw (``load``, ``unload``) to the audit log."""
        self.catalog.events.add(kind, **fields)

    @property
    def node(self) -> str:
        """This process's node name (on every bundle, lease and event row it writes)."""
        return self.catalog.node

    # -- background builds -----------------------------------------------------------------

    def start_build(
        self,
        model: str,
        request: ProfileRequest | None = None,
        *,
        allowed_roots: tuple[Path, ...] | None = None,
    ) -> BuildStatus:
        """Queue a build in the background (the same model and profile join the running build),
        after the checks that need no resolving (400s, not 202s that fail later; ``allowed_roots``:
        ``--allowed-model-roots``)."""
        request = request or ProfileRequest()
        backend = resolve_backend(request.backend, self.builders, gpu_disabled=self.gpu_disabled)
        resolve_precision(request.precision, backend)
        for name, value in (("model", model), ("draft_model", request.draft_model)):
            if value is not None:
                check_model_name(name, value, allowed_roots)
        local = Path(model).expanduser()
        if local.is_dir():  # a local checkpoint: image limits that cannot fit it are a 400 now
            check_image_limits(local, request.max_image_tokens, request.max_image_tokens_per_image)
        # A build is refused up front when the catalog cannot take a write now, instead of
        # being accepted and then failing.
        self.catalog.ping()
        self._check_known_build_fits(model, request)
        return self.builds.start(model, request)

    def _check_known_build_fits(self, model: str, request: ProfileRequest) -> None:
        """The free-space check of a build, before it is queued, when it needs no resolving:
        the checkpoints are in the catalog and the bundle is not there yet (a model never
        resolved here is checked by the build itself, as soon as it is resolved)."""
        try:
            digest, options, path = self._known_build(model, request)
        except NotFoundError:
            return
        info = self.catalog.bundles.get(BundleKey.of(digest, options).id)
        if info is not None and info.state == "ready":
            return
        needed = build_disk_bytes(path, options)
        if needed is not None:
            require_free(self.layout.root, needed, f"building {model} ({options.name})")

    def add_adapter(self, source: str, base: str, *, allowed_roots: tuple[Path, ...] | None = None,
                    known_base: bool = False) -> AdapterInfo:
        """Convert the LoRA adapter ``source`` into the cache for the base model ``base`` (a
        checkpoint directory or hub id, resolved and recorded like any model); a hit when it is
        there. With ``allowed_roots`` (the HTTP surface), local paths must lie under them; with
        ``known_base`` (the HTTP surface too) the base must be a checkpoint in the catalog
        already (NotFoundError otherwise: it is not hashed or downloaded for the request)."""
        check_model_name("base", base, allowed_roots)
        check_adapter_source("source", source, allowed_roots)
        base_dir = self._known_checkpoint("base", base)[1] if known_base else self.resolve(base).path
        return self.adapters.prepare(source, base_dir)

    def remove_checkpoint(self, ref: str, *, with_bundles: bool = False, by_path: bool = True
                          ) -> CheckpointRemoval:
        """Remove the checkpoint ``ref`` names (see ``CacheQueries.find_checkpoint``) with, when
        ``with_bundles``, this node's bundles of it (see ``Evictor.remove_checkpoint``)."""
        ckpt = self.queries.find_checkpoint(ref, by_path=by_path)
        return self.evictor.remove_checkpoint(ckpt, with_bundles=with_bundles)
