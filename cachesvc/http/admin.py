"""Admin REST controllers (mounted at ``/admin``): thin wrappers over ``CacheManager``.

Every handler runs in a worker thread (``sync_to_thread=True``): manager calls block on SQLite,
hashing, file locks and deletes. Validation lives in the Structs and parameter constraints,
domain rules in the manager, and the HTTP mapping of errors in ``cachesvc.http.errors``.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Hashable, Mapping
from datetime import UTC, datetime
from pathlib import Path
from typing import Annotated

import anyio
import msgspec
from litestar import Controller, Request, Router, delete, get, post, put
from litestar.di import NamedDependency, Provide
from litestar.exceptions import ClientException
from litestar.params import Body, PathParameter, QueryParameter

from cachesvc.http.auth import admin_guard
from cachesvc.http.errors import admin_exception_handlers, problem_responses
from cachesvc.http.fleet import FLEET_HANDLERS
from cachesvc.http.schemas import (
    AdapterListOut,
    AdapterOut,
    AdapterRemovalOut,
    AdapterRequest,
    BackendName,
    BuildListOut,
    BuildOut,
    BuildRequest,
    BundleDetailOut,
    BundleListOut,
    BundleOut,
    BundleState,
    CheckpointListOut,
    CheckpointRemovalOut,
    ClearRequest,
    EventKind,
    EventListOut,
    EvictionOut,
    PruneRequest,
    PullRequest,
    PushOut,
    ReconcileOut,
    RemoveOut,
    SortKey,
    SortOrder,
    StatsOut,
    VerifyOut,
    to_body,
)
from cachesvc.manager import CacheManager
from cachesvc.profiles import ProfileRequest
from cachesvc.records import EvictionResult
from inference.model_pool import ModelPool
from inference.openai.body_checks import LARGE_BODY_BYTES, has_body, json_body_problem

Manager = NamedDependency[CacheManager]
#: This server's model pool (engines loaded here); ``unload_idle`` unloads through it.
Pool = NamedDependency[ModelPool]
#: Where local checkpoints named over HTTP may lie (``--allowed-model-roots``); None: anywhere.
ModelRoots = NamedDependency[tuple[Path, ...] | None]

BUNDLE_ID_PATTERN = r"^[0-9a-f]{16}-[0-9a-f]{12}$"
BundleId = Annotated[
    str,
    PathParameter(
        pattern=BUNDLE_ID_PATTERN,
        description="Bundle id: <model-digest16>-<profile-digest12> (lowercase hex)",
    ),
]
BuildId = Annotated[
    str, PathParameter(min_length=1, max_length=128, description="Build id from POST /admin/builds")
]
PullId = Annotated[
    str, PathParameter(min_length=1, max_length=128, description="Pull id from POST /admin/pulls")
]
Limit = Annotated[int, QueryParameter(ge=1, le=1000, description="Page size (1-1000)")]
NodeFilter = Annotated[
    str | None, QueryParameter(min_length=1, max_length=255, description="Only this node's rows (fleet)")
]
#: The request Structs forbid unknown fields (a typo such as ``dryrun`` must not turn a dry run
#: into a real clear); say so in the schema, which Litestar does not derive from the Struct.
StrictBody = Body(schema_extra={"additionalProperties": False})


def _utc(moment: datetime | None) -> datetime | None:
    # A naive timestamp in a query is read as UTC, the catalog's only timezone.
    if moment is None or moment.tzinfo is not None:
        return moment
    return moment.replace(tzinfo=UTC)


def _eviction_body(result: EvictionResult) -> EvictionOut:
    plan = result.plan
    return to_body(
        {
            "dry_run": result.dry_run,
            "reason": plan.reason,
            "max_bytes": plan.max_bytes,
            "total_before": plan.total_before,
            "planned": plan.evict,
            "evicted": result.evicted,
            "skipped": result.skipped,
            "freed_bytes": result.freed_bytes,
            "total_after": result.total_after,
        },
        EvictionOut,
    )


class _PageCache:
    """A small thread-safe LRU of listing pages keyed by (manager, catalog version, query)."""

    def __init__(self, size: int = 128) -> None:
        self._size = size
        self._items: OrderedDict[Hashable, BundleListOut] = OrderedDict()
        self._lock = threading.Lock()

    def get(self, key: Hashable) -> BundleListOut | None:
        with self._lock:
            value = self._items.get(key)
            if value is not None:
                self._items.move_to_end(key)
            return value

    def put(self, key: Hashable, value: BundleListOut) -> None:
        with self._lock:
            self._items[key] = value
            self._items.move_to_end(key)
            while len(self._items) > self._size:
                self._items.popitem(last=False)


_LIST_CACHE = _PageCache()


class BundleController(Controller):
    """``/admin/bundles``: list, inspect, evict, pin and verify bundles."""

    path = "/bundles"
    tags = ["bundles"]

    @get("/", operation_id="listBundles", responses=problem_responses(400))
    async def list_bundles(
        self,
        manager: Manager,
        model: Annotated[
            str | None,
            QueryParameter(min_length=1, max_length=1024, description="Only bundles of this model"),
        ] = None,
        # "state" is a reserved Litestar kwarg: the Python name differs, the query name does not.
        bundle_state: Annotated[
            BundleState | None, QueryParameter(name="state", description="Only bundles in this state")
        ] = None,
        backend: Annotated[
            BackendName | None, QueryParameter(description="Only bundles of this backend")
        ] = None,
        pinned: Annotated[
            bool | None, QueryParameter(description="Only pinned (true) or unpinned (false)")
        ] = None,
        sort: Annotated[SortKey, QueryParameter(description="Sort key")] = "last_used",
        order: Annotated[SortOrder, QueryParameter(description="Sort order")] = "desc",
        limit: Limit = 50,
        offset: Annotated[
            int | None,
            # schema_extra: Litestar 2.25 drops a falsy bound (ge=0) from the OpenAPI schema.
            QueryParameter(
                ge=0, le=2**31, schema_extra={"minimum": 0}, description="Skip this many (instead of cursor)"
            ),
        ] = None,
        cursor: Annotated[
            str | None,
            QueryParameter(
                min_length=1,
                max_length=512,
                description="next_cursor of the previous page (same sort; not together with offset)",
            ),
        ] = None,
        node: NodeFilter = None,
    ) -> BundleListOut:
        """List bundles with filters, sort and pagination; totals cover every match (every node's)."""
        params = (model, bundle_state, backend, pinned, sort, order, limit, offset, cursor, node)
        # Dashboards poll the same pages: answer from memory until the catalog changes. The
        # version read is one indexed aggregate over a tiny table, cheap enough for the event
        # loop; a miss (a real listing) goes to a worker thread.
        key = (id(manager), manager.catalog.events.version(), params)
        cached = _LIST_CACHE.get(key)
        if cached is not None:
            return cached

        def load() -> BundleListOut:
            page = manager.queries.list_bundles(
                model=model,
                state=bundle_state,
                backend=backend,
                pinned=pinned,
                sort=sort,
                order=order,
                limit=limit,
                offset=offset,
                cursor=cursor,
                node=node,
            )
            body = to_body(page, BundleListOut, limit=limit)
            labels = manager.queries.model_labels({b.model for b in body.items})
            return msgspec.structs.replace(body, items=[named(b, labels) for b in body.items])

        body = await anyio.to_thread.run_sync(load)
        _LIST_CACHE.put(key, body)
        return body

    @get(
        "/{bundle_id:str}",
        sync_to_thread=True,
        operation_id="getBundle",
        responses=problem_responses(400, 404),
    )
    def get_bundle(self, manager: Manager, bundle_id: BundleId) -> BundleDetailOut:
        """One bundle with its manifest summary, files, lease holders and recent events."""
        body = to_body(manager.queries.bundle_detail(bundle_id), BundleDetailOut)
        return msgspec.structs.replace(
            body, bundle=named(body.bundle, manager.queries.model_labels({body.bundle.model})))

    @delete(
        "/{bundle_id:str}",
        status_code=200,
        operation_id="removeBundle",
        responses=problem_responses(400, 404, 409),
    )
    async def remove_bundle(
        self,
        manager: Manager,
        pool: Pool,
        bundle_id: BundleId,
        unload_idle: Annotated[
            bool,
            QueryParameter(description="unload this server's engine of the bundle first when it is idle"),
        ] = False,
    ) -> RemoveOut:
        """Evict one bundle now; 409 when it is leased (with holders) or pinned. With
        ``unload_idle=true`` an idle engine of this server is unloaded first; engines busy here
        or leased by other processes still block (409 naming them)."""
        if unload_idle:
            await pool.unload(bundle_id, reason="evict", grace=0.0)
        freed = await anyio.to_thread.run_sync(manager.evictor.remove, bundle_id)
        return RemoveOut(bundle_id=bundle_id, freed_bytes=freed)

    @put(
        "/{bundle_id:str}/pin",
        sync_to_thread=True,
        operation_id="pinBundle",
        responses=problem_responses(400, 404),
    )
    def pin_bundle(self, manager: Manager, bundle_id: BundleId) -> BundleOut:
        """Protect a bundle from eviction."""
        body = to_body(manager.set_pinned(bundle_id, True), BundleOut)
        return named(body, manager.queries.model_labels({body.model}))

    @delete(
        "/{bundle_id:str}/pin",
        status_code=200,
        sync_to_thread=True,
        operation_id="unpinBundle",
        responses=problem_responses(400, 404),
    )
    def unpin_bundle(self, manager: Manager, bundle_id: BundleId) -> BundleOut:
        """Let a bundle be evicted again."""
        body = to_body(manager.set_pinned(bundle_id, False), BundleOut)
        return named(body, manager.queries.model_labels({body.model}))

    @post(
        "/{bundle_id:str}/verify",
        status_code=200,
        sync_to_thread=True,
        operation_id="verifyBundle",
        responses=problem_responses(400, 404, 409),
    )
    def verify_bundle(self, manager: Manager, bundle_id: BundleId) -> VerifyOut:
        """Re-hash a bundle against its manifest; a mismatch marks it corrupt (never served)."""
        return to_body(manager.verifier.verify(bundle_id), VerifyOut)

    @post(
        "/{bundle_id:str}/push",
        status_code=200,
        sync_to_thread=True,
        operation_id="pushBundle",
        responses=problem_responses(400, 404, 409, 502),
    )
    def push_bundle(self, manager: Manager, bundle_id: BundleId) -> PushOut:
        """Push a ready bundle to the server's OCI registry (``--registry``): its files as
        layers (blobs the registry has are skipped), tagged by its id and a readable name."""
        return to_body(manager.registry.push(bundle_id), PushOut)


class BuildController(Controller):
    """``/admin/builds``: prepare profiles ahead of time and watch their progress."""

    path = "/builds"
    tags = ["builds"]

    @post(
        "/",
        status_code=202,
        sync_to_thread=True,
        operation_id="startBuild",
        responses=problem_responses(400, 404, 409, 415, 502, 507),
    )
    def start_build(
        self, manager: Manager, model_roots: ModelRoots, data: Annotated[BuildRequest, StrictBody]
    ) -> BuildOut:
        """Start a background build (or join the running one for the same bundle)."""
        request = _profile(data)
        return to_body(manager.start_build(data.model, request, allowed_roots=model_roots), BuildOut)

    @get("/", sync_to_thread=True, operation_id="listBuilds", responses=problem_responses())
    def list_builds(self, manager: Manager) -> BuildListOut:
        """Every build this server started, newest first."""
        return to_body({"items": manager.builds.all_builds()}, BuildListOut)

    @get(
        "/{build_id:str}", sync_to_thread=True, operation_id="getBuild", responses=problem_responses(400, 404)
    )
    def get_build(self, manager: Manager, build_id: BuildId) -> BuildOut:
        """State, stage, elapsed time, bytes written and error of one build."""
        return to_body(manager.builds.get(build_id), BuildOut)


class PullController(Controller):
    """``/admin/pulls``: pull bundles from the OCI registry in the background (no build)."""

    path = "/pulls"
    tags = ["registry"]

    @post(
        "/",
        status_code=202,
        sync_to_thread=True,
        operation_id="startPull",
        responses=problem_responses(400, 404, 409, 415),
    )
    def start_pull(
        self, manager: Manager, model_roots: ModelRoots, data: Annotated[PullRequest, StrictBody]
    ) -> BuildOut:
        """Queue a pull of the bundle of ``model`` and the profile for this node from the
        registry (``ref``, default ``--registry``); its state and error as a build's."""
        job = manager.start_pull(data.model, _profile(data), ref=data.ref, allowed_roots=model_roots)
        return to_body(job, BuildOut)

    @get("/", sync_to_thread=True, operation_id="listPulls", responses=problem_responses())
    def list_pulls(self, manager: Manager) -> BuildListOut:
        """Every pull this server started, newest first."""
        return to_body({"items": manager.pulls.all_builds()}, BuildListOut)

    @get("/{pull_id:str}", sync_to_thread=True, operation_id="getPull", responses=problem_responses(400, 404))
    def get_pull(self, manager: Manager, pull_id: PullId) -> BuildOut:
        """State, stage and error of one pull."""
        return to_body(manager.pulls.get(pull_id), BuildOut)


def _profile(data: BuildRequest) -> ProfileRequest:
    """The build profile a build or pull request names."""
    return ProfileRequest(
        backend=data.backend,
        precision=data.precision,
        max_input_len=data.max_input_len,
        max_batch_size=data.max_batch_size,
        max_kv_cache_capacity=data.max_kv_cache_capacity,
        speculative_method=data.speculative_method,
        draft_model=data.draft_model,
        task=data.task,
        pooling=data.pooling,
        lora=data.lora,
        kernels=data.kernels,
        kv_cache_dtype=data.kv_cache_dtype,
        max_image_tokens=data.max_image_tokens,
        max_image_tokens_per_image=data.max_image_tokens_per_image,
    )


class CacheController(Controller):
    """``/admin/cache``: prune, clear and reconcile the whole cache."""

    path = "/cache"
    tags = ["cache"]

    @post(
        "/prune",
        status_code=200,
        operation_id="pruneCache",
        responses=problem_responses(400, 409, 415),
    )
    async def prune(
        self, manager: Manager, pool: Pool, data: Annotated[PruneRequest, StrictBody]
    ) -> EvictionOut:
        """Evict LRU idle bundles down to ``max_size_bytes`` (default: the cap); ``dry_run`` plans
        only; ``unload_idle`` first unloads this server's idle engines the plan skips as leased."""
        if data.unload_idle and not data.dry_run:
            plan = await anyio.to_thread.run_sync(
                lambda: manager.evictor.prune(data.max_size_bytes, dry_run=True)
            )
            for skipped in plan.plan.skipped:
                if skipped.reason == "leased" and skipped.kind == "bundle":
                    await pool.unload(skipped.bundle_id, reason="evict", grace=0.0)
        result = await anyio.to_thread.run_sync(
            lambda: manager.evictor.prune(data.max_size_bytes, dry_run=data.dry_run)
        )
        return _eviction_body(result)

    @post(
        "/clear",
        status_code=200,
        sync_to_thread=True,
        operation_id="clearCache",
        responses=problem_responses(400, 409, 415),
    )
    def clear(self, manager: Manager, data: Annotated[ClearRequest, StrictBody]) -> EvictionOut:
        """Remove every idle bundle (leased and pinned ones stay; checkpoints stay)."""
        return _eviction_body(manager.evictor.clear(dry_run=data.dry_run))

    @post(
        "/reconcile",
        status_code=200,
        sync_to_thread=True,
        operation_id="reconcileCache",
        responses=problem_responses(409),
    )
    def reconcile(self, manager: Manager) -> ReconcileOut:
        """Re-sync catalog and disk: adopt, forget, remove stale staging."""
        return to_body(manager.reconciler.reconcile(), ReconcileOut)


@get(
    "/stats",
    sync_to_thread=True,
    operation_id="getStats",
    tags=["stats"],
    responses=problem_responses(400, 404),
)
def get_stats(manager: Manager, node: NodeFilter = None) -> StatsOut:
    """Cache statistics from the catalog's events of one node (default: the answering node)."""
    return to_body(manager.queries.stats(node), StatsOut)


def named(bundle: BundleOut, labels: Mapping[str, str]) -> BundleOut:
    """``bundle`` with its model's served name."""
    return msgspec.structs.replace(bundle, model_name=labels.get(bundle.model, bundle.model))


@get(
    "/events",
    sync_to_thread=True,
    operation_id="listEvents",
    tags=["stats"],
    responses=problem_responses(400),
)
def list_events(
    manager: Manager,
    kind: Annotated[EventKind | None, QueryParameter(description="Only events of this kind")] = None,
    since: Annotated[
        datetime | None, QueryParameter(description="Only events at or after (UTC if naive)")
    ] = None,
    bundle_id: Annotated[
        str | None, QueryParameter(pattern=BUNDLE_ID_PATTERN, description="Only events of this bundle")
    ] = None,
    limit: Limit = 100,
    node: NodeFilter = None,
) -> EventListOut:
    """The audit log, newest first (every node's unless ``node`` is given)."""
    events = manager.catalog.events.recent(
        kind=kind, since=_utc(since), limit=limit, bundle_id=bundle_id, node=node
    )
    return to_body({"items": events}, EventListOut)


@get(
    "/checkpoints",
    sync_to_thread=True,
    operation_id="listCheckpoints",
    tags=["checkpoints"],
    responses=problem_responses(),
)
def list_checkpoints(manager: Manager) -> CheckpointListOut:
    """Resolved checkpoints with digest, size and the bundles built from them."""
    return to_body({"items": manager.catalog.checkpoints.all()}, CheckpointListOut)


CheckpointId = Annotated[
    str,
    PathParameter(
        min_length=1, max_length=128, description="Checkpoint digest, or its first 8 or more characters"
    ),
]


@delete(
    "/checkpoints/{checkpoint_id:str}",
    status_code=200,
    sync_to_thread=True,
    operation_id="removeCheckpoint",
    tags=["checkpoints"],
    responses=problem_responses(400, 404, 409),
)
def remove_checkpoint(
    manager: Manager,
    checkpoint_id: CheckpointId,
    with_bundles: Annotated[
        bool, QueryParameter(description="also remove this node's idle bundles built from it")
    ] = False,
) -> CheckpointRemovalOut:
    """Remove a checkpoint: its catalog row, and its files when the cache downloaded or converted
    them (a local directory outside the cache is only forgotten). 409 while a bundle of it is
    leased or pinned, when it has bundles and ``with_bundles`` is not true, or when other nodes
    hold bundles of it; 404 for an unknown id."""
    done = manager.remove_checkpoint(checkpoint_id, with_bundles=with_bundles, by_path=False)
    return to_body(done, CheckpointRemovalOut)


AdapterId = Annotated[
    str,
    PathParameter(pattern=r"^[0-9a-f]{16}$", description="Adapter id: the first 16 hex digits of its digest"),
]


class AdapterController(Controller):
    """``/admin/lora-adapters``: LoRA adapters converted into the cache (rows, pins, removal)."""

    path = "/lora-adapters"
    tags = ["lora-adapters"]

    @get("/", sync_to_thread=True, operation_id="listLoraAdapters", responses=problem_responses())
    def list_adapters(self, manager: Manager) -> AdapterListOut:
        """This node's converted adapters, most recently used first."""
        return to_body({"items": manager.adapters.list()}, AdapterListOut)

    @post(
        "/",
        status_code=201,
        sync_to_thread=True,
        operation_id="addLoraAdapter",
        responses=problem_responses(400, 404, 409, 415, 502),
    )
    def add_adapter(
        self, manager: Manager, model_roots: ModelRoots, data: Annotated[AdapterRequest, StrictBody]
    ) -> AdapterOut:
        """Convert a PEFT adapter (directory or hub id) for the ``base`` model, once per adapter
        digest (an adapter already converted is returned as it is); 400 for what is not a PEFT
        LoRA adapter or does not fit the base model; 404 when ``base`` is not a checkpoint in the
        catalog (build it first: POST /admin/builds)."""
        info = manager.add_adapter(data.source, data.base, allowed_roots=model_roots, known_base=True)
        return to_body(info, AdapterOut)

    @delete(
        "/{adapter_id:str}",
        status_code=200,
        sync_to_thread=True,
        operation_id="removeLoraAdapter",
        responses=problem_responses(400, 404, 409),
    )
    def remove_adapter(self, manager: Manager, adapter_id: AdapterId) -> AdapterRemovalOut:
        """Remove an adapter (row and converted file); 409 while it is pinned or in use."""
        return AdapterRemovalOut(id=adapter_id, freed_bytes=manager.adapters.remove(adapter_id))

    @post(
        "/{adapter_id:str}/pin",
        status_code=200,
        sync_to_thread=True,
        operation_id="pinLoraAdapter",
        responses=problem_responses(400, 404),
    )
    def pin_adapter(self, manager: Manager, adapter_id: AdapterId) -> AdapterOut:
        """Protect an adapter from eviction."""
        return to_body(manager.adapters.set_pinned(adapter_id, True), AdapterOut)

    @post(
        "/{adapter_id:str}/unpin",
        status_code=200,
        sync_to_thread=True,
        operation_id="unpinLoraAdapter",
        responses=problem_responses(400, 404),
    )
    def unpin_adapter(self, manager: Manager, adapter_id: AdapterId) -> AdapterOut:
        """Let an adapter be evicted again."""
        return to_body(manager.adapters.set_pinned(adapter_id, False), AdapterOut)


async def _reject_bad_json(request: Request) -> None:
    """``before_request``: 400 for a body nested too deep (msgspec would raise RecursionError) or
    text that is not valid Unicode (``body_checks.json_body_problem``)."""
    if not has_body(request.headers):
        return
    body = await request.body()
    if len(body) > LARGE_BODY_BYTES:
        problem = await anyio.to_thread.run_sync(json_body_problem, body)
    else:
        problem = json_body_problem(body)
    if problem is not None:
        raise ClientException(detail=problem.message)


def admin_router(*, admin_api_key: str | None, model_roots: tuple[Path, ...] | None = None) -> Router:
    """The ``/admin`` router: every admin route, its guard and its problem-JSON error mapping.

    The app must provide the ``manager`` dependency (``Provide(lambda: manager, sync_to_thread=False)``).
    """
    router = Router(
        path="/admin",
        route_handlers=[
            BundleController,
            BuildController,
            PullController,
            CacheController,
            get_stats,
            list_events,
            list_checkpoints,
            remove_checkpoint,
            AdapterController,
            *FLEET_HANDLERS,
        ],
        guards=[admin_guard(admin_api_key)],
        before_request=_reject_bad_json,
        dependencies={"model_roots": Provide(lambda: model_roots, sync_to_thread=False)},
        exception_handlers=admin_exception_handlers(),
        signature_namespace={"CacheManager": CacheManager, "Path": Path, "ModelPool": ModelPool},
    )
    drop_stale_options_handlers(router)
    return router


def drop_stale_options_handlers(router: Router) -> None:
    """Remove the OPTIONS handlers Litestar generated while registering handlers one by one.

    Litestar 2.25 creates a path's OPTIONS handler with the first handler registered there and
    keeps it when later handlers join the path, so ``Allow`` lists only the first method
    (``GET, OPTIONS`` for a path that also has DELETE). Without them, mounting this router
    builds each path from its complete method map and generates a correct OPTIONS handler.
    """
    for route in router.routes:
        handlers = getattr(route, "route_handlers", None)
        if not isinstance(handlers, list):
            continue
        handlers[:] = [
            h
            for h in handlers
            if not (set(h.http_methods) == {"OPTIONS"} and getattr(h.fn, "__name__", "") == "options_handler")
        ]
