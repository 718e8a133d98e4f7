"""The ``checkpoints`` table: resolved checkpoints (digest, source, path) of this cache."""

from __future__ import annotations

from pathlib import Path

from sqlalchemy import Table, func, or_, select
from sqlalchemy.dialects import postgresql, sqlite

from cachesvc.cache.catalog.base import CatalogTable, bundle_info, utcnow
from cachesvc.cache.catalog.models import BundleRow, CheckpointRow
from cachesvc.cache.records import BundleInfo, CheckpointInfo


class CheckpointTable(CatalogTable):
    """Record, list and forget resolved checkpoints."""

    def upsert(
        self, *, digest: str, source: str, path: Path, size_bytes: int, file_count: int
    ) -> None:
        """Record (or refresh) a resolved checkpoint; an unchanged one costs a read, not a write."""
        with self.core.read() as session:
            known = session.get(CheckpointRow, digest)
            if known is not None and (known.source, known.path, known.size_bytes, known.file_count) == (
                source,
                str(path),
                size_bytes,
                file_count,
            ):
                return
        with self.core.tx() as session:
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

    def all(self) -> list[CheckpointInfo]:
        """Every resolved checkpoint with the ids of its bundles."""
        with self.core.read() as session:
            rows = session.scalars(select(CheckpointRow).order_by(CheckpointRow.resolved_at.desc())).all()
            by_digest: dict[str, list[str]] = {}
            for bid, digest in session.execute(select(BundleRow.id, BundleRow.checkpoint_digest)):
                by_digest.setdefault(digest, []).append(bid)
            return [_checkpoint_info(r, tuple(sorted(by_digest.get(r.digest, [])))) for r in rows]

    def get_with_node(self, digest: str) -> tuple[CheckpointInfo, str] | None:
        """One checkpoint (without bundle ids) and the node whose disk its path is on, or None."""
        with self.core.read() as session:
            r = session.get(CheckpointRow, digest)
            if r is None:
                return None
            return _checkpoint_info(r), r.node

    def bundles_of(self, digest: str) -> list[BundleInfo]:
        """Every node's bundles built from checkpoint ``digest``, or with it as their draft."""
        with self.core.read() as session:
            rows = session.scalars(
                select(BundleRow)
                .where(or_(BundleRow.checkpoint_digest == digest, BundleRow.draft_digest == digest))
                .order_by(BundleRow.id)
            ).all()
            return [bundle_info(r) for r in rows]

    def delete(self, digest: str, *, nbytes: int, detail: str) -> bool:
        """Forget checkpoint ``digest`` (its files are the caller's business); a ``checkpoint_rm``
        event with the bytes deleted and what happened to the files. False when it was gone."""
        with self.core.tx() as session:
            row = session.get(CheckpointRow, digest, with_for_update=True)
            if row is None:
                return False
            self.core.add_event(
                session, "checkpoint_rm", checkpoint_digest=digest, model=row.source, nbytes=nbytes,
                detail=detail,
            )
            session.delete(row)
            return True

    def count(self) -> int:
        """Number of resolved checkpoints."""
        with self.core.read() as session:
            return int(session.scalar(select(func.count()).select_from(CheckpointRow)) or 0)


def _checkpoint_info(r: CheckpointRow, bundle_ids: tuple[str, ...] = ()) -> CheckpointInfo:
    return CheckpointInfo(
        digest=r.digest,
        source=r.source,
        path=Path(r.path),
        size_bytes=r.size_bytes,
        file_count=r.file_count,
        resolved_at=r.resolved_at,
        bundle_ids=bundle_ids,
    )
