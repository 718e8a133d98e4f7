"""Fleet rows of the catalog: node heartbeats and desired state.

Every node writes only its own ``nodes`` row; desired state is written by operators (any node's
admin API) and read by each node's reconciler. Nothing here deletes another node's rows: a node
that stops heartbeating is shown as down and keeps its bundles, leases and events.
"""

from __future__ import annotations

from datetime import datetime
from typing import Any

from sqlalchemy import Result, Table, delete, func, select, update
from sqlalchemy.dialects import postgresql, sqlite
from sqlalchemy.orm import Session

from cachesvc.cache.catalog.models import (
    AdapterRow,
    BundleRow,
    CheckpointRow,
    DesiredStateRow,
    EventRow,
    EventTotalRow,
    LeaseRow,
    NodeRow,
)
from cachesvc.cache.catalog.repository import Catalog, utcnow
from cachesvc.cache.fleet_records import (
    FLEET_DEFAULT,
    STALE_INTERVALS,
    DesiredSpec,
    DesiredState,
    ItemStatus,
    NodeInfo,
)
from cachesvc.errors import NotFoundError


class FleetCatalog:
    """Nodes and desired state over the same database as a :class:`Catalog`."""

    def __init__(self, catalog: Catalog) -> None:
        self.catalog = catalog
        self.node = catalog.node

    def _tx(self) -> Any:
        return self.catalog.core.tx()

    # -- heartbeat -------------------------------------------------------------------------

    def heartbeat(
        self,
        *,
        pid: int,
        max_size_bytes: int,
        heartbeat_seconds: float,
        loaded_models: list[str],
        started_at: datetime,
        desired_status: dict[str, Any] | None = None,
        report_status: bool = False,
    ) -> None:
        """Upsert this node's row (one statement; dialect-aware upsert)."""
        now = utcnow()
        values: dict[str, Any] = {
            "name": self.node,
            "started_at": started_at,
            "heartbeat_at": now,
            "pid": pid,
            "max_size_bytes": max_size_bytes,
            "heartbeat_seconds": heartbeat_seconds,
            "loaded_models": list(loaded_models),
        }
        updates = {k: v for k, v in values.items() if k != "name"}
        if report_status:
            values["desired_status"] = desired_status
            updates["desired_status"] = desired_status
        with self._tx() as session:
            _upsert(session, NodeRow, values, ["name"], updates)

    def take_over(self, provisional: str) -> int:
        """Make every row written under the ``provisional`` node this node's, in one
        transaction; the number of rows moved. A cache directory is one node: commands run on
        it before its first ``serve`` act as a provisional name the directory records
        (``CacheLayout.provisional_node``), and the server that claims it takes their bundles,
        adapters, checkpoints, events and totals over. A row this node has already (the same
        bundle or adapter id) wins; the provisional one is dropped. Lease rows of the
        provisional node are dropped (no command holds one once it exited; the lock is the
        truth)."""
        node = self.node
        if provisional == node:
            return 0
        moved = 0
        with self._tx() as session:
            session.execute(delete(LeaseRow).where(LeaseRow.node == provisional))
            for model in (BundleRow, AdapterRow):
                ours = select(model.id).where(model.node == node)
                session.execute(delete(model).where(model.node == provisional, model.id.in_(ours)))
                moved += _rowcount(session.execute(
                    update(model).where(model.node == provisional).values(node=node)
                ))
            moved += _rowcount(session.execute(
                update(CheckpointRow).where(CheckpointRow.node == provisional).values(node=node)
            ))
            moved += _rowcount(session.execute(
                update(EventRow).where(EventRow.node == provisional).values(node=node)
            ))
            for total in session.scalars(
                select(EventTotalRow).where(EventTotalRow.node == provisional)
            ).all():
                key = (node, total.kind, total.reason, total.model)
                mine = session.get(EventTotalRow, key, with_for_update=True)
                if mine is None:
                    session.add(EventTotalRow(
                        node=node, kind=total.kind, reason=total.reason, model=total.model,
                        count=total.count, bytes=total.bytes, seconds=total.seconds,
                        first_at=total.first_at,
                    ))
                else:
                    mine.count += total.count
                    mine.bytes += total.bytes
                    mine.seconds += total.seconds
                    mine.first_at = min(mine.first_at, total.first_at)
                session.delete(total)
                moved += 1
            session.execute(delete(NodeRow).where(NodeRow.name == provisional))
        return moved

    # -- nodes -----------------------------------------------------------------------------

    def nodes(self) -> list[NodeInfo]:
        """Every node that heartbeated or owns a bundle; down after STALE_INTERVALS missed beats."""
        now = utcnow()
        with self.catalog.engine.connect() as conn:
            rows = {r.name: r for r in conn.execute(select(NodeRow))}
            by_state: dict[str, dict[str, int]] = {}
            sizes: dict[str, int] = {}
            for node, state, count, nbytes in conn.execute(
                select(
                    BundleRow.node,
                    BundleRow.state,
                    func.count(),
                    func.coalesce(func.sum(BundleRow.size_bytes), 0),
                ).group_by(BundleRow.node, BundleRow.state)
            ):
                by_state.setdefault(node, {})[state] = int(count)
                sizes[node] = sizes.get(node, 0) + int(nbytes)
            leases = {
                node: int(count)
                for node, count in conn.execute(select(LeaseRow.node, func.count()).group_by(LeaseRow.node))
            }
            sources: dict[str, dict[str, int]] = {}
            for node, kind, count in conn.execute(
                select(EventTotalRow.node, EventTotalRow.kind, func.sum(EventTotalRow.count))
                .where(EventTotalRow.kind.in_(("pull", "build_ok")))
                .group_by(EventTotalRow.node, EventTotalRow.kind)
            ):
                sources.setdefault(node, {})[kind] = int(count)
            generations = {
                r.node: int(r.generation)
                for r in conn.execute(select(DesiredStateRow.node, DesiredStateRow.generation))
            }
        out: list[NodeInfo] = []
        for name in sorted(set(rows) | set(by_state)):
            row = rows.get(name)
            heartbeat = row.heartbeat_at if row is not None else None
            # max(0, ...): another node's clock may run a little ahead of ours.
            age = max(0.0, (now - heartbeat).total_seconds()) if heartbeat is not None else None
            status: dict[str, Any] = (row.desired_status if row is not None else None) or {}
            wanted = generations.get(name, generations.get(FLEET_DEFAULT))
            convergence = str(status.get("state", "none")) if wanted is not None else "none"
            if wanted is not None and status.get("generation") != wanted:
                convergence = "converging"  # the node has not reported on this generation yet
            out.append(
                NodeInfo(
                    name=name,
                    state="up"
                    if row is not None and age is not None and age <= STALE_INTERVALS * row.heartbeat_seconds
                    else "down",
                    heartbeat_seconds=float(row.heartbeat_seconds) if row is not None else None,
                    started_at=row.started_at if row is not None else None,
                    heartbeat_at=heartbeat,
                    heartbeat_age_seconds=age,
                    pid=int(row.pid) if row is not None else 0,
                    size_bytes=sizes.get(name, 0),
                    max_size_bytes=int(row.max_size_bytes) if row is not None else 0,
                    bundles=sum(by_state.get(name, {}).values()),
                    bundles_by_state=by_state.get(name, {}),
                    loaded_models=tuple(row.loaded_models or ()) if row is not None else (),
                    leases=leases.get(name, 0),
                    convergence=convergence,
                    desired_generation=wanted,
                    pulled=sources.get(name, {}).get("pull", 0),
                    built=sources.get(name, {}).get("build_ok", 0),
                    items=tuple(
                        ItemStatus(
                            item=str(i.get("item", "")),
                            state=str(i.get("state", "pending")),
                            bundle_id=i.get("bundle_id"),
                            error=i.get("error"),
                            source=i.get("source"),
                        )
                        for i in status.get("items", ())
                    ),
                )
            )
        return out

    def knows(self, name: str) -> bool:
        """Whether node ``name`` ever heartbeated or owns a bundle row."""
        with self.catalog.engine.connect() as conn:
            if conn.scalar(select(NodeRow.name).where(NodeRow.name == name)) is not None:
                return True
            return conn.scalar(select(BundleRow.id).where(BundleRow.node == name).limit(1)) is not None

    def node_cap(self, name: str) -> int | None:
        """The size cap node ``name`` last reported, or None when it never heartbeated."""
        with self.catalog.engine.connect() as conn:
            value = conn.scalar(select(NodeRow.max_size_bytes).where(NodeRow.name == name))
        return None if value is None else int(value)

    # -- desired state ---------------------------------------------------------------------

    def set_desired(self, node: str, spec: DesiredSpec) -> DesiredState:
        """Store the desired state of ``node`` (``*``: the fleet default); bumps its generation."""
        now = utcnow()
        with self._tx() as session:
            row = session.get(DesiredStateRow, node, with_for_update=True)
            if row is None:
                row = DesiredStateRow(node=node, generation=0)
                session.add(row)
            row.spec, row.generation, row.updated_at = spec.to_dict(), int(row.generation) + 1, now
            return DesiredState(node, spec, int(row.generation), now)

    def clear_desired(self, node: str) -> None:
        """Remove the desired state of ``node`` (it then follows the fleet default)."""
        with self._tx() as session:
            row = session.get(DesiredStateRow, node, with_for_update=True)
            if row is None:
                raise NotFoundError(f"no desired state stored for {node!r}")
            session.delete(row)

    def desired(self, node: str, *, fallback: bool = True) -> DesiredState | None:
        """The desired state of ``node``, else (with ``fallback``) the fleet default, else None."""
        with self.catalog.core.read() as session:
            row = session.get(DesiredStateRow, node)
            if row is None and fallback and node != FLEET_DEFAULT:
                row = session.get(DesiredStateRow, FLEET_DEFAULT)
            if row is None:
                return None
            return DesiredState(
                row.node, DesiredSpec.from_dict(row.spec), int(row.generation), row.updated_at
            )


def _rowcount(result: Result[Any]) -> int:
    return int(getattr(result, "rowcount", 0) or 0)


def _upsert(
    session: Session, model: Any, values: dict[str, Any], keys: list[str], updates: dict[str, Any]
) -> None:
    table = model.__table__
    assert isinstance(table, Table)
    dialect = session.get_bind().dialect.name
    if dialect in ("sqlite", "postgresql"):
        insert = sqlite.insert if dialect == "sqlite" else postgresql.insert
        session.execute(
            insert(table).values(**values).on_conflict_do_update(index_elements=keys, set_=updates)
        )
        return
    row = session.get(model, tuple(values[k] for k in keys), with_for_update=True)
    if row is None:
        session.add(model(**values))
    else:
        for k, v in updates.items():
            setattr(row, k, v)
