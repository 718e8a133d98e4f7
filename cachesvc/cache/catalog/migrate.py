"""Run the Alembic migrations programmatically (the app and `cachesvc db` use this)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

from alembic import command
from alembic.config import Config
from alembic.runtime.migration import MigrationContext
from alembic.script import ScriptDirectory
from sqlalchemy import Engine, text

#: PostgreSQL advisory lock key that serialises schema upgrades of one database.
MIGRATION_LOCK_KEY = 0x63616368_65737663 & 0x7FFFFFFFFFFFFFFF


def script_location() -> Path:
    """Directory of the migration scripts (the ``migrations`` package)."""
    spec = importlib.util.find_spec("migrations")
    if spec is None or not spec.submodule_search_locations:
        raise RuntimeError("the 'migrations' package is missing; reinstall cachesvc")
    return Path(next(iter(spec.submodule_search_locations)))


def alembic_config(engine: Engine | None = None) -> Config:
    """An Alembic Config pointing at our scripts (no alembic.ini needed)."""
    cfg = Config()
    cfg.set_main_option("script_location", str(script_location()))
    if engine is not None:
        cfg.set_main_option(
            "sqlalchemy.url", engine.url.render_as_string(hide_password=False).replace("%", "%%")
        )
    return cfg


def upgrade(engine: Engine, revision: str = "head") -> None:
    """Upgrade the schema to ``revision`` inside one connection (a no-op when already there)."""
    cfg = alembic_config(engine)
    if revision == "head" and current_revision(engine) == ScriptDirectory.from_config(cfg).get_current_head():
        return
    # BEGIN IMMEDIATE on SQLite: several processes starting on a fresh catalog serialise here
    # (the busy timeout applies) instead of failing with "database is locked" when one upgrades
    # its read lock; the loser then reads the winner's revision and has nothing to do.
    # PostgreSQL: a transaction-scoped advisory lock does the same (DDL is transactional there).
    with engine.execution_options(sqlite_immediate=True).begin() as conn:
        if conn.dialect.name == "postgresql":
            conn.execute(text("SELECT pg_advisory_xact_lock(:key)"), {"key": MIGRATION_LOCK_KEY})
        cfg.attributes["connection"] = conn
        command.upgrade(cfg, revision)


def downgrade(engine: Engine, revision: str) -> None:
    """Downgrade the schema to ``revision`` (``base`` drops everything)."""
    cfg = alembic_config(engine)
    with engine.begin() as conn:
        cfg.attributes["connection"] = conn
        command.downgrade(cfg, revision)


def current_revision(engine: Engine) -> str | None:
    """The revision the database is at, or None."""
    with engine.connect() as conn:
        return MigrationContext.configure(conn).get_current_revision()


def head_revision() -> str | None:
    """The newest revision shipped with this version of cachesvc."""
    return ScriptDirectory.from_config(alembic_config()).get_current_head()
