"""Engine setup for the catalog: SQLite gets WAL, a busy timeout and foreign keys."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from sqlalchemy import Engine, create_engine, event
from sqlalchemy.engine import make_url

#: How long a SQLite writer waits for another process's write lock before failing.
SQLITE_BUSY_TIMEOUT_MS = 30_000


def default_catalog_url(cache_dir: Path) -> str:
    """The embedded default: a SQLite file inside the cache directory."""
    return f"sqlite:///{(cache_dir / 'catalog.sqlite3').as_posix()}"


def create_catalog_engine(url: str) -> Engine:
    """Create the SQLAlchemy engine; per-connection pragmas for SQLite."""
    parsed = make_url(url)
    kwargs: dict[str, Any] = {"future": True}
    if parsed.get_backend_name() == "sqlite":
        database = parsed.database
        if database and database != ":memory:":
            Path(database).parent.mkdir(parents=True, exist_ok=True)
        kwargs["connect_args"] = {"timeout": SQLITE_BUSY_TIMEOUT_MS / 1000, "check_same_thread": False}
    else:
        kwargs["pool_pre_ping"] = True
    engine = create_engine(url, **kwargs)
    if parsed.get_backend_name() == "sqlite":
        event.listen(engine, "connect", _sqlite_pragmas)
        # pysqlite's own transaction handling defers BEGIN; we emit it ourselves so that writers
        # (engine.execution_options(sqlite_immediate=True)) take the write lock up front and two
        # processes never deadlock upgrading read locks (SQLITE_BUSY without waiting).
        event.listen(engine, "begin", _sqlite_begin)
    return engine


def _sqlite_pragmas(dbapi_conn: Any, _record: Any) -> None:
    dbapi_conn.isolation_level = None  # let SQLAlchemy's "begin" event issue BEGIN
    cur = dbapi_conn.cursor()
    try:
        cur.execute("PRAGMA journal_mode=WAL")
        cur.execute(f"PRAGMA busy_timeout={SQLITE_BUSY_TIMEOUT_MS}")
        cur.execute("PRAGMA foreign_keys=ON")
        cur.execute("PRAGMA synchronous=NORMAL")
    finally:
        cur.close()


def _sqlite_begin(conn: Any) -> None:
    immediate = conn.get_execution_options().get("sqlite_immediate", False)
    conn.exec_driver_sql("BEGIN IMMEDIATE" if immediate else "BEGIN")
