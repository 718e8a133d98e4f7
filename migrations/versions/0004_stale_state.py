"""Bundle state ``stale``: built for another GPU or TensorRT version than the node has now.

Revision ID: 0004
Revises: 0003
Create Date: 2026-12-03 05:30:00

Widens the ``bundles.state`` CHECK constraint. SQLite cannot alter a constraint, so the table
is recreated (batch mode); with foreign keys on, dropping the old table would cascade to the
display-only lease rows, so they are read first and put back. PostgreSQL alters in place.

Downgrade: ``stale`` rows go back to ``ready`` (their stale reason cleared), which is what the
catalog said before this revision: the TensorRT runtime refuses to load such a bundle, as it
did then, and an older reconcile never flags it.
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0004"
down_revision: str | None = "0003"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

_OLD = "state IN ('building', 'ready', 'failed', 'corrupt')"
_NEW = "state IN ('building', 'ready', 'failed', 'corrupt', 'stale')"
_LEASE_COLS = ("id", "bundle_id", "node", "pid", "since")


def _replace_state_check(condition: str) -> None:
    conn = op.get_bind()
    sqlite = conn.dialect.name == "sqlite"
    leases = (
        [dict(r._mapping) for r in conn.execute(sa.text(f"SELECT {', '.join(_LEASE_COLS)} FROM leases"))]
        if sqlite
        else []
    )
    with op.batch_alter_table("bundles", schema=None) as batch_op:
        batch_op.drop_constraint(op.f("ck_bundles_state"), type_="check")
        batch_op.create_check_constraint(op.f("ck_bundles_state"), sa.text(condition))
    if leases:
        conn.execute(sa.text("DELETE FROM leases"))
        conn.execute(
            sa.text(
                f"INSERT INTO leases ({', '.join(_LEASE_COLS)}) "
                f"VALUES ({', '.join(':' + c for c in _LEASE_COLS)})"
            ),
            leases,
        )


def upgrade() -> None:
    _replace_state_check(_NEW)


def downgrade() -> None:
    op.get_bind().execute(sa.text("UPDATE bundles SET state = 'ready', error = NULL WHERE state = 'stale'"))
    _replace_state_check(_OLD)
