"""``/admin/bundles``: list, inspect, evict, pin, verify and push bundles."""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Hashable, Mapping
from typing import Annotated

import anyio
import msgspec
from litestar import Controller, delete, get, post, put
from litestar.params import QueryParameter

from cachesvc.http.admin.params import BundleId, Limit, Manager, NodeFilter, Pool
from cachesvc.http.errors import problem_responses
from cachesvc.http.schemas import (
    BackendName,
    BundleDetailOut,
    BundleListOut,
    BundleOut,
    BundleState,
    PushOut,
    RemoveOut,
    SortKey,
    SortOrder,
    VerifyOut,
    to_body,
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


def named(bundle: BundleOut, labels: Mapping[str, str]) -> BundleOut:
    """``bundle`` with its model's served name."""
    return msgspec.structs.replace(bundle, model_name=labels.get(bundle.model, bundle.model))
