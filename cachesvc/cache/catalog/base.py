"""What every catalog table's repository shares: the engine and its sessions, this node's name,
the row lock of a bundle, and the event written in the same transaction as the change it records.

One repository object per table (``bundles``, ``checkpoints``, ``events``, ``leases``,
``aliases``, ``adapters``; the fleet's tables in :mod:`cachesvc.cache.catalog.fleet`), each a
:class:`CatalogTable` holding the one :class:`CatalogCore` of its database;
:class:`cachesvc.cache.catalog.Catalog` holds them all as attributes (``catalog.bundles`` …).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from sqlalchemy import Table
from sqlalchemy.dialects import postgresql, sqlite
from sqlalchemy.engine import make_url
from sqlalchemy.orm import Session, sessionmaker

from cachesvc.cache.catalog.health import CatalogHealth
from cachesvc.cache.catalog.models import BundleRow, EventRow, EventTotalRow
from cachesvc.cache.catalog.session import create_catalog_engine
from cachesvc.cache.records import EVENT_KINDS, BundleInfo, EventInfo
from cachesvc.errors import NotFoundError

#: event_totals kind of the build-duration histogram rows (not an event kind of its own).
BUCKET_KIND = "build_bucket"


def utcnow() -> datetime:
    """Aware UTC now (the catalog stores UTC only)."""
    return datetime.now(UTC)

class CatalogCore:
    """The database connection of the catalog and the helpers its table repositories share.

    Every public method of a repository is one short transaction: ``tx`` (a write; SQLite's
    ``BEGIN IMMEDIATE``) or ``read``. Rows changed inside a write transaction are read
    ``FOR UPDATE`` (``lock_bundle``): a row lock on PostgreSQL.
    """

    def __init__(self, url: str, *, node: str) -> None:
        self.url = url
        self.node = node
        #: Up/down state of the database (``/health``); fed by the engine's error hooks.
        self.health = CatalogHealth(self.backend_name(url))
        self.engine = create_catalog_engine(url, self.health)
        #: A read session (``with core.read() as session``).
        self.read = sessionmaker(self.engine, expire_on_commit=False)
        self._write_engine = self.engine.execution_options(sqlite_immediate=True)
        self._write = sessionmaker(self._write_engine, expire_on_commit=False)
        #: Changes this process made without an event (``touch``), folded into ``version()``.
        self.untracked_changes = 0

    @staticmethod
    def backend_name(url: str) -> str:
        """``sqlite`` or ``postgresql`` (the SQLAlchemy backend of ``url``)."""
        return make_url(url).get_backend_name()

    @contextmanager
    def tx(self) -> Iterator[Session]:
        """A write transaction (SQLite: ``BEGIN IMMEDIATE``), committed on leaving the block."""
        with self._write() as session, session.begin():
            yield session

    def lock_bundle(self, session: Session, bundle_id: str) -> BundleRow | None:
        """This node's row of ``bundle_id`` locked for update, or None."""
        return session.get(BundleRow, (bundle_id, self.node), with_for_update=True)

    def bundle_event(self, session: Session, kind: str, row: BundleRow, **fields: Any) -> None:
        """An event about ``row``'s bundle (its id, checkpoint and model) in ``session``'s transaction."""
        digest, model = row.checkpoint_digest, row.model
        self.add_event(session, kind, bundle_id=row.id, checkpoint_digest=digest, model=model, **fields)

    def add_event(
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
        """An event (and its running total) in ``session``'s transaction."""
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
        self.bump_total(session, kind, reason or "", model or "", nbytes or 0, seconds or 0.0, at)

    def bump_total(
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
        """Add one event of ``kind`` to its running total (``event_totals``) in ``session``."""
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


class CatalogTable:
    """One table's repository: its queries and transitions over the shared :class:`CatalogCore`."""

    def __init__(self, core: CatalogCore) -> None:
        self.core = core

    @property
    def node(self) -> str:
        """This process's node name (every write touches only its rows)."""
        return self.core.node


def require_row(session: Session, bundle_id: str, node: str, *, lock: bool = True) -> BundleRow:
    """The row of ``bundle_id`` on ``node``; locked for update inside write transactions."""
    row = session.get(BundleRow, (bundle_id, node), with_for_update=True if lock else None)
    if row is None:
        raise NotFoundError(f"no bundle with id {bundle_id!r} (list them with `cachesvc bundles ls`)")
    return row


def bundle_info(r: Any) -> BundleInfo:
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


def event_info(r: EventRow) -> EventInfo:
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

