"""``/admin/cache``: prune, clear and reconcile the whole cache."""

from __future__ import annotations

from typing import Annotated

import anyio
from litestar import Controller, post

from cachesvc.cache.records import EvictionResult
from cachesvc.http.admin.params import Manager, Pool, StrictBody
from cachesvc.http.errors import problem_responses
from cachesvc.http.schemas import ClearRequest, EvictionOut, PruneRequest, ReconcileOut, to_body


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
