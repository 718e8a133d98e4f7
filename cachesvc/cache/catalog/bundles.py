"""The ``bundles`` table: one row per bundle and node; the build, hit, pin, verify and evict
transitions of a row, each with its event; listings with keyset cursors."""

from __future__ import annotations

import base64
import json
import math
from collections.abc import Sequence
from datetime import datetime
from typing import Any

from sqlalchemy import Select, and_, func, literal, or_, select, tuple_, update

from cachesvc.cache.catalog.base import BUCKET_KIND, CatalogTable, bundle_info, require_row, utcnow
from cachesvc.cache.catalog.models import BundleRow, UTCDateTime
from cachesvc.cache.profiles import BundleKey
from cachesvc.cache.records import BUILD_SECONDS_BUCKETS, SORT_KEYS, SORT_ORDERS, BundleInfo, BundlePage
from cachesvc.errors import ConfigError

SORT_COLUMNS = {
    "last_used": BundleRow.last_used_at,
    "size": BundleRow.size_bytes,
    "created": BundleRow.created_at,
    "hits": BundleRow.hit_count,
}
assert tuple(SORT_COLUMNS) == SORT_KEYS, "every listing sort key needs a column"
_DATETIME_SORTS = {"last_used", "created"}


class BundleTable(CatalogTable):
    """This node's bundle rows (writes) and every node's (listings)."""

    def get(self, bundle_id: str) -> BundleInfo | None:
        """This node's bundle, or None."""
        with self.core.read() as session:
            row = session.get(BundleRow, (bundle_id, self.node))
            return None if row is None else bundle_info(row)

    def require(self, bundle_id: str, *, node: str | None = None) -> BundleInfo:
        """This node's bundle (or ``node``'s), or NotFoundError."""
        with self.core.read() as session:
            return bundle_info(require_row(session, bundle_id, node or self.node, lock=False))

    def begin_build(self, key: BundleKey, *, model: str) -> None:
        """Insert (or reset) the row of a bundle about to be built: state ``building``; a miss event."""
        now = utcnow()
        bundle_id = key.id
        with self.core.tx() as session:
            row = self.core.lock_bundle(session, bundle_id)
            if row is None:
                row = BundleRow(id=bundle_id, node=self.node, created_at=now, hit_count=0, pinned=False)
                session.add(row)
            row.model, row.checkpoint_digest = model, key.checkpoint_digest
            row.draft_digest, row.profile, row.profile_name = key.draft_digest, dict(key.profile), key.name
            row.backend, row.path = key.backend, str(key.relpath)
            row.size_bytes, row.file_count, row.state, row.error = 0, 0, "building", None
            row.last_used_at, row.node = now, self.node
            self.core.bundle_event(session, "miss", row)

    def finish_build(self, bundle_id: str, *, size_bytes: int, file_count: int, seconds: float) -> BundleInfo:
        """Mark a build ready (after its directory was published); a build_ok event."""
        now = utcnow()
        with self.core.tx() as session:
            row = require_row(session, bundle_id, self.node)
            row.state, row.size_bytes, row.file_count = "ready", size_bytes, file_count
            row.built_at, row.build_seconds, row.last_used_at, row.last_verified_at = now, seconds, now, now
            row.error = None
            self.core.bundle_event(session, "build_ok", row, nbytes=size_bytes, seconds=seconds)
            # Histogram of build durations as running totals (one row per bucket), so stats
            # and /metrics never read the build events themselves.
            bound = next((b for b in BUILD_SECONDS_BUCKETS if seconds <= b), math.inf)
            self.core.bump_total(session, BUCKET_KIND, repr(float(bound)), "", 0, seconds, utcnow())
            return bundle_info(row)

    def fail_build(self, bundle_id: str, *, error: str, seconds: float) -> None:
        """A build failed or was interrupted (nothing was published): a build_failed event with
        the error, and the row goes.

        A row promises a directory: a kept ``failed`` row would list a path that does not exist
        and count in stats. The failure itself stays in the event log (and in the build status).
        """
        with self.core.tx() as session:
            row = self.core.lock_bundle(session, bundle_id)
            if row is None:
                return
            session.delete(row)
            self.core.bundle_event(session, "build_failed", row, seconds=seconds, detail=error[:4000])

    def record_hit(self, bundle_id: str) -> BundleInfo:
        """A cache hit: last_used_at = now, hit_count + 1, a hit event."""
        with self.core.tx() as session:
            row = require_row(session, bundle_id, self.node)
            row.hit_count += 1
            row.last_used_at = utcnow()
            self.core.bundle_event(session, "hit", row)
            return bundle_info(row)

    def set_pinned(self, bundle_id: str, pinned: bool) -> BundleInfo:
        """Pin or unpin; an event when it changes."""
        with self.core.tx() as session:
            row = require_row(session, bundle_id, self.node)
            if row.pinned != pinned:
                row.pinned = pinned
                kind = "pin" if pinned else "unpin"
                self.core.add_event(session, kind, bundle_id=bundle_id, model=row.model)
            return bundle_info(row)

    def set_verified(
        self, bundle_id: str, *, ok: bool, detail: str | None, stale: str | None = None
    ) -> BundleInfo:
        """Record a verify: a mismatch marks the bundle corrupt; files that match but were built
        for another environment (``stale`` says why) mark it stale; a clean verify makes a
        corrupt or stale bundle ready again."""
        with self.core.tx() as session:
            row = require_row(session, bundle_id, self.node)
            row.last_verified_at = utcnow()
            if not ok:
                row.state, row.error = "corrupt", detail
            elif stale is not None:
                row.state, row.error = "stale", stale
            elif row.state in ("corrupt", "stale"):
                row.state, row.error = "ready", None
            self.core.add_event(
                session,
                "verify",
                bundle_id=bundle_id,
                model=row.model,
                reason="corrupt" if not ok else "stale" if stale is not None else "ok",
                detail=detail if not ok else stale,
            )
            return bundle_info(row)

    def set_stale(self, bundle_id: str, reason: str | None) -> BundleInfo:
        """``reason`` given: a ready bundle becomes ``stale`` (error = why); None: a stale bundle is
        ``ready`` again. A ``reconcile`` event (reason ``stale``/``ready``) when the state changes;
        other states (building, failed, corrupt) are left as they are."""
        with self.core.tx() as session:
            row = require_row(session, bundle_id, self.node)
            if reason is not None and row.state == "ready":
                row.state, row.error = "stale", reason
            elif reason is None and row.state == "stale":
                row.state, row.error = "ready", None
            else:
                return bundle_info(row)
            self.core.add_event(
                session,
                "reconcile",
                bundle_id=bundle_id,
                model=row.model,
                reason=row.state,
                detail=reason or "the GPU and TensorRT version it was built for are back",
            )
            return bundle_info(row)

    def delete(self, bundle_id: str, *, reason: str, nbytes: int, detail: str | None = None) -> None:
        """Forget a bundle whose directory is gone; an evict event with the reason and bytes."""
        with self.core.tx() as session:
            row = self.core.lock_bundle(session, bundle_id)
            if row is None:
                return
            self.core.bundle_event(session, "evict", row, reason=reason, nbytes=nbytes, detail=detail)
            session.delete(row)

    def forget(self, bundle_id: str) -> None:
        """Delete a row without an event (its story is in the log already, e.g. a failed build)."""
        with self.core.tx() as session:
            row = self.core.lock_bundle(session, bundle_id)
            if row is not None:
                session.delete(row)

    def adopt(
        self, key: BundleKey, *, model: str, size_bytes: int, file_count: int, built_at: datetime
    ) -> None:
        """Insert a ready row for a published directory the catalog did not know."""
        now = utcnow()
        bundle_id, checkpoint_digest, draft_digest = key.id, key.checkpoint_digest, key.draft_digest
        profile, profile_name, backend, path = dict(key.profile), key.name, key.backend, key.relpath
        with self.core.tx() as session:
            if session.get(BundleRow, (bundle_id, self.node)) is not None:
                return
            session.add(
                BundleRow(
                    id=bundle_id,
                    model=model,
                    checkpoint_digest=checkpoint_digest,
                    draft_digest=draft_digest,
                    profile=profile,
                    profile_name=profile_name,
                    backend=backend,
                    path=str(path),
                    size_bytes=size_bytes,
                    file_count=file_count,
                    state="ready",
                    created_at=built_at,
                    built_at=built_at,
                    last_used_at=built_at,
                    last_verified_at=now,
                    hit_count=0,
                    pinned=False,
                    node=self.node,
                )
            )
            self.core.add_event(
                session, "reconcile", bundle_id=bundle_id, model=model, reason="adopted", nbytes=size_bytes
            )

    def record_pull(
        self, key: BundleKey, *, model: str, size_bytes: int, file_count: int, seconds: float, ref: str
    ) -> BundleInfo:
        """A bundle pulled from a registry was published: its ``ready`` row (replacing a corrupt
        or stale one), a miss event and a ``pull`` event with the reference and the bytes moved."""
        now = utcnow()
        with self.core.tx() as session:
            row = self.core.lock_bundle(session, key.id)
            if row is None:
                row = BundleRow(id=key.id, node=self.node, created_at=now, hit_count=0, pinned=False)
                session.add(row)
            row.model, row.checkpoint_digest = model, key.checkpoint_digest
            row.draft_digest, row.profile, row.profile_name = key.draft_digest, dict(key.profile), key.name
            row.backend, row.path = key.backend, str(key.relpath)
            row.size_bytes, row.file_count, row.state, row.error = size_bytes, file_count, "ready", None
            row.built_at, row.build_seconds = now, seconds
            row.last_used_at, row.last_verified_at, row.node = now, now, self.node
            self.core.bundle_event(session, "miss", row)
            self.core.bundle_event(session, "pull", row, nbytes=size_bytes, seconds=seconds, detail=ref)
            return bundle_info(row)

    def all(self, *, states: Sequence[str] | None = None) -> list[BundleInfo]:
        """Every bundle of this node (optionally of some states), least recently used first."""
        stmt = (
            select(BundleRow)
            .where(BundleRow.node == self.node)
            .order_by(BundleRow.last_used_at.asc(), BundleRow.id.asc())
        )
        if states is not None:
            stmt = stmt.where(BundleRow.state.in_(list(states)))
        with self.core.read() as session:
            return [bundle_info(r) for r in session.scalars(stmt)]

    def eviction_candidates(
        self, *, limit: int = 512, after: tuple[datetime, str] | None = None
    ) -> list[tuple[str, int, datetime, bool, str]]:
        """(id, size, last_used_at, pinned, path) of evictable bundles, LRU first, one keyset page.

        Stale bundles are not among them: the planner takes those first (``Evictor._stale_rows``).
        Reads only indexed columns a page at a time, so planning over 100k rows stays cheap.
        """
        stmt = (
            select(
                BundleRow.id, BundleRow.size_bytes, BundleRow.last_used_at, BundleRow.pinned, BundleRow.path
            )
            .where(BundleRow.node == self.node, BundleRow.state.not_in(("building", "stale")))
            .order_by(BundleRow.last_used_at.asc(), BundleRow.id.asc())
            .limit(limit)
        )
        if after is not None:
            at, last_id = after
            # A row-value comparison: PostgreSQL walks the (node, last_used_at, id) index from
            # the cursor with it (the OR form made it sort the node's rows for every page).
            stmt = stmt.where(
                tuple_(BundleRow.last_used_at, BundleRow.id)
                > tuple_(literal(at, UTCDateTime()), literal(last_id))
            )
        with self.core.read() as session:
            return [(r[0], int(r[1]), r[2], bool(r[3]), r[4]) for r in session.execute(stmt)]

    def total_size(self) -> int:
        """Sum of catalog sizes of this node's bundles (no directory walks)."""
        with self.core.read() as session:
            return int(
                session.scalar(
                    select(func.coalesce(func.sum(BundleRow.size_bytes), 0)).where(
                        BundleRow.node == self.node
                    )
                )
                or 0
            )

    def page(
        self,
        *,
        model: str | None = None,
        state: str | None = None,
        backend: str | None = None,
        pinned: bool | None = None,
        sort: str = "last_used",
        order: str = "desc",
        limit: int = 50,
        offset: int | None = None,
        cursor: str | None = None,
        node: str | None = None,
    ) -> BundlePage:
        """Filter, sort and page bundles; totals cover every match. Keyset cursor or offset.

        Every node's rows unless ``node`` is given; the keyset is (sort column, id, node).
        """
        if sort not in SORT_COLUMNS:
            raise ConfigError("sort", f"must be one of {', '.join(SORT_COLUMNS)}, got {sort!r}")
        if order not in ("asc", "desc"):
            raise ConfigError("order", f"must be {' or '.join(SORT_ORDERS)}, got {order!r}")
        if limit < 1:
            raise ConfigError("limit", f"must be at least 1, got {limit}")
        if offset is not None and offset < 0:
            raise ConfigError("offset", f"must not be negative, got {offset}")
        if offset is not None and cursor is not None:
            raise ConfigError("cursor", "give either cursor or offset, not both")
        conds = []
        if model is not None:
            conds.append(or_(BundleRow.model == model, BundleRow.checkpoint_digest.startswith(model)))
        if state is not None:
            conds.append(BundleRow.state == state)
        if backend is not None:
            conds.append(BundleRow.backend == backend)
        if pinned is not None:
            conds.append(BundleRow.pinned.is_(pinned))
        if node is not None:
            conds.append(BundleRow.node == node)
        col = SORT_COLUMNS[sort]
        # Plain rows, not ORM objects: building entities cost more than the query itself.
        stmt: Select[Any] = select(*BundleRow.__table__.columns).where(*conds)
        if cursor is not None:
            value, last_id, last_node = _decode_cursor(cursor, sort)
            # (id, node) written out rather than a row-value comparison: portable everywhere.
            if order == "desc":
                after = or_(BundleRow.id < last_id, and_(BundleRow.id == last_id, BundleRow.node < last_node))
                stmt = stmt.where(or_(col < value, and_(col == value, after)))
            else:
                after = or_(BundleRow.id > last_id, and_(BundleRow.id == last_id, BundleRow.node > last_node))
                stmt = stmt.where(or_(col > value, and_(col == value, after)))
        if order == "desc":
            stmt = stmt.order_by(col.desc(), BundleRow.id.desc(), BundleRow.node.desc())
        else:
            stmt = stmt.order_by(col.asc(), BundleRow.id.asc(), BundleRow.node.asc())
        stmt = stmt.limit(limit + 1)
        if offset:
            stmt = stmt.offset(offset)
        with self.core.engine.connect() as session:
            rows = list(session.execute(stmt))
            total, total_bytes = session.execute(
                select(func.count(), func.coalesce(func.sum(BundleRow.size_bytes), 0))
                .select_from(BundleRow)
                .where(*conds)
            ).one()
        more = len(rows) > limit
        rows = rows[:limit]
        items = tuple(bundle_info(r) for r in rows)
        next_cursor = _encode_cursor(rows[-1], sort) if more and rows else None
        next_offset = (offset or 0) + len(rows) if more and cursor is None else None
        return BundlePage(
            items=items,
            total=int(total),
            total_bytes=int(total_bytes),
            next_cursor=next_cursor,
            next_offset=next_offset,
        )

    def touch(self, bundle_id: str, at: datetime) -> None:
        """Set last_used_at (tests and benchmarks arrange LRU order with it; no event)."""
        self.core.untracked_changes += 1
        with self.core.tx() as session:
            session.execute(
                update(BundleRow)
                .where(BundleRow.id == bundle_id, BundleRow.node == self.node)
                .values(last_used_at=at)
            )



def _encode_cursor(row: Any, sort: str) -> str:
    value: Any = {
        "last_used": row.last_used_at,
        "size": row.size_bytes,
        "created": row.created_at,
        "hits": row.hit_count,
    }[sort]
    if isinstance(value, datetime):
        value = value.isoformat()
    raw = json.dumps([sort, value, row.id, row.node], separators=(",", ":")).encode()
    return base64.urlsafe_b64encode(raw).decode().rstrip("=")


def _decode_cursor(cursor: str, sort: str) -> tuple[Any, str, str]:
    try:
        raw = base64.urlsafe_b64decode(cursor + "=" * (-len(cursor) % 4))
        cur_sort, value, last_id, last_node = json.loads(raw)
        if cur_sort != sort or not isinstance(last_id, str) or not isinstance(last_node, str):
            raise ValueError("sort mismatch")
        if sort in _DATETIME_SORTS:
            value = datetime.fromisoformat(value)
        elif not isinstance(value, int) or isinstance(value, bool):
            raise ValueError("bad value")
    except (ValueError, TypeError, json.JSONDecodeError) as exc:
        raise ConfigError(
            "cursor", "is not a cursor returned by this listing with the same sort; start again without it"
        ) from exc
    return value, last_id, last_node
