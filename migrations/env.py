"""Alembic environment: batch mode for SQLite, our naming convention, connection reuse."""

from __future__ import annotations

import os

from alembic import context
from sqlalchemy import Connection

from cachesvc.cache.catalog.models import Base
from cachesvc.cache.catalog.session import create_catalog_engine

config = context.config
target_metadata = Base.metadata


def _run(connection: Connection) -> None:
    context.configure(
        connection=connection,
        target_metadata=target_metadata,
        render_as_batch=True,  # SQLite cannot ALTER most things; batch mode copies the table
        compare_type=True,
    )
    with context.begin_transaction():
        context.run_migrations()


def run_migrations_online() -> None:
    connection = config.attributes.get("connection")
    if connection is not None:
        _run(connection)
        return
    url = os.environ.get("CACHESVC_CATALOG_URL") or config.get_main_option("sqlalchemy.url")
    if not url:
        raise SystemExit("set CACHESVC_CATALOG_URL (or use `cachesvc db upgrade`)")
    engine = create_catalog_engine(url)
    with engine.connect() as conn:
        _run(conn)
    engine.dispose()


if context.is_offline_mode():
    raise SystemExit("offline (SQL script) migrations are not supported; run them against a database")
run_migrations_online()
