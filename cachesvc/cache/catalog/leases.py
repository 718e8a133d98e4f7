"""The ``leases`` table: which process serves which bundle (display only; the lock files are
the truth, reconcile drops rows whose process is gone)."""

from __future__ import annotations

from sqlalchemy import delete, select

from cachesvc.cache.catalog.base import CatalogTable, utcnow
from cachesvc.cache.catalog.models import LeaseRow
from cachesvc.cache.records import LeaseHolder


class LeaseTable(CatalogTable):
    """Add, remove and list lease rows."""

    def add(self, bundle_id: str, pid: int) -> None:
        """Record that this node's ``pid`` serves ``bundle_id``."""
        with self.core.tx() as session:
            session.execute(
                delete(LeaseRow).where(
                    LeaseRow.bundle_id == bundle_id, LeaseRow.node == self.node, LeaseRow.pid == pid
                )
            )
            session.add(LeaseRow(bundle_id=bundle_id, node=self.node, pid=pid, since=utcnow()))

    def remove(self, bundle_id: str, pid: int) -> None:
        """Forget this node's ``pid`` as a holder of ``bundle_id``."""
        with self.core.tx() as session:
            session.execute(
                delete(LeaseRow).where(
                    LeaseRow.bundle_id == bundle_id, LeaseRow.node == self.node, LeaseRow.pid == pid
                )
            )

    def holders(self, bundle_id: str, *, node: str | None = None) -> list[LeaseHolder]:
        """Recorded holders of this node's (or ``node``'s) copy of a bundle (rows may be stale)."""
        with self.core.read() as session:
            rows = session.scalars(
                select(LeaseRow)
                .where(LeaseRow.bundle_id == bundle_id, LeaseRow.node == (node or self.node))
                .order_by(LeaseRow.since)
            )
            return [LeaseHolder(pid=r.pid, host=r.node, since=r.since.isoformat()) for r in rows]

    def drop_stale(self, bundle_id: str, live_pids: set[int]) -> None:
        """Delete this node's lease rows whose process no longer holds the lock."""
        with self.core.tx() as session:
            stmt = delete(LeaseRow).where(LeaseRow.bundle_id == bundle_id, LeaseRow.node == self.node)
            if live_pids:
                stmt = stmt.where(LeaseRow.pid.not_in(sorted(live_pids)))
            session.execute(stmt)
