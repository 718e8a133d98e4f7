"""msgspec Structs for every admin request and response body.

These types are the HTTP contract: the OpenAPI schema is generated from them, so every field
carries its real type and constraints. Records from ``cachesvc.cache.records`` are turned into these
with :func:`to_body`, which keeps internal-only fields (such as the raw build durations behind
the stats) out of the responses.
"""

from __future__ import annotations

from datetime import datetime
from typing import Annotated, Any, Literal, TypeVar, get_args

import msgspec
from msgspec import Meta, Struct

from cachesvc.cache.records import (
    BUILD_STATES,
    BUNDLE_STATES,
    EVENT_KINDS,
    EVICT_REASONS,
    EVICTION_KINDS,
    SKIP_REASONS,
    SORT_KEYS,
    SORT_ORDERS,
)
from inference.build_profile import (
    DEFAULT_MAX_BATCH_SIZE,
    DEFAULT_MAX_INPUT_LEN,
    DEFAULT_MAX_KV_CACHE_CAPACITY,
    MAX_BATCH_SIZE_LIMIT,
    MAX_TOKENS_LIMIT,
)

BundleState = Literal["building", "ready", "failed", "corrupt", "stale"]
EventKind = Literal[
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
    "checkpoint_rm",
    "adapter_add",
    "adapter_rm",
    "adapter_pin",
    "adapter_unpin",
    "pull",
    "push",
]
EvictReason = Literal["lru", "manual", "clear", "stale", "corrupt"]
BuildState = Literal["queued", "running", "done", "failed"]
BackendName = Literal["onnxruntime", "tensorrt"]
SortKey = Literal["last_used", "size", "created", "hits"]
SortOrder = Literal["asc", "desc"]
SkipReason = Literal["pinned", "leased"]
#: What an eviction plan item is: a bundle or a converted LoRA adapter.
EvictionKind = Literal["bundle", "adapter"]

# Literals above must stay in step with the record vocabularies; a drift would make the schema lie.
assert get_args(BundleState) == BUNDLE_STATES
assert get_args(EventKind) == EVENT_KINDS
assert get_args(EvictReason) == EVICT_REASONS
assert get_args(EvictionKind) == EVICTION_KINDS
assert get_args(BuildState) == BUILD_STATES
assert get_args(SortKey) == SORT_KEYS
assert get_args(SortOrder) == SORT_ORDERS
assert get_args(SkipReason) == SKIP_REASONS

# The Literals below are written out because type checkers need literal text; a unit test
# (tests/service/test_registries.py) asserts they equal the registries in inference.build_profile.
BackendChoice = Literal["auto", "onnxruntime", "tensorrt"]
PrecisionChoice = Literal["auto", "fp32", "fp16", "bf16", "int8", "int4"]
SpeculativeMethod = Literal["eagle3", "mtp", "dflash", "jetspec", "dspark", "ngram", "draft_model"]
Task = Literal["generate", "embed"]
Pooling = Literal["last", "mean"]
KernelsChoice = Literal["auto", "exact", "fast"]
KvCacheDtype = Literal["fp32", "fp16"]

PositiveDim = Annotated[int, Meta(ge=1, le=MAX_TOKENS_LIMIT)]
BatchSize = Annotated[int, Meta(ge=1, le=MAX_BATCH_SIZE_LIMIT)]
Model = Annotated[
    str,
    Meta(
        min_length=1,
        max_length=1024,
        description=(
            "Hugging Face model id (org/name[@revision]), a local checkpoint directory, a .gguf file, "
            "or a hub GGUF file as org/name/FILE.gguf"
        ),
    ),
]


class ProfileOut(Struct, frozen=True):
    """A resolved build profile (every option that changes the artefact)."""

    backend: str
    precision: str
    max_input_len: int
    max_batch_size: int
    max_kv_cache_capacity: int
    speculative_method: str | None = None
    draft_digest: str | None = None
    builder_version: str = ""
    device_arch: str | None = None
    #: The CPU class an int8/int4 CPU bundle was built for (its kernels depend on it).
    cpu_class: str | None = None


class BundleOut(Struct, frozen=True):
    """One bundle as the catalog knows it."""

    id: str
    model: str
    checkpoint_digest: str
    draft_digest: str | None
    profile: ProfileOut
    profile_name: str
    backend: str
    path: str
    size_bytes: int
    file_count: int
    state: BundleState
    created_at: datetime
    built_at: datetime | None
    build_seconds: float | None
    last_used_at: datetime | None
    hit_count: int
    pinned: bool
    last_verified_at: datetime | None
    error: str | None
    node: str
    #: the model's served name: an alias naming it, else its hub id, else its path's last
    #: component (``model`` keeps the path)
    model_name: str = ""


class BundleListOut(Struct, frozen=True):
    """One page of bundles, with totals over every bundle that matches the filters."""

    items: list[BundleOut]
    total: int
    total_bytes: int
    limit: int
    next_cursor: str | None
    next_offset: int | None


class LeaseHolderOut(Struct, frozen=True):
    """A process holding a shared lease (display only; the file lock is the truth)."""

    pid: int
    host: str
    since: str


class EventOut(Struct, frozen=True):
    """One row of the append-only audit log."""

    id: int
    at: datetime
    kind: EventKind
    bundle_id: str | None
    checkpoint_digest: str | None
    model: str | None
    reason: str | None
    bytes: int | None
    seconds: float | None
    detail: str | None
    node: str


class EventListOut(Struct, frozen=True):
    """Audit-log events, newest first."""

    items: list[EventOut]


class BundleFileOut(Struct, frozen=True):
    """One component file of a bundle, from its manifest."""

    path: str
    size: int
    sha256: str


class ManifestSummaryOut(Struct, frozen=True):
    """What a bundle's ``manifest.json`` says, without the file list."""

    layout_version: int
    bundle_id: str
    checkpoint_digest: str
    draft_digest: str | None
    backend: str
    versions: dict[str, str]
    engine: dict[str, Any]
    created_at: str
    size_bytes: int
    file_count: int


class BundleDetailOut(Struct, frozen=True):
    """One bundle with its manifest summary, files, lease holders and recent events.

    ``manifest`` is null when the bundle directory has no readable manifest (e.g. it is still
    being built, or it is corrupt).
    """

    bundle: BundleOut
    manifest: ManifestSummaryOut | None
    files: list[BundleFileOut]
    holders: list[LeaseHolderOut]
    events: list[EventOut]


class RemoveOut(Struct, frozen=True):
    """Result of evicting one bundle."""

    bundle_id: str
    freed_bytes: int


class MismatchOut(Struct, frozen=True):
    """A file whose bytes do not match the manifest, and how."""

    path: str
    reason: str


class VerifyOut(Struct, frozen=True):
    """Outcome of re-hashing a bundle against its manifest."""

    bundle_id: str
    ok: bool
    files_checked: int
    bytes_checked: int
    mismatches: list[MismatchOut]
    state: BundleState


class BuildRequest(Struct, frozen=True, forbid_unknown_fields=True):
    """Ask for a bundle to be built ahead of time (model + build profile)."""

    model: Model
    backend: BackendChoice = "auto"
    precision: PrecisionChoice = "auto"
    max_input_len: PositiveDim = DEFAULT_MAX_INPUT_LEN
    max_batch_size: BatchSize = DEFAULT_MAX_BATCH_SIZE
    max_kv_cache_capacity: PositiveDim = DEFAULT_MAX_KV_CACHE_CAPACITY
    speculative_method: SpeculativeMethod | None = None
    draft_model: Annotated[str, Meta(min_length=1, max_length=1024)] | None = None
    #: ``embed``: an embedding bundle (fp32; ``pooling`` last by default, or mean).
    task: Task = "generate"
    pooling: Pooling | None = None
    #: LoRA inputs in the graph, so that adapters can be loaded into it (``--enable-lora``).
    lora: bool = False
    #: int8/int4 on the CPU: how the quality gate picks the kernels (``--kernels``).
    kernels: KernelsChoice = "auto"
    #: The KV cache's element type on the CPU (``--kv-cache-dtype``): fp16 halves its memory.
    kv_cache_dtype: KvCacheDtype = "fp32"
    #: A vision-language checkpoint's image tokens per request and per image
    #: (``--max-image-tokens``, ``--max-image-tokens-per-image``; null: the model's).
    max_image_tokens: PositiveDim | None = None
    max_image_tokens_per_image: PositiveDim | None = None


class PullRequest(BuildRequest, frozen=True, forbid_unknown_fields=True):
    """Pull the bundle of a model and build profile from the OCI registry (no build)."""

    #: ``oci://host[:port]/namespace`` (default: the server's ``--registry``), or one tag in it.
    ref: Annotated[str, Meta(min_length=1, max_length=1024)] | None = None


class PushOut(Struct, frozen=True):
    """What a push uploaded, where, under which tags."""

    bundle_id: str
    ref: str
    tags: list[str]
    digest: str
    blobs_uploaded: int
    blobs_skipped: int
    bytes_uploaded: int


class BuildOut(Struct, frozen=True):
    """Progress and state of a background build."""

    id: str
    bundle_id: str
    model: str
    profile: dict[str, Any]
    state: BuildState
    stage: str
    progress: Annotated[float, Meta(ge=0.0, le=1.0)]
    started_at: datetime | None
    finished_at: datetime | None
    elapsed_seconds: float
    bytes_written: int
    error: str | None
    built: bool | None = None


class BuildListOut(Struct, frozen=True):
    """Every build this process knows about."""

    items: list[BuildOut]


class PruneRequest(Struct, frozen=True, forbid_unknown_fields=True):
    """Evict least-recently-used idle bundles until the cache fits ``max_size_bytes``."""

    # gt=-1 rather than ge=0: Litestar 2.25 drops a falsy bound (0) from the OpenAPI schema.
    max_size_bytes: Annotated[int, Meta(gt=-1, le=2**62)] | None = None
    dry_run: bool = False
    #: Unload this server's idle engines of bundles the plan would otherwise skip as leased.
    unload_idle: bool = False


class ClearRequest(Struct, frozen=True, forbid_unknown_fields=True):
    """Remove every idle bundle (checkpoints stay)."""

    dry_run: bool = False


class PlannedEvictionOut(Struct, frozen=True):
    """A bundle an eviction plan removes, and why (``stale`` bundles are planned first);
    ``kind`` ``adapter``: a converted LoRA adapter, its id in ``bundle_id``."""

    bundle_id: str
    size_bytes: int
    last_used_at: datetime | None
    reason: EvictReason = "lru"
    kind: EvictionKind = "bundle"


class SkippedOut(Struct, frozen=True):
    """A bundle an eviction leaves in place, and why; ``stale`` when it cannot run on this node
    (a pinned stale bundle stays: pins are the operator's word)."""

    bundle_id: str
    size_bytes: int
    reason: SkipReason
    stale: bool = False
    kind: EvictionKind = "bundle"


class EvictionOut(Struct, frozen=True):
    """An eviction plan (``dry_run``) or what executing it did."""

    dry_run: bool
    reason: EvictReason
    max_bytes: int | None
    total_before: int
    planned: list[PlannedEvictionOut]
    evicted: list[str]
    skipped: list[SkippedOut]
    freed_bytes: int
    total_after: int


class ReconcileOut(Struct, frozen=True):
    """What a reconcile of catalog and disk changed."""

    adopted: list[str]
    forgotten: list[str]
    staging_removed: list[str]
    corrupt: list[str]
    #: Bundles flagged ``stale``: built for another GPU or TensorRT version than this node's.
    stale: list[str] = []
    #: Stale bundles whose GPU and TensorRT version are back (``ready`` again).
    restored: list[str] = []
    #: LoRA adapter rows whose converted file vanished, and converted files without a row.
    adapters_forgotten: list[str] = []
    adapter_files_removed: list[str] = []


class ModelStatsOut(Struct, frozen=True):
    """Per-model slice of the cache stats."""

    model: str
    bundles: int
    size_bytes: int
    hits: int
    misses: int
    model_name: str = ""  #: the served name (as BundleOut's)


class StatsOut(Struct, frozen=True):
    """Cache statistics computed from the catalog's events (they survive restarts)."""

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
    per_model: list[ModelStatsOut]
    since: datetime | None
    checkpoint_bytes: int = 0
    #: Bundles pulled from the OCI registry (no build) and the bytes moved; pushes likewise.
    pulls: int = 0
    pulled_bytes: int = 0
    pushes: int = 0
    pushed_bytes: int = 0


class CheckpointOut(Struct, frozen=True):
    """A resolved checkpoint and the bundles built from it."""

    digest: str
    source: str
    path: str
    size_bytes: int
    file_count: int
    resolved_at: datetime
    bundle_ids: list[str]


class CheckpointListOut(Struct, frozen=True):
    """Every resolved checkpoint."""

    items: list[CheckpointOut]


class AdapterRequest(Struct, frozen=True, forbid_unknown_fields=True):
    """Convert a PEFT LoRA adapter into the cache for a base model."""

    #: A PEFT adapter directory (adapter_config.json + adapter_model.safetensors) or a hub id.
    source: Annotated[str, Meta(min_length=1, max_length=1024)]
    #: The base model (checkpoint directory or hub id) the adapter is checked against.
    base: Model


class AdapterOut(Struct, frozen=True):
    """A LoRA adapter converted into the cache (``path``: the converted file)."""

    id: str
    digest: str
    source: str
    path: str
    rank: int
    targets: list[str]
    size_bytes: int
    pinned: bool
    created_at: datetime
    last_used_at: datetime
    node: str


class AdapterListOut(Struct, frozen=True):
    """This node's converted LoRA adapters, most recently used first."""

    items: list[AdapterOut]


class AdapterRemovalOut(Struct, frozen=True):
    """An adapter removed from the cache."""

    id: str
    freed_bytes: int


class CheckpointRemovalOut(Struct, frozen=True):
    """What removing a checkpoint did: its row is gone; ``files_deleted`` says whether its files
    were the cache's own and deleted (else only forgotten); bundles removed with it."""

    digest: str
    source: str
    path: str
    bundles_removed: list[str]
    bundle_bytes: int
    files_deleted: bool
    file_bytes: int


class Problem(Struct, frozen=True, omit_defaults=True):
    """Problem-style error body (RFC 9457 shape): what went wrong and what to fix.

    ``field`` names the bad request field; ``reason`` and ``holders`` say why a bundle is busy.
    """

    type: str
    title: str
    status: int
    detail: str
    field: str | None = None
    reason: str | None = None
    holders: list[LeaseHolderOut] | None = None


S = TypeVar("S", bound=Struct)


def _encode_extra(value: Any) -> Any:
    # Paths are the only non-builtin leaves in the records; render them as strings.
    return str(value)


def to_body(record: Any, body_type: type[S], **extra: Any) -> S:
    """Convert a ``cachesvc.cache.records`` value (or a dict of them) into a response Struct.

    ``extra`` adds or overrides top-level fields (e.g. the page ``limit`` a record lacks).
    """
    builtins = msgspec.to_builtins(record, enc_hook=_encode_extra, builtin_types=(datetime,))
    if extra:
        builtins = {
            **builtins,
            **msgspec.to_builtins(extra, enc_hook=_encode_extra, builtin_types=(datetime,)),
        }
    return msgspec.convert(builtins, body_type)
