"""LoRA adapters converted into the cache: one row per adapter and node.

Revision ID: 0005
Revises: 0004
Create Date: 2026-12-03 16:40:00

Downgrade drops the table: the converted files under ``adapters/`` are then unknown to the
catalog, and an older reconcile never looks there (a newer one removes them as files without a
row, and the next prepare converts again).
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0005"
down_revision: str | None = "0004"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.create_table(
        "adapters",
        sa.Column("id", sa.String(length=64), nullable=False),
        sa.Column("digest", sa.String(length=64), nullable=False),
        sa.Column("source", sa.String(length=1024), nullable=False),
        sa.Column("path", sa.Text(), nullable=False),
        sa.Column("rank", sa.Integer(), nullable=False),
        sa.Column("targets", sa.JSON(), nullable=False),
        sa.Column("size_bytes", sa.BigInteger(), nullable=False),
        sa.Column("pinned", sa.Boolean(), nullable=False),
        sa.Column("created_at", sa.DateTime(), nullable=False),
        sa.Column("last_used_at", sa.DateTime(), nullable=False),
        sa.Column("node", sa.String(length=255), nullable=False),
        sa.CheckConstraint("size_bytes >= 0", name=op.f("ck_adapters_size_nonneg")),
        sa.PrimaryKeyConstraint("id", "node", name=op.f("pk_adapters")),
    )
    op.create_index("ix_adapters_node_last_used", "adapters", ["node", "last_used_at", "id"], unique=False)


def downgrade() -> None:
    op.drop_index("ix_adapters_node_last_used", table_name="adapters")
    op.drop_table("adapters")
