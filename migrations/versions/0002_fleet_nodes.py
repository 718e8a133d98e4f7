"""Fleet: bundles keyed by (id, node), per-node event totals, nodes and desired state.

Revision ID: 0002
Revises: 0001
Create Date: 2026-12-03 02:40:00

A pre-fleet catalog belongs to one node, so its running totals move to the node named on its
newest bundle or event (or ``''`` for an empty catalog). Lease rows are display-only (the
file lock is the truth) and are dropped with their table, which is rebuilt around the new
composite foreign key.
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0002"
down_revision: str | None = "0001"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

_ID = sa.BigInteger().with_variant(sa.Integer(), "sqlite")


def _leases(bundle_fk: list[str]) -> None:
    op.create_table(
        "leases",
        sa.Column("id", _ID, autoincrement=True, nullable=False),
        sa.Column("bundle_id", sa.String(length=64), nullable=False),
        sa.Column("node", sa.String(length=255), nullable=False),
        sa.Column("pid", sa.Integer(), nullable=False),
        sa.Column("since", sa.DateTime(), nullable=False),
        sa.ForeignKeyConstraint(
            bundle_fk,
            [f"bundles.{c.replace('bundle_', '')}" for c in bundle_fk],
            name=op.f("fk_leases_bundle_id_bundles"),
            ondelete="CASCADE",
        ),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_leases")),
        sa.UniqueConstraint("bundle_id", "node", "pid", name="uq_leases_holder"),
    )
    op.create_index(op.f("ix_leases_bundle_id"), "leases", ["bundle_id"], unique=False)


def _event_totals(with_node: bool) -> sa.Table:
    cols: list[sa.schema.SchemaItem] = [
        sa.Column("kind", sa.String(length=32), nullable=False),
        sa.Column("reason", sa.String(length=16), nullable=False),
        sa.Column("model", sa.String(length=1024), nullable=False),
        sa.Column("count", sa.BigInteger(), nullable=False),
        sa.Column("bytes", sa.BigInteger(), nullable=False),
        sa.Column("seconds", sa.Float(), nullable=False),
        sa.Column("first_at", sa.DateTime(), nullable=False),
    ]
    key = ["kind", "reason", "model"]
    if with_node:
        cols.insert(0, sa.Column("node", sa.String(length=255), nullable=False))
        key.insert(0, "node")
    return op.create_table("event_totals", *cols, sa.PrimaryKeyConstraint(*key, name=op.f("pk_event_totals")))


_TOTAL_COLS = ("kind", "reason", "model", "count", "bytes", "seconds", "first_at")


def upgrade() -> None:
    conn = op.get_bind()
    op.drop_index(op.f("ix_leases_bundle_id"), table_name="leases")
    op.drop_table("leases")
    with op.batch_alter_table("bundles", schema=None) as batch_op:
        batch_op.drop_constraint("pk_bundles", type_="primary")
        batch_op.create_primary_key("pk_bundles", ["id", "node"])
        batch_op.create_index("ix_bundles_node_last_used", ["node", "last_used_at", "id"], unique=False)
    _leases(["bundle_id", "node"])

    owner = conn.execute(sa.text("SELECT node FROM bundles ORDER BY last_used_at DESC LIMIT 1")).scalar()
    if owner is None:
        owner = conn.execute(sa.text("SELECT node FROM events ORDER BY id DESC LIMIT 1")).scalar()
    old = [
        dict(r._mapping) for r in conn.execute(sa.text(f"SELECT {', '.join(_TOTAL_COLS)} FROM event_totals"))
    ]
    op.drop_table("event_totals")
    totals = _event_totals(with_node=True)
    if old:
        op.bulk_insert(totals, [{**r, "node": owner or ""} for r in old])

    op.create_table(
        "nodes",
        sa.Column("name", sa.String(length=255), nullable=False),
        sa.Column("started_at", sa.DateTime(), nullable=False),
        sa.Column("heartbeat_at", sa.DateTime(), nullable=False),
        sa.Column("pid", sa.Integer(), nullable=False),
        sa.Column("max_size_bytes", sa.BigInteger(), nullable=False),
        sa.Column("heartbeat_seconds", sa.Float(), nullable=False),
        sa.Column("loaded_models", sa.JSON(), nullable=False),
        sa.Column("desired_status", sa.JSON(), nullable=True),
        sa.PrimaryKeyConstraint("name", name=op.f("pk_nodes")),
    )
    op.create_table(
        "desired_state",
        sa.Column("node", sa.String(length=255), nullable=False),
        sa.Column("spec", sa.JSON(), nullable=False),
        sa.Column("generation", sa.BigInteger(), nullable=False),
        sa.Column("updated_at", sa.DateTime(), nullable=False),
        sa.PrimaryKeyConstraint("node", name=op.f("pk_desired_state")),
    )


def downgrade() -> None:
    # Back to one node per catalog: other nodes' rows cannot be kept under the old keys.
    conn = op.get_bind()
    op.drop_table("desired_state")
    op.drop_table("nodes")
    keep = conn.execute(sa.text("SELECT node FROM bundles ORDER BY last_used_at DESC LIMIT 1")).scalar()
    old = [
        dict(r._mapping)
        for r in conn.execute(
            sa.text(f"SELECT {', '.join(_TOTAL_COLS)} FROM event_totals WHERE node = :n"), {"n": keep or ""}
        )
    ]
    op.drop_table("event_totals")
    totals = _event_totals(with_node=False)
    if old:
        op.bulk_insert(totals, old)
    op.drop_index(op.f("ix_leases_bundle_id"), table_name="leases")
    op.drop_table("leases")
    if keep is not None:
        conn.execute(sa.text("DELETE FROM bundles WHERE node <> :n"), {"n": keep})
    with op.batch_alter_table("bundles", schema=None) as batch_op:
        batch_op.drop_index("ix_bundles_node_last_used")
        batch_op.drop_constraint("pk_bundles", type_="primary")
        batch_op.create_primary_key("pk_bundles", ["id"])
    _leases(["bundle_id"])
