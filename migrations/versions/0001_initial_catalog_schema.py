"""Initial catalog schema: bundles, checkpoints, leases, events, event totals.

Revision ID: 0001
Revises:
Create Date: 2026-12-02 18:07:36.420731
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0001"
down_revision: str | None = None
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:

    op.create_table(
        "bundles",
        sa.Column("id", sa.String(length=64), nullable=False),
        sa.Column("model", sa.String(length=1024), nullable=False),
        sa.Column("checkpoint_digest", sa.String(length=64), nullable=False),
        sa.Column("draft_digest", sa.String(length=64), nullable=True),
        sa.Column("profile", sa.JSON(), nullable=False),
        sa.Column("profile_name", sa.String(length=255), nullable=False),
        sa.Column("backend", sa.String(length=32), nullable=False),
        sa.Column("path", sa.Text(), nullable=False),
        sa.Column("size_bytes", sa.BigInteger(), nullable=False),
        sa.Column("file_count", sa.Integer(), nullable=False),
        sa.Column("state", sa.String(length=16), nullable=False),
        sa.Column("created_at", sa.DateTime(), nullable=False),
        sa.Column("built_at", sa.DateTime(), nullable=True),
        sa.Column("build_seconds", sa.Float(), nullable=True),
        sa.Column("last_used_at", sa.DateTime(), nullable=False),
        sa.Column("hit_count", sa.BigInteger(), nullable=False),
        sa.Column("pinned", sa.Boolean(), nullable=False),
        sa.Column("last_verified_at", sa.DateTime(), nullable=True),
        sa.Column("error", sa.Text(), nullable=True),
        sa.Column("node", sa.String(length=255), nullable=False),
        sa.CheckConstraint(
            "state IN ('building', 'ready', 'failed', 'corrupt')", name=op.f("ck_bundles_state")
        ),
        sa.CheckConstraint("size_bytes >= 0", name=op.f("ck_bundles_size_nonneg")),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_bundles")),
    )
    with op.batch_alter_table("bundles", schema=None) as batch_op:
        batch_op.create_index("ix_bundles_checkpoint_digest", ["checkpoint_digest"], unique=False)
        batch_op.create_index("ix_bundles_created_id", ["created_at", "id"], unique=False)
        batch_op.create_index("ix_bundles_hits_id", ["hit_count", "id"], unique=False)
        batch_op.create_index("ix_bundles_last_used_id", ["last_used_at", "id"], unique=False)
        batch_op.create_index("ix_bundles_model_size", ["model", "size_bytes"], unique=False)
        batch_op.create_index("ix_bundles_size_id", ["size_bytes", "id"], unique=False)
        batch_op.create_index("ix_bundles_state_last_used", ["state", "last_used_at"], unique=False)

    op.create_table(
        "checkpoints",
        sa.Column("digest", sa.String(length=64), nullable=False),
        sa.Column("source", sa.String(length=1024), nullable=False),
        sa.Column("path", sa.Text(), nullable=False),
        sa.Column("size_bytes", sa.BigInteger(), nullable=False),
        sa.Column("file_count", sa.Integer(), nullable=False),
        sa.Column("resolved_at", sa.DateTime(), nullable=False),
        sa.Column("node", sa.String(length=255), nullable=False),
        sa.PrimaryKeyConstraint("digest", name=op.f("pk_checkpoints")),
    )
    op.create_table(
        "event_totals",
        sa.Column("kind", sa.String(length=32), nullable=False),
        sa.Column("reason", sa.String(length=16), nullable=False),
        sa.Column("model", sa.String(length=1024), nullable=False),
        sa.Column("count", sa.BigInteger(), nullable=False),
        sa.Column("bytes", sa.BigInteger(), nullable=False),
        sa.Column("seconds", sa.Float(), nullable=False),
        sa.Column("first_at", sa.DateTime(), nullable=False),
        sa.PrimaryKeyConstraint("kind", "reason", "model", name=op.f("pk_event_totals")),
    )
    op.create_table(
        "events",
        sa.Column(
            "id", sa.BigInteger().with_variant(sa.Integer(), "sqlite"), autoincrement=True, nullable=False
        ),
        sa.Column("at", sa.DateTime(), nullable=False),
        sa.Column("kind", sa.String(length=32), nullable=False),
        sa.Column("bundle_id", sa.String(length=64), nullable=True),
        sa.Column("checkpoint_digest", sa.String(length=64), nullable=True),
        sa.Column("model", sa.String(length=1024), nullable=True),
        sa.Column("reason", sa.String(length=16), nullable=True),
        sa.Column("bytes", sa.BigInteger(), nullable=True),
        sa.Column("seconds", sa.Float(), nullable=True),
        sa.Column("detail", sa.Text(), nullable=True),
        sa.Column("node", sa.String(length=255), nullable=False),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_events")),
    )
    with op.batch_alter_table("events", schema=None) as batch_op:
        batch_op.create_index("ix_events_at", ["at"], unique=False)
        batch_op.create_index("ix_events_bundle_id", ["bundle_id", "id"], unique=False)
        batch_op.create_index("ix_events_kind_id", ["kind", "id"], unique=False)
        batch_op.create_index("ix_events_kind_seconds", ["kind", "seconds"], unique=False)

    op.create_table(
        "leases",
        sa.Column(
            "id", sa.BigInteger().with_variant(sa.Integer(), "sqlite"), autoincrement=True, nullable=False
        ),
        sa.Column("bundle_id", sa.String(length=64), nullable=False),
        sa.Column("node", sa.String(length=255), nullable=False),
        sa.Column("pid", sa.Integer(), nullable=False),
        sa.Column("since", sa.DateTime(), nullable=False),
        sa.ForeignKeyConstraint(
            ["bundle_id"], ["bundles.id"], name=op.f("fk_leases_bundle_id_bundles"), ondelete="CASCADE"
        ),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_leases")),
        sa.UniqueConstraint("bundle_id", "node", "pid", name="uq_leases_holder"),
    )
    with op.batch_alter_table("leases", schema=None) as batch_op:
        batch_op.create_index(batch_op.f("ix_leases_bundle_id"), ["bundle_id"], unique=False)


def downgrade() -> None:

    with op.batch_alter_table("leases", schema=None) as batch_op:
        batch_op.drop_index(batch_op.f("ix_leases_bundle_id"))

    op.drop_table("leases")
    with op.batch_alter_table("events", schema=None) as batch_op:
        batch_op.drop_index("ix_events_kind_seconds")
        batch_op.drop_index("ix_events_kind_id")
        batch_op.drop_index("ix_events_bundle_id")
        batch_op.drop_index("ix_events_at")

    op.drop_table("events")
    op.drop_table("event_totals")
    op.drop_table("checkpoints")
    with op.batch_alter_table("bundles", schema=None) as batch_op:
        batch_op.drop_index("ix_bundles_state_last_used")
        batch_op.drop_index("ix_bundles_size_id")
        batch_op.drop_index("ix_bundles_model_size")
        batch_op.drop_index("ix_bundles_last_used_id")
        batch_op.drop_index("ix_bundles_hits_id")
        batch_op.drop_index("ix_bundles_created_id")
        batch_op.drop_index("ix_bundles_checkpoint_digest")

    op.drop_table("bundles")
