"""Value objects the CacheManager hands out (ORM rows never leave the catalog package).

Every record is a frozen dataclass; timestamps are timezone-aware UTC datetimes.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any

#: ``stale``: built for another GPU (compute capability) or TensorRT version than this node has
#: now (or it has none): never loaded, evicted first, ``ready`` again when the environment is back.
BUNDLE_STATES = ("building", "ready", "failed", "corrupt", "stale")
EVENT_KINDS = (
    "hit",
    "miss",
    "build_ok",
    "build_failed",
    "evict",
    "verify",
    "pin",
    "unpin",
    "reconcile",
    "load",
    "unload",
    # A checkpoint removed (``cachesvc checkpoints rm``): its row, and its files when ours.
    "checkpoint_rm",
    # A LoRA adapter converted into the cache, and one removed (``reason``: an EVICT_REASONS
    # value: ``manual``, ``lru``/``clear`` by eviction, ``stale`` when reconcile found its file gone).
    "adapter_add",
    "adapter_rm",
    "adapter_pin",
    "adapter_unpin",
    # A bundle pulled from an OCI registry instead of built (``detail``: the registry reference,
    # ``bytes`` moved), and one pushed to a registry (``bytes``: the blobs uploaded).
    "pull",
    "push",
)
#: Why a serving process unloaded an engine (the ``reason`` of ``unload`` events).
UNLOAD_REASONS = ("idle", "memory", "admin", "evict", "shutdown")
#: ``stale``: a row whose directory vanished (reconcile), or a ``stale`` bundle (planned first).
EVICT_REASONS = ("lru", "manual", "clear", "stale", "corrupt")
BUILD_STATES = ("queued", "running", "done", "failed")
#: Why a planned eviction left a bundle alone.
SKIP_REASONS = ("pinned", "leased")
#: Bundle listing sort keys (the catalog maps each to a column) and orders.
SORT_KEYS = ("last_used", "size", "created", "hits")
SORT_ORDERS = ("asc", "desc")

#: Upper bounds (seconds) of the build-duration histogram the catalog keeps as running totals.
#: Changing them starts new series; counts under the old bounds stay in the catalog unread.
BUILD_SECONDS_BUCKETS: tuple[float, ...] = (1, 2.5, 5, 10, 30, 60, 120, 300, 600, 1200, 1800, 3600)


@dataclass(frozen=True)
class BundleInfo:
    """One bundle as the catalog knows it."""

    id: str
    model: str
    checkpoint_digest: str
    draft_digest: str | None
    profile: dict[str, Any]
    profile_name: str
    backend: str
    path: Path
    size_bytes: int
    file_count: int
    state: str
    created_at: datetime
    built_at: datetime | None
    build_seconds: float | None
    last_used_at: datetime | None
    hit_count: int
    pinned: bool
    last_verified_at: datetime | None
    error: str | None
    node: str


@dataclass(frozen=True)
class AliasInfo:
    """A served model name an operator gave a bundle or a checkpoint."""

    name: str
    bundle_id: str | None
    model: str | None
    created_at: datetime


@dataclass(frozen=True)
class LeaseHolder:
    """A process that holds a shared lease on a bundle (display only; the file lock is the truth)."""

    pid: int
    host: str
    since: str


@dataclass(frozen=True)
class CheckpointInfo:
    """A resolved checkpoint."""

    digest: str
    source: str
    path: Path
    size_bytes: int
    file_count: int
    resolved_at: datetime
    bundle_ids: tuple[str, ...] = ()


@dataclass(frozen=True)
class CheckpointRemoval:
    """What ``checkpoints rm`` did: the catalog row is gone; files only when they were ours."""

    digest: str
    source: str
    path: Path
    #: This node's bundles of the checkpoint removed with it (``with_bundles``), and their bytes.
    bundles_removed: tuple[str, ...]
    bundle_bytes: int
    #: True when the files were the cache's own (downloaded or converted under ``checkpoints/``)
    #: and were deleted; False when the checkpoint was only forgotten (a user's directory).
    files_deleted: bool
    file_bytes: int


@dataclass(frozen=True)
class EventInfo:
    """One row of the append-only audit log."""

    id: int
    at: datetime
    kind: str
    bundle_id: str | None
    checkpoint_digest: str | None
    model: str | None
    reason: str | None
    bytes: int | None
    seconds: float | None
    detail: str | None
    node: str


@dataclass(frozen=True)
class PrepareResult:
    """What ``CacheManager.prepare`` returns."""

    bundle_id: str
    bundle_dir: Path
    model_dir: Path
    draft_dir: Path | None
    built: bool
    build_seconds: float | None = None
    #: Pulled from the OCI registry (``pulled_from``: its reference) instead of built.
    pulled_from: str | None = None
    # speculative method draft_model: the draft checkpoint's own bundle (same profile, no speculation)
    draft_bundle_id: str | None = None
    draft_bundle_dir: Path | None = None


#: What an eviction plan item is: a bundle, or a converted LoRA adapter (its id in ``bundle_id``).
EVICTION_KINDS = ("bundle", "adapter")


@dataclass(frozen=True)
class AdapterInfo:
    """A LoRA adapter converted into the cache (one row per node: the file is on its disk).

    ``path`` is the absolute path of the converted file (onnxruntime's adapter format), what an
    engine loads; the catalog keeps it relative to the cache root."""

    id: str
    digest: str
    source: str
    path: Path
    rank: int
    targets: tuple[str, ...]
    size_bytes: int
    pinned: bool
    created_at: datetime
    last_used_at: datetime
    node: str


@dataclass(frozen=True)
class SkippedBundle:
    """A bundle an eviction plan leaves in place, and why (``pinned`` or ``leased``); ``stale``
    when it cannot run here (a pinned stale bundle stays: pins are the operator's word).
    ``kind`` ``adapter``: a converted LoRA adapter (its id in ``bundle_id``)."""

    bundle_id: str
    size_bytes: int
    reason: str
    stale: bool = False
    kind: str = "bundle"


@dataclass(frozen=True)
class PlannedEviction:
    """A bundle an eviction plan removes, and why: ``stale`` (planned first), else the plan's
    reason (``lru`` or ``clear``)."""

    bundle_id: str
    size_bytes: int
    last_used_at: datetime | None
    path: Path
    reason: str = "lru"
    kind: str = "bundle"


@dataclass(frozen=True)
class EvictionPlan:
    """A dry-run plan: what goes (stale bundles first, then LRU order), what stays and why, and
    the bytes freed."""

    max_bytes: int | None
    total_before: int
    evict: tuple[PlannedEviction, ...]
    skipped: tuple[SkippedBundle, ...]
    freed_bytes: int
    total_after: int
    reason: str = "lru"


@dataclass(frozen=True)
class EvictionResult:
    """What executing a plan did (a bundle leased in between is skipped, not deleted)."""

    plan: EvictionPlan
    evicted: tuple[str, ...]
    skipped: tuple[SkippedBundle, ...]
    freed_bytes: int
    total_after: int
    dry_run: bool


@dataclass(frozen=True)
class VerifyResult:
    """Outcome of re-hashing a bundle against its manifest."""

    bundle_id: str
    ok: bool
    files_checked: int
    bytes_checked: int
    mismatches: tuple[dict[str, str], ...]
    state: str


@dataclass(frozen=True)
class ReconcileReport:
    """What a reconcile changed."""

    adopted: tuple[str, ...]
    forgotten: tuple[str, ...]
    staging_removed: tuple[str, ...]
    corrupt: tuple[str, ...] = ()
    #: Ready bundles marked ``stale`` (built for another GPU or TensorRT version than this node's).
    stale: tuple[str, ...] = ()
    #: Stale bundles whose GPU and TensorRT version are back: ``ready`` again.
    restored: tuple[str, ...] = ()
    #: Adapter rows whose converted file vanished (forgotten), and converted adapter
    #: directories without a row (removed).
    adapters_forgotten: tuple[str, ...] = ()
    adapter_files_removed: tuple[str, ...] = ()


@dataclass(frozen=True)
class BuildStatus:
    """Progress of a background build (admin API)."""

    id: str
    bundle_id: str
    model: str
    profile: dict[str, Any]
    state: str  # queued | running | done | failed
    stage: str
    progress: float
    started_at: datetime | None
    finished_at: datetime | None
    elapsed_seconds: float
    bytes_written: int
    error: str | None
    built: bool | None = None


@dataclass(frozen=True)
class ModelStats:
    """Per-model slice of the cache stats."""

    model: str
    bundles: int
    size_bytes: int
    hits: int
    misses: int
    model_name: str = ""  #: the served name (:mod:`cachesvc.cache.model_names`), filled by the queries


@dataclass(frozen=True)
class CacheStats:
    """Cache statistics computed from the catalog (they survive restarts)."""

    size_bytes: int
    max_size_bytes: int
    bundles: int
    bundles_by_state: dict[str, int]
    checkpoints: int
    hits: int
    misses: int
    hit_rate: float | None
    builds_ok: int
    builds_failed: int
    median_build_seconds: float | None
    evictions_by_reason: dict[str, int]
    evicted_bytes_by_reason: dict[str, int]
    per_model: tuple[ModelStats, ...]
    since: datetime | None
    #: Cumulative ``(upper_bound, count)`` pairs over BUILD_SECONDS_BUCKETS, then ``(inf, total)``.
    build_buckets: tuple[tuple[float, int], ...] = field(default=(), repr=False)
    build_seconds_sum: float = 0.0
    #: Bytes under the cache's ``checkpoints/`` (downloads, GGUF conversions and any leftovers
    #: of a conversion that did not finish); counted on disk, so only for the answering node.
    checkpoint_bytes: int = 0
    #: Bundles pulled from the OCI registry instead of built, and the bytes they moved; bundles
    #: pushed and the bytes uploaded (blobs the registry had are not counted).
    pulls: int = 0
    pulled_bytes: int = 0
    pushes: int = 0
    pushed_bytes: int = 0


@dataclass(frozen=True)
class BundlePage:
    """One page of a bundle listing, with totals over every matching bundle."""

    items: tuple[BundleInfo, ...]
    total: int
    total_bytes: int
    next_cursor: str | None
    next_offset: int | None


@dataclass(frozen=True)
class BundleDetail:
    """One bundle with its manifest summary, files, current lease holders and recent events."""

    bundle: BundleInfo
    manifest: dict[str, Any] | None
    files: tuple[dict[str, Any], ...]
    holders: tuple[LeaseHolder, ...]
    events: tuple[EventInfo, ...]


@dataclass(frozen=True)
class CatalogState:
    """What ``/health`` shows of the catalog."""

    available: bool
    backend: str
    reason: str | None = None
    since: datetime | None = None
    failures: int = 0

    def to_dict(self) -> dict[str, object]:
        """The JSON form (``/health`` ``catalog``)."""
        status = "ok" if self.available else "unavailable"
        body: dict[str, object] = {"status": status, "backend": self.backend}
        if not self.available:
            body["reason"] = self.reason
            body["since"] = self.since.isoformat() if self.since else None
            body["failed_operations"] = self.failures
        return body
