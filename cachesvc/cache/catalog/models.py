"""SQLAlchemy 2.0 models of the catalog. Schema changes only through Alembic migrations.

Portable across SQLite and PostgreSQL: no dialect-only SQL, UTC timestamps, named constraints.
"""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Any

from sqlalchemy import (
    JSON,
    BigInteger,
    Boolean,
    CheckConstraint,
    DateTime,
    Float,
    ForeignKeyConstraint,
    Index,
    Integer,
    MetaData,
    String,
    Text,
    UniqueConstraint,
)
from sqlalchemy.engine import Dialect
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column
from sqlalchemy.types import TypeDecorator

from cachesvc.cache.records import BUNDLE_STATES

NAMING_CONVENTION = {
    "ix": "ix_%(column_0_label)s",
    "uq": "uq_%(table_name)s_%(column_0_name)s",
    "ck": "ck_%(table_name)s_%(constraint_name)s",
    "fk": "fk_%(table_name)s_%(column_0_name)s_%(referred_table_name)s",
    "pk": "pk_%(table_name)s",
}

# SQLite has no 64-bit autoincrement type; INTEGER PRIMARY KEY is its rowid.
BigIntPK = BigInteger().with_variant(Integer(), "sqlite")


class UTCDateTime(TypeDecorator[datetime]):
    """Stores naive UTC, returns aware UTC, on every backend (SQLite drops the zone)."""

    impl = DateTime
    cache_ok = True

    def process_bind_param(self, value: datetime | None, dialect: Dialect) -> datetime | None:
        if value is None:
            return None
        if value.tzinfo is None:
            raise ValueError("naive datetimes are not stored; pass an aware UTC datetime")
        return value.astimezone(UTC).replace(tzinfo=None)

    def process_result_value(self, value: Any, dialect: Dialect) -> datetime | None:
        if value is None:
            return None
        if isinstance(value, str):  # pragma: no cover - defensive, SQLite returns datetime here
            value = datetime.fromisoformat(value)
        return value.replace(tzinfo=UTC)


class Base(DeclarativeBase):
    metadata = MetaData(naming_convention=NAMING_CONVENTION)


class CheckpointRow(Base):
    __tablename__ = "checkpoints"

    digest: Mapped[str] = mapped_column(String(64), primary_key=True)
    source: Mapped[str] = mapped_column(String(1024))
    path: Mapped[str] = mapped_column(Text)
    size_bytes: Mapped[int] = mapped_column(BigInteger, default=0)
    file_count: Mapped[int] = mapped_column(Integer, default=0)
    resolved_at: Mapped[datetime] = mapped_column(UTCDateTime())
    node: Mapped[str] = mapped_column(String(255))


class BundleRow(Base):
    """One bundle on one node: the same bundle id built on two nodes is two rows (two disks)."""

    __tablename__ = "bundles"
    __table_args__ = (
        CheckConstraint(f"state IN ({', '.join(repr(s) for s in BUNDLE_STATES)})", name="state"),
        CheckConstraint("size_bytes >= 0", name="size_nonneg"),
        Index("ix_bundles_state_last_used", "state", "last_used_at"),
        Index("ix_bundles_last_used_id", "last_used_at", "id"),
        Index("ix_bundles_size_id", "size_bytes", "id"),
        Index("ix_bundles_created_id", "created_at", "id"),
        Index("ix_bundles_hits_id", "hit_count", "id"),
        Index("ix_bundles_checkpoint_digest", "checkpoint_digest"),
        Index("ix_bundles_model_size", "model", "size_bytes"),
        Index("ix_bundles_node_last_used", "node", "last_used_at", "id"),
    )

    id: Mapped[str] = mapped_column(String(64), primary_key=True)
    model: Mapped[str] = mapped_column(String(1024))
    checkpoint_digest: Mapped[str] = mapped_column(String(64))
    draft_digest: Mapped[str | None] = mapped_column(String(64), nullable=True)
    profile: Mapped[dict[str, Any]] = mapped_column(JSON)
    profile_name: Mapped[str] = mapped_column(String(255))
    backend: Mapped[str] = mapped_column(String(32))
    path: Mapped[str] = mapped_column(Text)
    size_bytes: Mapped[int] = mapped_column(BigInteger, default=0)
    file_count: Mapped[int] = mapped_column(Integer, default=0)
    state: Mapped[str] = mapped_column(String(16))
    created_at: Mapped[datetime] = mapped_column(UTCDateTime())
    built_at: Mapped[datetime | None] = mapped_column(UTCDateTime(), nullable=True)
    build_seconds: Mapped[float | None] = mapped_column(Float, nullable=True)
    last_used_at: Mapped[datetime] = mapped_column(UTCDateTime())
    hit_count: Mapped[int] = mapped_column(BigInteger, default=0)
    pinned: Mapped[bool] = mapped_column(Boolean, default=False)
    last_verified_at: Mapped[datetime | None] = mapped_column(UTCDateTime(), nullable=True)
    error: Mapped[str | None] = mapped_column(Text, nullable=True)
    node: Mapped[str] = mapped_column(String(255), primary_key=True)


class AdapterRow(Base):
    """A LoRA adapter converted into one node's cache (the file is on that node's disk)."""

    __tablename__ = "adapters"
    __table_args__ = (
        CheckConstraint("size_bytes >= 0", name="size_nonneg"),
        Index("ix_adapters_node_last_used", "node", "last_used_at", "id"),
    )

    #: The first 16 hex digits of ``digest`` (the converted file's folder name).
    id: Mapped[str] = mapped_column(String(64), primary_key=True)
    digest: Mapped[str] = mapped_column(String(64))
    source: Mapped[str] = mapped_column(String(1024))
    #: The converted file, relative to the cache root.
    path: Mapped[str] = mapped_column(Text)
    rank: Mapped[int] = mapped_column(Integer)
    targets: Mapped[list[Any]] = mapped_column(JSON)
    size_bytes: Mapped[int] = mapped_column(BigInteger, default=0)
    pinned: Mapped[bool] = mapped_column(Boolean, default=False)
    created_at: Mapped[datetime] = mapped_column(UTCDateTime())
    last_used_at: Mapped[datetime] = mapped_column(UTCDateTime())
    node: Mapped[str] = mapped_column(String(255), primary_key=True)


class LeaseRow(Base):
    """Who serves a bundle, for display. The shared file lock is the truth; rows can go stale."""

    __tablename__ = "leases"
    __table_args__ = (
        UniqueConstraint("bundle_id", "node", "pid", name="uq_leases_holder"),
        ForeignKeyConstraint(["bundle_id", "node"], ["bundles.id", "bundles.node"], ondelete="CASCADE"),
    )

    id: Mapped[int] = mapped_column(BigIntPK, primary_key=True, autoincrement=True)
    bundle_id: Mapped[str] = mapped_column(String(64), index=True)
    node: Mapped[str] = mapped_column(String(255))
    pid: Mapped[int] = mapped_column(Integer)
    since: Mapped[datetime] = mapped_column(UTCDateTime())


class AliasRow(Base):
    """A served model name an operator gave a bundle (``bundle_id``) or a checkpoint (``model``:
    its most recently used ready bundle). Exactly one target is set."""

    __tablename__ = "model_aliases"
    __table_args__ = (
        CheckConstraint("(bundle_id IS NULL) <> (model IS NULL)", name="one_target"),
    )

    name: Mapped[str] = mapped_column(String(255), primary_key=True)
    bundle_id: Mapped[str | None] = mapped_column(String(64), nullable=True)
    model: Mapped[str | None] = mapped_column(String(1024), nullable=True)
    created_at: Mapped[datetime] = mapped_column(UTCDateTime())


class EventRow(Base):
    """Append-only audit log; feeds stats (through ``event_totals``) and ``/admin/events``."""

    __tablename__ = "events"
    __table_args__ = (
        Index("ix_events_kind_id", "kind", "id"),
        Index("ix_events_kind_seconds", "kind", "seconds"),
        Index("ix_events_bundle_id", "bundle_id", "id"),
        Index("ix_events_at", "at"),
    )

    id: Mapped[int] = mapped_column(BigIntPK, primary_key=True, autoincrement=True)
    at: Mapped[datetime] = mapped_column(UTCDateTime())
    kind: Mapped[str] = mapped_column(String(32))
    bundle_id: Mapped[str | None] = mapped_column(String(64), nullable=True)
    checkpoint_digest: Mapped[str | None] = mapped_column(String(64), nullable=True)
    model: Mapped[str | None] = mapped_column(String(1024), nullable=True)
    reason: Mapped[str | None] = mapped_column(String(16), nullable=True)
    bytes: Mapped[int | None] = mapped_column(BigInteger, nullable=True)
    seconds: Mapped[float | None] = mapped_column(Float, nullable=True)
    detail: Mapped[str | None] = mapped_column(Text, nullable=True)
    node: Mapped[str] = mapped_column(String(255))


class EventTotalRow(Base):
    """Running totals of events by (node, kind, reason, model), written in the event's transaction.

    Stats read these few rows instead of scanning the events table, so they stay fast with
    millions of events and still agree exactly with the log.
    """

    __tablename__ = "event_totals"

    node: Mapped[str] = mapped_column(String(255), primary_key=True)
    kind: Mapped[str] = mapped_column(String(32), primary_key=True)
    reason: Mapped[str] = mapped_column(String(16), primary_key=True)
    model: Mapped[str] = mapped_column(String(1024), primary_key=True)
    count: Mapped[int] = mapped_column(BigInteger, default=0)
    bytes: Mapped[int] = mapped_column(BigInteger, default=0)
    seconds: Mapped[float] = mapped_column(Float, default=0.0)
    first_at: Mapped[datetime] = mapped_column(UTCDateTime())


class NodeRow(Base):
    """A node of the fleet: its heartbeat and what it last reported about its own cache.

    Each serving process upserts its node's row every few seconds; a row whose heartbeat is
    older than the staleness limit is shown as down. No node deletes another node's rows.
    """

    __tablename__ = "nodes"

    name: Mapped[str] = mapped_column(String(255), primary_key=True)
    started_at: Mapped[datetime] = mapped_column(UTCDateTime())
    heartbeat_at: Mapped[datetime] = mapped_column(UTCDateTime())
    pid: Mapped[int] = mapped_column(Integer)
    max_size_bytes: Mapped[int] = mapped_column(BigInteger)
    #: The node's heartbeat interval: it is down after STALE_INTERVALS of them without one.
    heartbeat_seconds: Mapped[float] = mapped_column(Float)
    loaded_models: Mapped[list[Any]] = mapped_column(JSON)
    #: The reconciler's last report: {"generation", "state", "items": [...]} (or null).
    desired_status: Mapped[dict[str, Any] | None] = mapped_column(JSON, nullable=True)


class DesiredStateRow(Base):
    """Desired state of one node, or of the whole fleet under the name ``*``."""

    __tablename__ = "desired_state"

    node: Mapped[str] = mapped_column(String(255), primary_key=True)
    spec: Mapped[dict[str, Any]] = mapped_column(JSON)
    generation: Mapped[int] = mapped_column(BigInteger)
    updated_at: Mapped[datetime] = mapped_column(UTCDateTime())
