"""The ``adapters`` table: LoRA adapters converted into this node's cache (digest, source, the
converted file's path relative to the cache root, rank, targets, size, pin, last use)."""

from __future__ import annotations

from datetime import datetime
from pathlib import Path
from typing import Any

from sqlalchemy import func, select, update
from sqlalchemy.exc import IntegrityError

from cachesvc.cache.catalog.base import CatalogTable, utcnow
from cachesvc.cache.catalog.models import AdapterRow
from cachesvc.cache.records import AdapterInfo
from cachesvc.errors import NotFoundError

#: (id, size, last_used_at, pinned, path) of an adapter eviction candidate, as for bundles.
AdapterCandidate = tuple[str, int, datetime, bool, str]


class AdapterTable(CatalogTable):
    """Record, list, touch, pin and forget this node's converted adapters.

    Paths in the records this table returns are relative to the cache root (as in the rows);
    the manager's ``adapters`` section hands out absolute ones."""

    def add(
        self, *, adapter_id: str, digest: str, source: str, path: Path, rank: int,
        targets: tuple[str, ...], size_bytes: int,
    ) -> tuple[AdapterInfo, bool]:
        """Record a converted adapter (an ``adapter_add`` event); ``(row, True)``, or the row
        already there and False (another process converted it first: no second event)."""
        now = utcnow()
        try:
            with self.core.tx() as session:
                known = session.get(AdapterRow, (adapter_id, self.node), with_for_update=True)
                if known is not None:
                    return adapter_info(known), False
                row = AdapterRow(
                    id=adapter_id, digest=digest, source=source, path=Path(path).as_posix(), rank=rank,
                    targets=list(targets), size_bytes=size_bytes, pinned=False, created_at=now,
                    last_used_at=now, node=self.node,
                )
                session.add(row)
                self.core.add_event(session, "adapter_add", checkpoint_digest=digest, model=source,
                                nbytes=size_bytes, detail=f"adapter {adapter_id} (rank {rank})")
                session.flush()
                return adapter_info(row), True
        except IntegrityError:  # inserted by another process between our read and our insert
            known_info = self.get(adapter_id)
            if known_info is None:
                raise
            return known_info, False

    def get(self, adapter_id: str) -> AdapterInfo | None:
        """This node's row of ``adapter_id``, or None."""
        with self.core.read() as session:
            row = session.get(AdapterRow, (adapter_id, self.node))
            return None if row is None else adapter_info(row)

    def require(self, adapter_id: str) -> AdapterInfo:
        """This node's row of ``adapter_id`` (NotFoundError when there is none)."""
        info = self.get(adapter_id)
        if info is None:
            raise NotFoundError(
                f"no LoRA adapter with id {adapter_id!r} (list them with `cachesvc adapters ls`)"
            )
        return info

    def all(self) -> list[AdapterInfo]:
        """This node's adapters, most recently used first."""
        with self.core.read() as session:
            rows = session.scalars(
                select(AdapterRow)
                .where(AdapterRow.node == self.node)
                .order_by(AdapterRow.last_used_at.desc(), AdapterRow.id)
            ).all()
            return [adapter_info(r) for r in rows]

    def touch(self, adapter_id: str, at: datetime | None = None) -> None:
        """Set ``last_used_at`` (now by default): the adapter was used. No event."""
        self.core.untracked_changes += 1
        with self.core.tx() as session:
            done = session.execute(
                update(AdapterRow)
                .where(AdapterRow.id == adapter_id, AdapterRow.node == self.node)
                .values(last_used_at=at or utcnow())
            )
            if getattr(done, "rowcount", 1) == 0:
                raise NotFoundError(f"no LoRA adapter with id {adapter_id!r}")

    def set_pinned(self, adapter_id: str, pinned: bool) -> AdapterInfo:
        """Pin or unpin an adapter; an ``adapter_pin``/``adapter_unpin`` event when it changes."""
        with self.core.tx() as session:
            row = session.get(AdapterRow, (adapter_id, self.node), with_for_update=True)
            if row is None:
                raise NotFoundError(
                    f"no LoRA adapter with id {adapter_id!r} (list them with `cachesvc adapters ls`)"
                )
            if row.pinned != pinned:
                row.pinned = pinned
                self.core.add_event(session, "adapter_pin" if pinned else "adapter_unpin",
                                checkpoint_digest=row.digest, model=row.source, detail=f"adapter {row.id}")
            return adapter_info(row)

    def delete(self, adapter_id: str, *, reason: str, nbytes: int, detail: str | None = None) -> bool:
        """Forget an adapter (its file is the caller's business): an ``adapter_rm`` event with
        ``reason`` (an eviction reason) and the bytes freed. False when it was gone."""
        with self.core.tx() as session:
            row = session.get(AdapterRow, (adapter_id, self.node), with_for_update=True)
            if row is None:
                return False
            self.core.add_event(session, "adapter_rm", checkpoint_digest=row.digest, model=row.source,
                            reason=reason, nbytes=nbytes, detail=detail or f"adapter {adapter_id}")
            session.delete(row)
            return True

    def total_size(self) -> int:
        """Bytes of this node's converted adapter files (catalog sizes, no walk)."""
        with self.core.read() as session:
            return int(
                session.scalar(
                    select(func.coalesce(func.sum(AdapterRow.size_bytes), 0))
                    .where(AdapterRow.node == self.node)
                )
                or 0
            )

    def eviction_candidates(self) -> list[AdapterCandidate]:
        """(id, size, last_used_at, pinned, path) of this node's adapters, least recently used
        first (few rows: read at once)."""
        stmt = (
            select(AdapterRow.id, AdapterRow.size_bytes, AdapterRow.last_used_at, AdapterRow.pinned,
                   AdapterRow.path)
            .where(AdapterRow.node == self.node)
            .order_by(AdapterRow.last_used_at.asc(), AdapterRow.id.asc())
        )
        with self.core.read() as session:
            return [(r[0], int(r[1]), r[2], bool(r[3]), r[4]) for r in session.execute(stmt)]


def adapter_info(r: Any) -> AdapterInfo:
    """From an ORM row (path relative to the cache root)."""
    return AdapterInfo(
        id=r.id,
        digest=r.digest,
        source=r.source,
        path=Path(r.path),
        rank=int(r.rank),
        targets=tuple(r.targets),
        size_bytes=int(r.size_bytes),
        pinned=bool(r.pinned),
        created_at=r.created_at,
        last_used_at=r.last_used_at,
        node=r.node,
    )
