"""Catalog databases for tests: the SQLite file of each cache dir, or a PostgreSQL database.

The suites that must pass on both databases use the ``catalog_db`` fixture (tests/conftest.py),
parametrized ``sqlite`` / ``postgresql``. For PostgreSQL it puts a token into the environment
(``CACHESVC_TEST_CATALOG``); :func:`catalog_url_for` then maps every cache directory to a
database of its own on the server named by ``CACHESVC_TEST_PG_URL`` (``.ci/run`` starts one),
so two caches in one test have two catalogs, exactly as two SQLite files would, and child
processes (which inherit the environment) open the same database as their parent.
"""

from __future__ import annotations

import hashlib
import os
import secrets
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from sqlalchemy import create_engine, text
from sqlalchemy.engine import make_url

#: Server URL (``postgresql+psycopg://user@/db?host=/socket/dir``) set by CI or a developer.
PG_URL_ENV = "CACHESVC_TEST_PG_URL"
#: ``sqlite`` or ``postgresql:<token>``: which catalog the current test runs on.
CATALOG_ENV = "CACHESVC_TEST_CATALOG"


def pg_server_url() -> str | None:
    """The configured test server, or None (the PostgreSQL variants are then skipped)."""
    return os.environ.get(PG_URL_ENV) or None


def database_url(server: str, name: str) -> str:
    """``server`` pointed at database ``name``."""
    return make_url(server).set(database=name).render_as_string(hide_password=False)


def ensure_database(server: str, name: str) -> str:
    """Create database ``name`` unless it exists; its URL."""
    engine = create_engine(server, isolation_level="AUTOCOMMIT")
    try:
        with engine.connect() as conn:
            exists = conn.scalar(text("SELECT 1 FROM pg_database WHERE datname = :n"), {"n": name})
            if not exists:
                try:
                    conn.execute(text(f'CREATE DATABASE "{name}"'))
                except Exception:
                    # Another process of the same test created it first.
                    if not conn.scalar(text("SELECT 1 FROM pg_database WHERE datname = :n"), {"n": name}):
                        raise
    finally:
        engine.dispose()
    return database_url(server, name)


def drop_databases(server: str, prefix: str) -> None:
    """Drop every database whose name starts with ``prefix`` (closing their connections)."""
    engine = create_engine(server, isolation_level="AUTOCOMMIT")
    try:
        with engine.connect() as conn:
            names = conn.scalars(
                text("SELECT datname FROM pg_database WHERE datname LIKE :p"), {"p": prefix + "%"}
            ).all()
            for name in names:
                conn.execute(text(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)'))
    finally:
        engine.dispose()


def catalog_url_for(cache_dir: Path) -> str | None:
    """The catalog URL a test cache at ``cache_dir`` uses (None: its default SQLite file)."""
    mode = os.environ.get(CATALOG_ENV, "sqlite")
    if not mode.startswith("postgresql:"):
        return None
    server = pg_server_url()
    assert server, f"{CATALOG_ENV} asks for PostgreSQL but {PG_URL_ENV} is not set"
    token = mode.split(":", 1)[1]
    digest = hashlib.sha256(str(Path(cache_dir).expanduser().absolute()).encode()).hexdigest()[:12]
    return ensure_database(server, f"{token}_{digest}")


def shared_catalog_url(name: str) -> str | None:
    """A catalog shared by several caches of one test (a fleet): named, not per directory."""
    mode = os.environ.get(CATALOG_ENV, "sqlite")
    if not mode.startswith("postgresql:"):
        return None
    server = pg_server_url()
    assert server
    return ensure_database(server, f"{mode.split(':', 1)[1]}_{name}")


@contextmanager
def catalog_backend(kind: str) -> Iterator[str]:
    """Run the body with ``kind`` (``sqlite``/``postgresql``) as the tests' catalog."""
    old = os.environ.get(CATALOG_ENV)
    if kind == "sqlite":
        os.environ[CATALOG_ENV] = "sqlite"
        token = ""
    else:
        server = pg_server_url()
        assert server
        token = "t_" + secrets.token_hex(6)
        os.environ[CATALOG_ENV] = f"postgresql:{token}"
    try:
        yield kind
    finally:
        if old is None:
            os.environ.pop(CATALOG_ENV, None)
        else:
            os.environ[CATALOG_ENV] = old
        if token:
            server = pg_server_url()
            assert server
            drop_databases(server, token)
