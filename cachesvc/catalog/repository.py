"""Typed catalog operations. ORM rows stay in this package; callers get ``cachesvc.records``."""

from __future__ import annotations

import base64
import json
import math
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from sqlalchemy import Select, Table, and_, delete, func, insert, literal, or_, select, tuple_, update
from sqlalchemy.dialects import postgresql, sqlite
from sqlalchemy.engine import make_url
from sqlalchemy.orm import Session, sessionmaker

from cachesvc.catalog.health import CatalogHealth
from cachesvc.catalog.models import (
    AliasRow,
    BundleRow,
    CheckpointRow,
    EventRow,
    EventTotalRow,
    LeaseRow,
    UTCDateTime,
)
from cachesvc.catalog.session import create_catalog_engine
from cachesvc.errors import ConfigError, NotFoundError
from cachesvc.profiles import BundleKey
from cachesvc.records import (
    BUILD_SECONDS_BUCKETS,
    EVENT_KINDS,
    SORT_KEYS,
    SORT_ORDERS,
    AliasInfo,
    BundleInfo,
    BundlePage,
    CacheStats,
    CatalogState,
    CheckpointInfo,
    EventInfo,
    LeaseHolder,
    ModelStats,
)

#: event_totals kind of the build-duration histogram rows (not an event kind of its own).
_BUCKET_KIND = "build_bucket"

SORT_COLUMNS = {
    "last_used": BundleRow.last_used_at,
    "size": BundleRow.size_bytes,
    "created": BundleRow.created_at,
    "hits": BundleRow.hit_count,
}
assert tuple(SORT_COLUMNS) == SORT_KEYS, "every listing sort key needs a column"
_DATETIME_SORTS = {"last_used", "created"}


def utcnow() -> datetime:
    """Aware UTC now (the catalog stores UTC only)."""
    return datetime.now(UTC)


class Catalog:
    """The SQL index of the cache. Every method is one short transaction.

    Fleet rule: writes and the eviction/reconcile reads touch only this catalog's ``node``
    (its own disk); listings, events and stats take a ``node`` filter. Rows changed inside a
    write transaction are read ``FOR UPDATE`` (a row lock on PostgreSQL; SQLite's
    ``BEGIN IMMEDIATE`` already serialises writers).
    """

    def __init__(self, url: str, *, node: str) -> None:
        self.url = url
        self.node = node
        #: Up/down state of the database (``/health``); fed by the engine's error hooks.
        self.health = CatalogHealth(self.backend_name(url))
        self.engine = create_catalog_engine(url, self.health)
        self._read = sessionmaker(self.engine, expire_on_commit=False)
        self._write_engine = self.engine.execution_options(sqlite_immediate=True)
        self._write = sessionmaker(self._write_engine, expire_on_commit=False)
        # Changes this process made without an event (``touch``), folded into ``version()``.
        self._untracked_changes = 0

    # -- lifecycle -------------------------------------------------------------------------

    def upgrade(self, revision: str = "head") -> None:
        """Bring the schema to ``revision`` with Alembic (the app does this on start)."""
        from cachesvc.catalog.migrate import upgrade

        upgrade(self.engine, revision)

    def current_revision(self) -> str | None:
        """The schema revision the database is at (None when never migrated)."""
        from cachesvc.catalog.migrate import current_revision

        return current_revision(self.engine)

    def close(self) -> None:
        """Dispose of pooled connections."""
        self.engine.dispose()

    @staticmethod
    def backend_name(url: str) -> str:
        """``sqlite`` or ``postgresql`` (the SQLAlchemy backend of ``url``)."""
        return make_url(url).get_backend_name()

    def ping(self) -> None:
        """One write transaction that changes nothing: raises :class:`CatalogUnavailableError`
        when the database cannot take a write now (a server down, or on SQLite another process
        holding the write lock past the busy timeout)."""
        with self._tx() as session:
            session.execute(select(literal(1)))

    def state(self) -> CatalogState:
        """Whether the database answered the last operation (``/health``)."""
        return self.health.state()

    @contextmanager
    def _tx(self) -> Iterator[Session]:
        with self._write() as session, session.begin():
            yield session

    # -- events ----------------------------------------------------------------------------

    def _add_event(
        self,
        session: Session,
        kind: str,
        *,
        bundle_id: str | None = None,
        checkpoint_digest: str | None = None,
        model: str | None = None,
        reason: str | None = None,
        nbytes: int | None = None,
        seconds: float | None = None,
        detail: str | None = None,
        at: datetime | None = None,
    ) -> None:
        if kind not in EVENT_KINDS:
            raise ValueError(f"unknown event kind {kind!r}")
        at = at or utcnow()
        session.add(
            EventRow(
                at=at,
                kind=kind,
                bundle_id=bundle_id,
                checkpoint_digest=checkpoint_digest,
                model=model,
                reason=reason,
                bytes=nbytes,
                seconds=seconds,
                detail=detail,
                node=self.node,
            )
        )
        self._bump_total(session, kind, reason or "", model or "", nbytes or 0, seconds or 0.0, at)

    def _bump_total(
        self,
        session: Session,
        kind: str,
        reason: str,
        model: str,
        nbytes: int,
        seconds: float,
        at: datetime,
        *,
        node: str | None = None,
    ) -> None:
        node = node or self.node
        values = {
            "node": node,
            "kind": kind,
            "reason": reason,
            "model": model,
            "count": 1,
            "bytes": nbytes,
            "seconds": seconds,
            "first_at": at,
        }
        table = EventTotalRow.__table__
        assert isinstance(table, Table)
        dialect = session.get_bind().dialect.name
        if dialect in ("sqlite", "postgresql"):
            insert = sqlite.insert if dialect == "sqlite" else postgresql.insert
            stmt = insert(table).values(**values)
            stmt = stmt.on_conflict_do_update(
                index_elements=["node", "kind", "reason", "model"],
                set_={
                    "count": table.c.count + 1,
                    "bytes": table.c.bytes + nbytes,
                    "seconds": table.c.seconds + seconds,
                },
            )
            session.execute(stmt)
            return
        row = session.get(EventTotalRow, (node, kind, reason, model), with_for_update=True)
        if row is None:
            session.add(EventTotalRow(**values))
        else:
            row.count += 1
            row.bytes += nbytes
            row.seconds += seconds

    def add_event(self, kind: str, **fields: Any) -> None:
        """Append one event (and its running total) in its own transaction."""
        with self._tx() as session:
            self._add_event(session, kind, **fields)

    def prune_events(self, *, older_than: datetime | None, keep_rows: int | None) -> int:
        """Delete this node's events older than ``older_than`` and all but its ``keep_rows``
        newest; the running totals (counters, stats) stay. Returns how many rows went."""
        removed = 0
        with self._tx() as session:
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

    def events(
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
        with self._read() as session:
            return [_event_info(r) for r in session.scalars(stmt)]

    def version(self) -> int:
        """A number that grows with every change a listing can show (every such change is an event).

        The total of ``event_totals`` rather than ``max(events.id)``: ids can commit out of
        order on PostgreSQL, the total cannot go backwards once a transaction is visible.
        """
        with self.engine.connect() as conn:
            total = int(conn.scalar(select(func.coalesce(func.sum(EventTotalRow.count), 0))) or 0)
        return total + self._untracked_changes

    # -- checkpoints -----------------------------------------------------------------------

    def upsert_checkpoint(
        self, *, digest: str, source: str, path: Path, size_bytes: int, file_count: int
    ) -> None:
        """Record (or refresh) a resolved checkpoint; an unchanged one costs a read, not a write."""
        with self._read() as session:
            known = session.get(CheckpointRow, digest)
            if known is not None and (known.source, known.path, known.size_bytes, known.file_count) == (
                source,
                str(path),
                size_bytes,
                file_count,
            ):
                return
        with self._tx() as session:
            values = {
                "digest": digest,
                "source": source,
                "path": str(path),
                "size_bytes": size_bytes,
                "file_count": file_count,
                "resolved_at": utcnow(),
                "node": self.node,
            }
            table = CheckpointRow.__table__
            assert isinstance(table, Table)
            dialect = session.get_bind().dialect.name
            if dialect in ("sqlite", "postgresql"):
                # One statement: processes resolving the same checkpoint at once (eight
                # first starts on PostgreSQL) must not both insert.
                insert = sqlite.insert if dialect == "sqlite" else postgresql.insert
                stmt = insert(table).values(**values)
                session.execute(
                    stmt.on_conflict_do_update(
                        index_elements=["digest"], set_={k: stmt.excluded[k] for k in values if k != "digest"}
                    )
                )
                return
            row = session.get(CheckpointRow, digest, with_for_update=True)
            if row is None:
                session.add(CheckpointRow(**values))
            else:
                row.source, row.path, row.size_bytes, row.file_count = (
                    source,
                    str(path),
                    size_bytes,
                    file_count,
                )
                row.resolved_at = utcnow()

    def list_checkpoints(self) -> list[CheckpointInfo]:
        """Every resolved checkpoint with the ids of its bundles."""
        with self._read() as session:
            rows = session.scalars(select(CheckpointRow).order_by(CheckpointRow.resolved_at.desc())).all()
            by_digest: dict[str, list[str]] = {}
            for bid, digest in session.execute(select(BundleRow.id, BundleRow.checkpoint_digest)):
                by_digest.setdefault(digest, []).append(bid)
            return [
                CheckpointInfo(
                    digest=r.digest,
                    source=r.source,
                    path=Path(r.path),
                    size_bytes=r.size_bytes,
                    file_count=r.file_count,
                    resolved_at=r.resolved_at,
                    bundle_ids=tuple(sorted(by_digest.get(r.digest, []))),
                )
                for r in rows
            ]

    def checkpoint_row(self, digest: str) -> tuple[CheckpointInfo, str] | None:
        """One checkpoint (without bundle ids) and the node whose disk its path is on, or None."""
        with self._read() as session:
            r = session.get(CheckpointRow, digest)
            if r is None:
                return None
            info = CheckpointInfo(
                digest=r.digest,
                source=r.source,
                path=Path(r.path),
                size_bytes=r.size_bytes,
                file_count=r.file_count,
                resolved_at=r.resolved_at,
            )
            return info, r.node

    def checkpoint_bundles(self, digest: str) -> list[BundleInfo]:
        """Every node's bundles built from checkpoint ``digest``, or with it as their draft."""
        with self._read() as session:
            rows = session.scalars(
                select(BundleRow)
                .where(or_(BundleRow.checkpoint_digest == digest, BundleRow.draft_digest == digest))
                .order_by(BundleRow.id)
            ).all()
            return [_bundle_info(r) for r in rows]

    def delete_checkpoint(self, digest: str, *, nbytes: int, detail: str) -> bool:
        """Forget checkpoint ``digest`` (its files are the caller's business); a ``checkpoint_rm``
        event with the bytes deleted and what happened to the files. False when it was gone."""
        with self._tx() as session:
            row = session.get(CheckpointRow, digest, with_for_update=True)
            if row is None:
                return False
            self._add_event(
                session, "checkpoint_rm", checkpoint_digest=digest, model=row.source, nbytes=nbytes,
                detail=detail,
            )
            session.delete(row)
            return True

    def checkpoint_count(self) -> int:
        """Number of resolved checkpoints."""
        with self._read() as session:
            return int(session.scalar(select(func.count()).select_from(CheckpointRow)) or 0)

    # -- bundles ---------------------------------------------------------------------------

    def get_bundle(self, bundle_id: str) -> BundleInfo | None:
        """This node's bundle, or None."""
        with self._read() as session:
            row = session.get(BundleRow, (bundle_id, self.node))
            return None if row is None else _bundle_info(row)

    def require_bundle(self, bundle_id: str, *, node: str | None = None) -> BundleInfo:
        """This node's bundle (or ``node``'s), or NotFoundError."""
        with self._read() as session:
            return _bundle_info(_require(session, bundle_id, node or self.node, lock=False))

    def begin_build(self, key: BundleKey, *, model: str) -> None:
        """Insert (or reset) the row of a bundle about to be built: state ``building``; a miss event."""
        now = utcnow()
        bundle_id = key.id
        with self._tx() as session:
            row = session.get(BundleRow, (bundle_id, self.node), with_for_update=True)
            if row is None:
                row = BundleRow(id=bundle_id, node=self.node, created_at=now, hit_count=0, pinned=False)
                session.add(row)
            row.model, row.checkpoint_digest = model, key.checkpoint_digest
            row.draft_digest, row.profile, row.profile_name = key.draft_digest, dict(key.profile), key.name
            row.backend, row.path = key.backend, str(key.relpath)
            row.size_bytes, row.file_count, row.state, row.error = 0, 0, "building", None
            row.last_used_at, row.node = now, self.node
            self._add_event(
                session, "miss", bundle_id=bundle_id, checkpoint_digest=key.checkpoint_digest, model=model
            )

    def finish_build(self, bundle_id: str, *, size_bytes: int, file_count: int, seconds: float) -> BundleInfo:
        """Mark a build ready (after its directory was published); a build_ok event."""
        now = utcnow()
        with self._tx() as session:
            row = _require(session, bundle_id, self.node)
            row.state, row.size_bytes, row.file_count = "ready", size_bytes, file_count
            row.built_at, row.build_seconds, row.last_used_at, row.last_verified_at = now, seconds, now, now
            row.error = None
            self._add_event(
                session,
                "build_ok",
                bundle_id=bundle_id,
                checkpoint_digest=row.checkpoint_digest,
                model=row.model,
                nbytes=size_bytes,
                seconds=seconds,
            )
            # Histogram of build durations as running totals (one row per bucket), so stats
            # and /metrics never read the build events themselves.
            bound = next((b for b in BUILD_SECONDS_BUCKETS if seconds <= b), math.inf)
            self._bump_total(session, _BUCKET_KIND, repr(float(bound)), "", 0, seconds, utcnow())
            return _bundle_info(row)

    def fail_build(self, bundle_id: str, *, error: str, seconds: float) -> None:
        """A build failed or was interrupted (nothing was published): a build_failed event with
        the error, and the row goes.

        A row promises a directory: a kept ``failed`` row would list a path that does not exist
        and count in stats. The failure itself stays in the event log (and in the build status).
        """
        with self._tx() as session:
            row = session.get(BundleRow, (bundle_id, self.node), with_for_update=True)
            if row is None:
                return
            session.delete(row)
            self._add_event(
                session,
                "build_failed",
                bundle_id=bundle_id,
                checkpoint_digest=row.checkpoint_digest,
                model=row.model,
                seconds=seconds,
                detail=error[:4000],
            )

    def record_hit(self, bundle_id: str) -> BundleInfo:
        """A cache hit: last_used_at = now, hit_count + 1, a hit event."""
        with self._tx() as session:
            row = _require(session, bundle_id, self.node)
            row.hit_count += 1
            row.last_used_at = utcnow()
            self._add_event(
                session, "hit", bundle_id=bundle_id, checkpoint_digest=row.checkpoint_digest, model=row.model
            )
            return _bundle_info(row)

    def set_pinned(self, bundle_id: str, pinned: bool) -> BundleInfo:
        """Pin or unpin; an event when it changes."""
        with self._tx() as session:
            row = _require(session, bundle_id, self.node)
            if row.pinned != pinned:
                row.pinned = pinned
                self._add_event(session, "pin" if pinned else "unpin", bundle_id=bundle_id, model=row.model)
            return _bundle_info(row)

    def set_verified(
        self, bundle_id: str, *, ok: bool, detail: str | None, stale: str | None = None
    ) -> BundleInfo:
        """Record a verify: a mismatch marks the bundle corrupt; files that match but were built
        for another environment (``stale`` says why) mark it stale; a clean verify makes a
        corrupt or stale bundle ready again."""
        with self._tx() as session:
            row = _require(session, bundle_id, self.node)
            row.last_verified_at = utcnow()
            if not ok:
                row.state, row.error = "corrupt", detail
            elif stale is not None:
                row.state, row.error = "stale", stale
            elif row.state in ("corrupt", "stale"):
                row.state, row.error = "ready", None
            self._add_event(
                session,
                "verify",
                bundle_id=bundle_id,
                model=row.model,
                reason="corrupt" if not ok else "stale" if stale is not None else "ok",
                detail=detail if not ok else stale,
            )
            return _bundle_info(row)

    def set_stale(self, bundle_id: str, reason: str | None) -> BundleInfo:
        """``reason`` given: a ready bundle becomes ``stale`` (error = why); None: a stale bundle is
        ``ready`` again. A ``reconcile`` event (reason ``stale``/``ready``) when the state changes;
        other states (building, failed, corrupt) are left as they are."""
        with self._tx() as session:
            row = _require(session, bundle_id, self.node)
            if reason is not None and row.state == "ready":
                row.state, row.error = "stale", reason
            elif reason is None and row.state == "stale":
                row.state, row.error = "ready", None
            else:
                return _bundle_info(row)
            self._add_event(
                session,
                "reconcile",
                bundle_id=bundle_id,
                model=row.model,
                reason=row.state,
                detail=reason or "the GPU and TensorRT version it was built for are back",
            )
            return _bundle_info(row)

    def delete_bundle(self, bundle_id: str, *, reason: str, nbytes: int, detail: str | None = None) -> None:
        """Forget a bundle whose directory is gone; an evict event with the reason and bytes."""
        with self._tx() as session:
            row = session.get(BundleRow, (bundle_id, self.node), with_for_update=True)
            if row is None:
                return
            self._add_event(
                session,
                "evict",
                bundle_id=bundle_id,
                checkpoint_digest=row.checkpoint_digest,
                model=row.model,
                reason=reason,
                nbytes=nbytes,
                detail=detail,
            )
            session.delete(row)

    def forget_bundle(self, bundle_id: str) -> None:
        """Delete a row without an event (its story is in the log already, e.g. a failed build)."""
        with self._tx() as session:
            row = session.get(BundleRow, (bundle_id, self.node), with_for_update=True)
            if row is not None:
                session.delete(row)

    def adopt_bundle(
        self, key: BundleKey, *, model: str, size_bytes: int, file_count: int, built_at: datetime
    ) -> None:
        """Insert a ready row for a published directory the catalog did not know."""
        now = utcnow()
        bundle_id, checkpoint_digest, draft_digest = key.id, key.checkpoint_digest, key.draft_digest
        profile, profile_name, backend, path = dict(key.profile), key.name, key.backend, key.relpath
        with self._tx() as session:
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
            self._add_event(
                session, "reconcile", bundle_id=bundle_id, model=model, reason="adopted", nbytes=size_bytes
            )

    def all_bundles(self, *, states: Sequence[str] | None = None) -> list[BundleInfo]:
        """Every bundle of this node (optionally of some states), least recently used first."""
        stmt = (
            select(BundleRow)
            .where(BundleRow.node == self.node)
            .order_by(BundleRow.last_used_at.asc(), BundleRow.id.asc())
        )
        if states is not None:
            stmt = stmt.where(BundleRow.state.in_(list(states)))
        with self._read() as session:
            return [_bundle_info(r) for r in session.scalars(stmt)]

    def eviction_candidates(
        self, *, limit: int = 512, after: tuple[datetime, str] | None = None
    ) -> list[tuple[str, int, datetime, bool, str]]:
        """(id, size, last_used_at, pinned, path) of evictable bundles, LRU first, one keyset page.

        Stale bundles are not among them: the planner takes those first (``stale_bundles``).
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
        with self._read() as session:
            return [(r[0], int(r[1]), r[2], bool(r[3]), r[4]) for r in session.execute(stmt)]

    def total_size(self) -> int:
        """Sum of catalog sizes of this node's bundles (no directory walks)."""
        with self._read() as session:
            return int(
                session.scalar(
                    select(func.coalesce(func.sum(BundleRow.size_bytes), 0)).where(
                        BundleRow.node == self.node
                    )
                )
                or 0
            )

    def list_bundles(
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
        with self.engine.connect() as session:
            rows = list(session.execute(stmt))
            total, total_bytes = session.execute(
                select(func.count(), func.coalesce(func.sum(BundleRow.size_bytes), 0))
                .select_from(BundleRow)
                .where(*conds)
            ).one()
        more = len(rows) > limit
        rows = rows[:limit]
        items = tuple(_bundle_info(r) for r in rows)
        next_cursor = _encode_cursor(rows[-1], sort) if more and rows else None
        next_offset = (offset or 0) + len(rows) if more and cursor is None else None
        return BundlePage(
            items=items,
            total=int(total),
            total_bytes=int(total_bytes),
            next_cursor=next_cursor,
            next_offset=next_offset,
        )

    # -- leases (display only) -------------------------------------------------------------

    def add_lease(self, bundle_id: str, pid: int) -> None:
        """Record that this node's ``pid`` serves ``bundle_id``."""
        with self._tx() as session:
            session.execute(
                delete(LeaseRow).where(
                    LeaseRow.bundle_id == bundle_id, LeaseRow.node == self.node, LeaseRow.pid == pid
                )
            )
            session.add(LeaseRow(bundle_id=bundle_id, node=self.node, pid=pid, since=utcnow()))

    def remove_lease(self, bundle_id: str, pid: int) -> None:
        """Forget this node's ``pid`` as a holder of ``bundle_id``."""
        with self._tx() as session:
            session.execute(
                delete(LeaseRow).where(
                    LeaseRow.bundle_id == bundle_id, LeaseRow.node == self.node, LeaseRow.pid == pid
                )
            )

    # -- aliases ---------------------------------------------------------------------------

    def set_alias(self, name: str, *, bundle_id: str | None = None, model: str | None = None) -> AliasInfo:
        """Create or replace the alias ``name`` (exactly one of ``bundle_id``, ``model``)."""
        if (bundle_id is None) == (model is None):
            raise ConfigError("bundle_id", "give exactly one of bundle_id and model")
        with self._tx() as session:
            row = session.get(AliasRow, name)
            if row is None:
                row = AliasRow(name=name, created_at=utcnow())
                session.add(row)
            row.bundle_id, row.model = bundle_id, model
            return AliasInfo(name=name, bundle_id=bundle_id, model=model, created_at=row.created_at)

    def remove_alias(self, name: str) -> None:
        """Delete the alias ``name`` (NotFoundError when there is none)."""
        with self._tx() as session:
            row = session.get(AliasRow, name)
            if row is None:
                raise NotFoundError(f"no model alias named {name!r}")
            session.delete(row)

    def aliases(self) -> list[AliasInfo]:
        """Every alias, by name."""
        with self._read() as session:
            rows = session.scalars(select(AliasRow).order_by(AliasRow.name)).all()
            return [
                AliasInfo(name=r.name, bundle_id=r.bundle_id, model=r.model, created_at=r.created_at)
                for r in rows
            ]

    def leases(self, bundle_id: str, *, node: str | None = None) -> list[LeaseHolder]:
        """Recorded holders of this node's (or ``node``'s) copy of a bundle (rows may be stale)."""
        with self._read() as session:
            rows = session.scalars(
                select(LeaseRow)
                .where(LeaseRow.bundle_id == bundle_id, LeaseRow.node == (node or self.node))
                .order_by(LeaseRow.since)
            )
            return [LeaseHolder(pid=r.pid, host=r.node, since=r.since.isoformat()) for r in rows]

    def drop_stale_leases(self, bundle_id: str, live_pids: set[int]) -> None:
        """Delete this node's lease rows whose process no longer holds the lock."""
        with self._tx() as session:
            stmt = delete(LeaseRow).where(LeaseRow.bundle_id == bundle_id, LeaseRow.node == self.node)
            if live_pids:
                stmt = stmt.where(LeaseRow.pid.not_in(sorted(live_pids)))
            session.execute(stmt)

    # -- stats -----------------------------------------------------------------------------

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
        with self.engine.connect() as session:
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
            since = session.scalar(select(func.min(t.first_at)).where(t.kind != _BUCKET_KIND, *on_node))
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
            median = None
            if builds_ok:
                # The middle one or two durations through the (kind, seconds) index.
                ordered = (
                    select(EventRow.seconds)
                    .where(EventRow.kind == "build_ok", EventRow.seconds.is_not(None), *event_on_node)
                    .order_by(EventRow.seconds)
                )
                middle = [
                    float(v or 0.0)
                    for v in session.scalars(ordered.offset((builds_ok - 1) // 2).limit(2 - builds_ok % 2))
                ]
                median = sum(middle) / len(middle) if middle else None
            checkpoints = int(session.scalar(select(func.count()).select_from(CheckpointRow)) or 0)
        hits = misses = builds_failed = 0
        evictions: dict[str, int] = {}
        evicted_bytes: dict[str, int] = {}
        per_model: dict[str, list[int]] = {}
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
            elif kind == _BUCKET_KIND:
                buckets[float(reason)] = count
                build_sum += float(seconds)
        for model, kind, count in model_totals:
            slot = per_model.setdefault(model, [0, 0, 0, 0])
            slot[2 if kind == "hit" else 3] += int(count)
        size_bytes = 0
        for model, count, nbytes in model_rows:
            slot = per_model.setdefault(model, [0, 0, 0, 0])
            slot[0], slot[1] = int(count), int(nbytes)
            size_bytes += int(nbytes)
        cumulative: list[tuple[float, int]] = []
        running = 0
        for bound in (*BUILD_SECONDS_BUCKETS, math.inf):
            running += buckets.get(float(bound), 0)
            cumulative.append((float(bound), running))
        return CacheStats(
            size_bytes=size_bytes,
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
            per_model=tuple(
                ModelStats(model=m, bundles=v[0], size_bytes=v[1], hits=v[2], misses=v[3])
                for m, v in sorted(per_model.items())
            ),
            since=since,
            build_buckets=tuple(cumulative),
            build_seconds_sum=build_sum,
        )

    def rebuild_totals(self) -> None:
        """Recompute ``event_totals`` from the events (repair, bulk imports, benchmarks)."""
        reason = func.coalesce(EventRow.reason, "")
        model = func.coalesce(EventRow.model, "")
        with self._tx() as session:
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
                self._bump_total(
                    session, _BUCKET_KIND, repr(float(bound)), "", 0, duration, utcnow(), node=event_node
                )

    def touch(self, bundle_id: str, at: datetime) -> None:
        """Set last_used_at (tests and benchmarks arrange LRU order with it; no event)."""
        self._untracked_changes += 1
        with self._tx() as session:
            session.execute(
                update(BundleRow)
                .where(BundleRow.id == bundle_id, BundleRow.node == self.node)
                .values(last_used_at=at)
            )


def _require(session: Session, bundle_id: str, node: str, *, lock: bool = True) -> BundleRow:
    """The row of ``bundle_id`` on ``node``; locked for update inside write transactions."""
    row = session.get(BundleRow, (bundle_id, node), with_for_update=True if lock else None)
    if row is None:
        raise NotFoundError(f"no bundle with id {bundle_id!r} (list them with `cachesvc bundles ls`)")
    return row


def _bundle_info(r: Any) -> BundleInfo:
    """From an ORM row or a plain result row with the same column names."""
    return BundleInfo(
        id=r.id,
        model=r.model,
        checkpoint_digest=r.checkpoint_digest,
        draft_digest=r.draft_digest,
        profile=dict(r.profile),
        profile_name=r.profile_name,
        backend=r.backend,
        path=Path(r.path),
        size_bytes=int(r.size_bytes),
        file_count=int(r.file_count),
        state=r.state,
        created_at=r.created_at,
        built_at=r.built_at,
        build_seconds=r.build_seconds,
        last_used_at=r.last_used_at,
        hit_count=int(r.hit_count),
        pinned=bool(r.pinned),
        last_verified_at=r.last_verified_at,
        error=r.error,
        node=r.node,
    )


def _event_info(r: EventRow) -> EventInfo:
    return EventInfo(
        id=int(r.id),
        at=r.at,
        kind=r.kind,
        bundle_id=r.bundle_id,
        checkpoint_digest=r.checkpoint_digest,
        model=r.model,
        reason=r.reason,
        bytes=r.bytes,
        seconds=r.seconds,
        detail=r.detail,
        node=r.node,
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
