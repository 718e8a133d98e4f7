"""The ``events`` table (the audit log) and its running totals (``event_totals``): stats and
the catalog version come from the totals, never from scanning the log."""

from __future__ import annotations

import logging
import math
from datetime import datetime, timedelta
from typing import Any

from sqlalchemy import Connection, delete, func, insert, select

from cachesvc.cache.catalog.base import BUCKET_KIND, CatalogTable, event_info, utcnow
from cachesvc.cache.catalog.models import BundleRow, CheckpointRow, EventRow, EventTotalRow
from cachesvc.cache.records import BUILD_SECONDS_BUCKETS, CacheStats, EventInfo, ModelStats

log = logging.getLogger("cachesvc.manager")


class EventTable(CatalogTable):
    """Append, prune and read the audit log; stats and the version from its totals."""

    def add(self, kind: str, **fields: Any) -> None:
        """Append one event (and its running total) in its own transaction."""
        with self.core.tx() as session:
            self.core.add_event(session, kind, **fields)

    def apply_retention(self, *, max_age_days: float, max_rows: int) -> int:
        """The audit log's retention on this node's events (0 disables a limit); the running
        totals behind stats and metrics are kept. Returns how many events went."""
        older_than = utcnow() - timedelta(days=max_age_days) if max_age_days > 0 else None
        removed = self.prune(older_than=older_than, keep_rows=max_rows or None)
        if removed:
            log.info("event retention: removed %d old events of node %s", removed, self.node)
        return removed

    def prune(self, *, older_than: datetime | None, keep_rows: int | None) -> int:
        """Delete this node's events older than ``older_than`` and all but its ``keep_rows``
        newest; the running totals (counters, stats) stay. Returns how many rows went."""
        removed = 0
        with self.core.tx() as session:
            mine = EventRow.node == self.node
            if older_than is not None:
                result = session.execute(delete(EventRow).where(mine, EventRow.at < older_than))
                removed += int(getattr(result, "rowcount", 0) or 0)
            if keep_rows is not None:
                # The id of the oldest row to keep; everything of this node before it goes.
                newest_first = select(EventRow.id).where(mine).order_by(EventRow.id.desc())
                boundary = session.scalar(newest_first.offset(max(keep_rows, 1) - 1).limit(1))
                if boundary is not None:
                    result = session.execute(delete(EventRow).where(mine, EventRow.id < boundary))
                    removed += int(getattr(result, "rowcount", 0) or 0)
        return removed

    def recent(
        self,
        *,
        kind: str | None = None,
        since: datetime | None = None,
        limit: int = 100,
        bundle_id: str | None = None,
        before_id: int | None = None,
        node: str | None = None,
    ) -> list[EventInfo]:
        """The audit log, newest first (every node's unless ``node`` is given)."""
        stmt = select(EventRow).order_by(EventRow.id.desc()).limit(limit)
        if node is not None:
            stmt = stmt.where(EventRow.node == node)
        if kind is not None:
            stmt = stmt.where(EventRow.kind == kind)
        if since is not None:
            stmt = stmt.where(EventRow.at >= since)
        if bundle_id is not None:
            stmt = stmt.where(EventRow.bundle_id == bundle_id)
        if before_id is not None:
            stmt = stmt.where(EventRow.id < before_id)
        with self.core.read() as session:
            return [event_info(r) for r in session.scalars(stmt)]

    def version(self) -> int:
        """A number that grows with every change a listing can show (every such change is an event).

        The total of ``event_totals`` rather than ``max(events.id)``: ids can commit out of
        order on PostgreSQL, the total cannot go backwards once a transaction is visible.
        """
        with self.core.engine.connect() as conn:
            total = int(conn.scalar(select(func.coalesce(func.sum(EventTotalRow.count), 0))) or 0)
        return total + self.core.untracked_changes

    def stats(self, *, max_size_bytes: int, node: str | None = None) -> CacheStats:
        """Cache statistics from the event totals and indexed bundle columns (no log scans).

        One node's (``node``) or, with None, the whole catalog's.
        """
        t = EventTotalRow
        on_node = [t.node == node] if node is not None else []
        bundle_on_node = [BundleRow.node == node] if node is not None else []
        event_on_node = [EventRow.node == node] if node is not None else []
        # Core connection, not an ORM session: the session's per-statement overhead was most
        # of this call's time on a 10k-bundle catalog.
        with self.core.engine.connect() as session:
            # SQLite aggregates in C; Python sees a few rows per kind/reason and two per model.
            totals = session.execute(
                select(t.kind, t.reason, func.sum(t.count), func.sum(t.bytes), func.sum(t.seconds))
                .where(*on_node)
                .group_by(t.kind, t.reason)
            ).all()
            model_totals = session.execute(
                select(t.model, t.kind, func.sum(t.count))
                .where(t.kind.in_(("hit", "miss")), t.model != "", *on_node)
                .group_by(t.model, t.kind)
            ).all()
            since = session.scalar(select(func.min(t.first_at)).where(t.kind != BUCKET_KIND, *on_node))
            by_state: dict[str, int] = {
                str(state): int(count)
                for state, count in session.execute(
                    select(BundleRow.state, func.count()).where(*bundle_on_node).group_by(BundleRow.state)
                )
            }
            model_rows = session.execute(
                select(BundleRow.model, func.count(), func.coalesce(func.sum(BundleRow.size_bytes), 0))
                .where(*bundle_on_node)
                .group_by(BundleRow.model)
            ).all()
            builds_ok = sum(int(r[2]) for r in totals if r[0] == "build_ok")
            median = _median_build_seconds(session, builds_ok, event_on_node)
            checkpoints = int(session.scalar(select(func.count()).select_from(CheckpointRow)) or 0)
        hits = misses = builds_failed = 0
        transfers = {"pull": [0, 0], "push": [0, 0]}
        evictions: dict[str, int] = {}
        evicted_bytes: dict[str, int] = {}
        buckets: dict[float, int] = {}
        build_sum = 0.0
        for kind, reason, count, nbytes, seconds in totals:
            count, nbytes = int(count), int(nbytes)
            if kind == "hit":
                hits += count
            elif kind == "miss":
                misses += count
            elif kind == "build_failed":
                builds_failed += count
            elif kind == "evict":
                evictions[reason] = count
                evicted_bytes[reason] = nbytes
            elif kind in transfers:
                transfers[kind][0] += count
                transfers[kind][1] += nbytes
            elif kind == BUCKET_KIND:
                buckets[float(reason)] = count
                build_sum += float(seconds)
        per_model = _per_model(model_totals, model_rows)
        cumulative: list[tuple[float, int]] = []
        running = 0
        for bound in (*BUILD_SECONDS_BUCKETS, math.inf):
            running += buckets.get(float(bound), 0)
            cumulative.append((float(bound), running))
        return CacheStats(
            size_bytes=sum(m.size_bytes for m in per_model),
            max_size_bytes=max_size_bytes,
            bundles=sum(by_state.values()),
            bundles_by_state=by_state,
            checkpoints=checkpoints,
            hits=hits,
            misses=misses,
            hit_rate=(hits / (hits + misses)) if hits + misses else None,
            builds_ok=builds_ok,
            builds_failed=builds_failed,
            median_build_seconds=median,
            evictions_by_reason=evictions,
            evicted_bytes_by_reason=evicted_bytes,
            per_model=per_model,
            since=since,
            build_buckets=tuple(cumulative),
            build_seconds_sum=build_sum,
            pulls=transfers["pull"][0],
            pulled_bytes=transfers["pull"][1],
            pushes=transfers["push"][0],
            pushed_bytes=transfers["push"][1],
        )

    def rebuild_totals(self) -> None:
        """Recompute ``event_totals`` from the events (repair, bulk imports, benchmarks)."""
        reason = func.coalesce(EventRow.reason, "")
        model = func.coalesce(EventRow.model, "")
        with self.core.tx() as session:
            session.execute(delete(EventTotalRow))
            session.execute(
                insert(EventTotalRow).from_select(
                    ["node", "kind", "reason", "model", "count", "bytes", "seconds", "first_at"],
                    select(
                        EventRow.node,
                        EventRow.kind,
                        reason,
                        model,
                        func.count(),
                        func.coalesce(func.sum(EventRow.bytes), 0),
                        func.coalesce(func.sum(EventRow.seconds), 0.0),
                        func.min(EventRow.at),
                    ).group_by(EventRow.node, EventRow.kind, reason, model),
                )
            )
            seconds = session.execute(
                select(EventRow.node, EventRow.seconds).where(
                    EventRow.kind == "build_ok", EventRow.seconds.is_not(None)
                )
            ).all()
            for event_node, value in seconds:
                duration = float(value or 0.0)
                bound = next((b for b in BUILD_SECONDS_BUCKETS if duration <= b), math.inf)
                self.core.bump_total(
                    session, BUCKET_KIND, repr(float(bound)), "", 0, duration, utcnow(), node=event_node
                )


def _median_build_seconds(session: Connection, builds_ok: int, event_on_node: list[Any]) -> float | None:
    """The median duration of the ``builds_ok`` successful builds: the middle one or two
    durations through the (kind, seconds) index."""
    if not builds_ok:
        return None
    ordered = (
        select(EventRow.seconds)
        .where(EventRow.kind == "build_ok", EventRow.seconds.is_not(None), *event_on_node)
        .order_by(EventRow.seconds)
    )
    middle = [
        float(v or 0.0)
        for v in session.scalars(ordered.offset((builds_ok - 1) // 2).limit(2 - builds_ok % 2))
    ]
    return sum(middle) / len(middle) if middle else None


def _per_model(model_totals: Any, model_rows: Any) -> tuple[ModelStats, ...]:
    """Bundles, bytes, hits and misses per model, by model name: from the hit/miss totals
    (``model, kind, count``) and the bundle rows (``model, count, bytes``)."""
    per_model: dict[str, list[int]] = {}
    for model, kind, count in model_totals:
        slot = per_model.setdefault(model, [0, 0, 0, 0])
        slot[2 if kind == "hit" else 3] += int(count)
    for model, count, nbytes in model_rows:
        slot = per_model.setdefault(model, [0, 0, 0, 0])
        slot[0], slot[1] = int(count), int(nbytes)
    return tuple(
        ModelStats(model=m, bundles=v[0], size_bytes=v[1], hits=v[2], misses=v[3])
        for m, v in sorted(per_model.items())
    )
