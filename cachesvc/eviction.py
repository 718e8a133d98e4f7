"""Eviction: LRU plans computed from catalog sizes, executed under each bundle's exclusive lock.

A plan changes nothing: it reads the least recently used rows a keyset page at a time until
the cache would fit the cap, skipping pinned bundles and (checked only for the ones that would
go, so planning reads few locks) bundles whose lock another process holds. Executing re-checks
both for every bundle at delete time, under the exclusive lock taken non-blocking: a bundle
pinned or leased since the plan was made is skipped, never deleted. Every eviction is an event.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from datetime import datetime
from pathlib import Path

from cachesvc.catalog import Catalog
from cachesvc.errors import ConfigError, LeasedError, PinnedError
from cachesvc.records import (
    EvictionPlan,
    EvictionResult,
    LeaseHolder,
    PlannedEviction,
    SkippedBundle,
)
from cachesvc.store import BundleStore

#: Rows read per batch while planning an eviction (planning stops once under the cap).
PLAN_BATCH = 512


class Evictor:
    """Plans and carries out evictions over one catalog and one store."""

    def __init__(
        self,
        catalog: Catalog,
        store: BundleStore,
        *,
        max_size_bytes: int,
        holders: Callable[[str], list[LeaseHolder]],
    ) -> None:
        self.catalog = catalog
        self.store = store
        self.max_size_bytes = max_size_bytes
        self._holders = holders

    def remove(self, bid: str) -> int:
        """Evict one bundle now (reason ``manual``); returns bytes freed."""
        info = self.catalog.require_bundle(bid)
        if info.pinned:
            raise PinnedError(f"bundle {bid} is pinned; unpin it first (`cachesvc bundles unpin {bid}`)")
        with self.store.locks.try_exclusive(bid) as got:
            if not got:
                holders = self._holders(bid)
                who = ", ".join(f"pid {h.pid} on {h.host}" for h in holders) or "another process"
                raise LeasedError(
                    f"bundle {bid} is in use by {who}; stop that server first",
                    holders=[{"pid": h.pid, "host": h.host, "since": h.since} for h in holders],
                )
            self.store.remove(info.path)
            self.catalog.delete_bundle(bid, reason="manual", nbytes=info.size_bytes)
        return info.size_bytes

    def plan(
        self, max_bytes: int | None = None, *, exclude: frozenset[str] = frozenset(), reason: str = "lru"
    ) -> EvictionPlan:
        """Plan an LRU eviction down to ``max_bytes`` (default: the cache cap). Changes nothing."""
        cap = self.max_size_bytes if max_bytes is None else max_bytes
        if cap < 0:
            raise ConfigError("max_size_bytes", f"must not be negative, got {cap}")
        total = self.catalog.total_size()
        remaining = total
        evict: list[PlannedEviction] = []
        skipped: list[SkippedBundle] = []
        for bid, size, last_used, pinned, path in self._lru_rows():
            if remaining <= cap:
                break
            if bid in exclude:
                continue
            if pinned:
                skipped.append(SkippedBundle(bid, size, "pinned"))
            elif self.store.locks.is_locked(bid):
                # Checked only for bundles that would go, so planning reads few locks.
                skipped.append(SkippedBundle(bid, size, "leased"))
            else:
                evict.append(PlannedEviction(bid, size, last_used, Path(path)))
                remaining -= size
        return EvictionPlan(
            max_bytes=cap,
            total_before=total,
            evict=tuple(evict),
            skipped=tuple(skipped),
            freed_bytes=total - remaining,
            total_after=remaining,
            reason=reason,
        )

    def _lru_rows(self) -> Iterator[tuple[str, int, datetime, bool, str]]:
        """Evictable rows, least recently used first, read in keyset pages (stops when not needed)."""
        after: tuple[datetime, str] | None = None
        while True:
            rows = self.catalog.eviction_candidates(limit=PLAN_BATCH, after=after)
            yield from rows
            if len(rows) < PLAN_BATCH:
                return
            after = (rows[-1][2], rows[-1][0])

    def execute(self, plan: EvictionPlan) -> EvictionResult:
        """Carry out a plan; a bundle leased or pinned since planning is skipped, not deleted."""
        evicted: list[str] = []
        skipped = list(plan.skipped)
        freed = 0
        for item in plan.evict:
            info = self.catalog.get_bundle(item.bundle_id)
            if info is None:
                continue
            if info.pinned:
                skipped.append(SkippedBundle(item.bundle_id, item.size_bytes, "pinned"))
                continue
            with self.store.locks.try_exclusive(item.bundle_id) as got:
                if not got:
                    skipped.append(SkippedBundle(item.bundle_id, item.size_bytes, "leased"))
                    continue
                self.store.remove(info.path)
                self.catalog.delete_bundle(item.bundle_id, reason=plan.reason, nbytes=info.size_bytes)
            evicted.append(item.bundle_id)
            freed += info.size_bytes
        return EvictionResult(
            plan=plan,
            evicted=tuple(evicted),
            skipped=tuple(skipped),
            freed_bytes=freed,
            total_after=self.catalog.total_size(),
            dry_run=False,
        )

    def prune(
        self, max_bytes: int | None = None, *, dry_run: bool = False, exclude: frozenset[str] = frozenset()
    ) -> EvictionResult:
        """Evict least-recently-used idle bundles until the cache fits ``max_bytes``."""
        plan = self.plan(max_bytes, exclude=exclude)
        return dry_result(plan) if dry_run else self.execute(plan)

    def clear(self, *, dry_run: bool = False) -> EvictionResult:
        """Remove every idle bundle (pinned and leased ones stay). Checkpoints are never touched."""
        plan = self.plan(0, reason="clear")
        return dry_result(plan) if dry_run else self.execute(plan)


def dry_result(plan: EvictionPlan) -> EvictionResult:
    """What executing ``plan`` would report, without doing it."""
    return EvictionResult(
        plan=plan,
        evicted=tuple(e.bundle_id for e in plan.evict),
        skipped=plan.skipped,
        freed_bytes=plan.freed_bytes,
        total_after=plan.total_after,
        dry_run=True,
    )
