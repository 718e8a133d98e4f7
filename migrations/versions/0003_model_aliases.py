"""Model aliases: served names operators give bundles or checkpoints.

Revision ID: 0003
Revises: 0002
Create Date: 2026-12-03 03:10:00
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0003"
down_revision: str | None = "0002"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.create_table(
        "model_aliases",
        sa.Column("name", sa.String(length=255), nullable=False),
        sa.Column("bundle_id", sa.String(length=64), nullable=True),
        sa.Column("model", sa.String(length=1024), nullable=True),
        sa.Column("created_at", sa.DateTime(), nullable=False),
        sa.CheckConstraint(
            "(bundle_id IS NULL) <> (model IS NULL)", name=op.f("ck_model_aliases_one_target")
        ),
        sa.PrimaryKeyConstraint("name", name=op.f("pk_model_aliases")),
    )


def downgrade() -> None:
    op.drop_table("model_aliases")
