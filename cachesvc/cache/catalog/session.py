"""Engine setup for the catalog: SQLite gets WAL, a busy timeout and foreign keys."""

from __future__ import annotations

import os
import shutil
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from sqlalchemy import Engine, create_engine, event, exc
from sqlalchemy.engine import ExceptionContext, make_url

from cachesvc.cache.catalog.health import CatalogHealth
from cachesvc.errors import CatalogError, CatalogUnavailableError, InsufficientStorageError

#: How long a SQLite writer waits for another process's write lock before failing.
SQLITE_BUSY_TIMEOUT_MS = 30_000


def default_catalog_url(cache_dir: Path) -> str:
    """The embedded default: a SQLite file inside the cache directory."""
    return f"sqlite:///{(cache_dir / 'catalog.sqlite3').as_posix()}"


def create_catalog_engine(url: str, health: CatalogHealth | None = None) -> Engine:
    """Create the SQLAlchemy engine; per-connection pragmas for SQLite.

    Every error that means "the database cannot be reached now" becomes one
    :class:`CatalogUnavailableError` (reported to ``health``); connections are pinged before
    use on a server, so the pool recovers by itself once the server is back. A SQLite file is
    watched by :class:`SqliteFile` (the file opened is still there and writable), checked
    before every transaction and by ``health`` for ``/health``."""
    parsed = make_url(url)
    kwargs: dict[str, Any] = {"future": True}
    sqlite_file: SqliteFile | None = None
    if parsed.get_backend_name() == "sqlite":
        database = parsed.database
        if database and database != ":memory:":
            Path(database).parent.mkdir(parents=True, exist_ok=True)
            sqlite_file = SqliteFile(Path(database).absolute())
            if health is not None:
                health.watch(sqlite_file.problem)
        kwargs["connect_args"] = {"timeout": SQLITE_BUSY_TIMEOUT_MS / 1000, "check_same_thread": False}
    else:
        kwargs["pool_pre_ping"] = True
    engine = create_engine(url, **kwargs)
    if parsed.get_backend_name() == "sqlite":
        event.listen(engine, "handle_error", _sqlite_error(parsed.database or url))
        event.listen(engine, "connect", _sqlite_pragmas)
        if sqlite_file is not None:
            event.listen(engine, "do_connect", sqlite_file.before_connect)
            event.listen(engine, "connect", sqlite_file.after_connect)
        # pysqlite's own transaction handling defers BEGIN; we emit it ourselves so that writers
        # (engine.execution_options(sqlite_immediate=True)) take the write lock up front and two
        # processes never deadlock upgrading read locks (SQLITE_BUSY without waiting).
        event.listen(engine, "begin", _sqlite_begin(sqlite_file, health))
    # After the SQLite hook: its disk-full and unreadable-file errors win over "unavailable".
    event.listen(engine, "handle_error", _unavailable(parsed.get_backend_name(), health))
    if health is not None:
        event.listen(engine, "after_cursor_execute", _available(parsed.get_backend_name(), health))
    return engine


def _unavailable(backend: str, health: CatalogHealth | None) -> Any:
    """A ``handle_error`` hook: connection failures, lost connections and a SQLite file locked
    past its busy timeout become :class:`CatalogUnavailableError` with a reason of our own.

    Integrity and programming errors are left alone (they are bugs or conflicts, not outages).
    A failed pre-ping is left to the pool, which then opens a fresh connection.
    """

    def handle(context: ExceptionContext) -> None:
        if context.is_pre_ping:
            return
        wrapped = context.sqlalchemy_exception
        if not (context.is_disconnect or isinstance(wrapped, exc.OperationalError | exc.InterfaceError)):
            return
        if backend == "sqlite" and not _sqlite_unavailable(str(context.original_exception)):
            return  # e.g. "no such table": a catalog that needs `cachesvc db upgrade`, not an outage
        reason = _short_reason(backend, context)
        outage = (
            backend == "sqlite"
            or context.connection is None
            or context.is_disconnect
            or isinstance(wrapped, exc.InterfaceError)
        )
        if health is not None and outage:
            # A server that refuses one statement (a serialization failure, a lock timeout)
            # is busy, not down: that request gets its 503, /health stays "ok".
            health.failed(reason)
        raise CatalogUnavailableError(reason) from context.original_exception

    return handle


def _short_reason(backend: str, context: ExceptionContext) -> str:
    """What went wrong, in our words: the driver's text may name hosts, users, paths and SQL."""
    original = context.original_exception
    if backend == "sqlite":
        if "unable to open" in str(original):
            return "the SQLite file cannot be opened"
        if "readonly" in str(original):
            return READ_ONLY
        waited = SQLITE_BUSY_TIMEOUT_MS / 1000
        return f"the SQLite file is locked by another process (waited {waited:g} s)"
    if context.connection is None:
        return "cannot connect to the database server"
    if context.is_disconnect:
        return "lost the connection to the database server"
    return f"the database server failed the operation ({type(original).__name__})"


#: SQLite errors that go away by themselves: another writer's lock, a file not reachable now.
_SQLITE_UNAVAILABLE = ("database is locked", "database table is locked", "busy", "unable to open", "readonly")


def _sqlite_unavailable(message: str) -> bool:
    return any(text in message for text in _SQLITE_UNAVAILABLE)


def _available(backend: str, health: CatalogHealth) -> Any:
    """An ``after_cursor_execute`` hook: a statement that went through ends an outage. On SQLite
    only a write transaction's ``BEGIN IMMEDIATE`` counts (reads go on while a writer holds the
    lock, so a read proves nothing about the outage writes see)."""

    def after(conn: Any, cursor: Any, statement: str, *args: Any) -> None:
        if backend == "sqlite" and not statement.startswith("BEGIN IMMEDIATE"):
            return
        health.succeeded()

    return after


#: SQLite messages that mean the file is not a usable database (not a busy or locked one).
_UNREADABLE = ("file is not a database", "database disk image is malformed")


def _sqlite_error(where: str) -> Any:
    """A ``handle_error`` hook: one-line errors with the repair for a broken or full catalog.

    Without it every command dies in a page-long SQLAlchemy traceback on a garbage file.
    """

    def handle(context: ExceptionContext) -> None:
        message = str(context.original_exception)
        if "disk I/O error" in message and _nearly_full(where):
            message = "database or disk is full"  # SQLite says I/O error when WAL files cannot grow
        if "disk I/O error" in message:
            raise CatalogError(
                f"the catalog {where} cannot be read or written (disk I/O error); check the disk and "
                "its free space, then retry"
            ) from context.original_exception
        if "database or disk is full" in message:
            raise InsufficientStorageError(
                f"the disk holding the catalog {where} is full; free space (e.g. `cachesvc prune`) and retry"
            ) from context.original_exception
        if any(text in message for text in _UNREADABLE):
            raise CatalogError(
                f"the catalog {where} cannot be read ({message}); run `cachesvc db repair` to move it "
                "aside and re-adopt the bundles on disk (nothing in the cache is lost)"
            ) from context.original_exception

    return handle


def _nearly_full(database: str) -> bool:
    try:
        return shutil.disk_usage(Path(database).parent).free < 1024 * 1024
    except OSError:
        return False


def move_sqlite_aside(url: str) -> Path | None:
    """Rename a SQLite catalog file (and its ``-wal``/``-shm``) to ``<name>.broken-<time>``.

    Returns the new path of the main file; None when the URL is not a SQLite file or the file
    does not exist. The caller then opens a fresh catalog and reconciles: bundles on disk are
    re-adopted from their manifests.
    """
    parsed = make_url(url)
    if parsed.get_backend_name() != "sqlite" or not parsed.database or parsed.database == ":memory:":
        return None
    path = Path(parsed.database)
    if not path.exists():
        return None
    stamp = datetime.now(UTC).strftime("%Y%m%dT%H%M%SZ")
    target = path.with_name(f"{path.name}.broken-{stamp}")
    for suffix in ("-wal", "-shm"):
        side = path.with_name(path.name + suffix)
        if side.exists():
            os.replace(side, target.with_name(target.name + suffix))
    os.replace(path, target)
    return target


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


def _sqlite_begin(sqlite_file: SqliteFile | None, health: CatalogHealth | None) -> Any:
    """A ``begin`` hook: refuse the transaction while the file is not usable, else BEGIN
    (IMMEDIATE for writers)."""

    def begin(conn: Any) -> None:
        reason = sqlite_file.problem() if sqlite_file is not None else None
        if reason is not None:
            if health is not None:
                health.failed(reason)
            raise CatalogUnavailableError(reason)
        immediate = conn.get_execution_options().get("sqlite_immediate", False)
        conn.exec_driver_sql("BEGIN IMMEDIATE" if immediate else "BEGIN")

    return begin


#: The reasons :meth:`SqliteFile.problem` gives (the outage's one line says them).
DELETED = (
    "the SQLite file was deleted or moved away while the server ran; put it back (or restart: a "
    "new catalog re-adopts the bundles on disk, pins and aliases start afresh)"
)
REPLACED = "the SQLite file was replaced by another file while the server ran; restart to open it"
READ_ONLY = "the SQLite file is read-only; make it writable again"


class SqliteFile:
    """The catalog's SQLite file, as this process opened it: the one liveness check of a SQLite
    catalog (issue 30).

    An open connection goes on reading and writing a file that was deleted or replaced (the
    inode it holds), and a new connection would create an empty catalog in its place; both lose
    every write. So the file's identity (device and inode) is recorded at the first connection,
    and :meth:`problem` (a ``stat`` and an ``access``: microseconds) is asked before every
    transaction and for ``/health``: a file gone, replaced or not writable is an outage. Once
    the file was opened, later connections never create it (``mode=rw``)."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._identity: tuple[int, int] | None = None

    def problem(self) -> str | None:
        """Why the catalog file cannot be used now, or None (also None before it was opened)."""
        if self._identity is None:
            return None
        try:
            st = os.stat(self.path)
        except FileNotFoundError:
            return DELETED
        except OSError:
            return "the SQLite file cannot be examined"
        if (st.st_dev, st.st_ino) != self._identity:
            return REPLACED
        if not os.access(self.path, os.W_OK):
            return READ_ONLY
        return None

    def before_connect(self, dialect: Any, conn_rec: Any, cargs: list[Any], cparams: dict[str, Any]) -> None:
        """A ``do_connect`` hook: after the first connection, open the existing file only."""
        if self._identity is None:
            return
        reason = self.problem()
        if reason is not None:
            raise CatalogUnavailableError(reason)
        cargs[0] = f"{self.path.as_uri()}?mode=rw"
        cparams["uri"] = True

    def after_connect(self, dbapi_conn: Any, _record: Any) -> None:
        """A ``connect`` hook (after the pragmas, which create the file): record its identity."""
        if self._identity is None:
            st = os.stat(self.path)
            self._identity = (st.st_dev, st.st_ino)
