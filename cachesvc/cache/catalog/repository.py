"""The catalog: the SQL index of the cache, one repository per table over one database.

ORM rows stay in this package; callers get ``cachesvc.cache.records``.
"""

from __future__ import annotations

from sqlalchemy import literal, select

from cachesvc.cache.catalog.adapters import AdapterTable
from cachesvc.cache.catalog.aliases import AliasTable
from cachesvc.cache.catalog.base import CatalogCore, utcnow
from cachesvc.cache.catalog.bundles import BundleTable
from cachesvc.cache.catalog.checkpoints import CheckpointTable
from cachesvc.cache.catalog.events import EventTable
from cachesvc.cache.catalog.leases import LeaseTable
from cachesvc.cache.records import CatalogState

__all__ = ["Catalog", "utcnow"]


class Catalog:
    """The SQL index of the cache: one repository per table (``bundles``, ``checkpoints``,
    ``events``, ``leases``, ``aliases``, ``adapters``) over one :class:`CatalogCore` (the
    engine, its sessions, this node). Every table method is one short transaction.

    Fleet rule: writes and the eviction/reconcile reads touch only this catalog's ``node``
    (its own disk); listings, events and stats take a ``node`` filter. Rows changed inside a
    write transaction are read ``FOR UPDATE`` (a row lock on PostgreSQL; SQLite's
    ``BEGIN IMMEDIATE`` already serialises writers).
    """

    def __init__(self, url: str, *, node: str) -> None:
        #: The engine, its sessions and this node's name, shared by every table.
        self.core = CatalogCore(url, node=node)
        self.url = url
        self.node = node
        self.engine = self.core.engine
        #: Up/down state of the database (``/health``); fed by the engine's error hooks.
        self.health = self.core.health
        self.bundles = BundleTable(self.core)
        self.checkpoints = CheckpointTable(self.core)
        self.events = EventTable(self.core)
        self.leases = LeaseTable(self.core)
        self.aliases = AliasTable(self.core)
        self.adapters = AdapterTable(self.core)

    # -- lifecycle -------------------------------------------------------------------------

    def upgrade(self, revision: str = "head") -> None:
        """Bring the schema to ``revision`` with Alembic (the app does this on start)."""
        from cachesvc.cache.catalog.migrate import upgrade

        upgrade(self.engine, revision)

    def current_revision(self) -> str | None:
        """The schema revision the database is at (None when never migrated)."""
        from cachesvc.cache.catalog.migrate import current_revision

        return current_revision(self.engine)

    def close(self) -> None:
        """Dispose of pooled connections."""
        self.engine.dispose()

    def ping(self) -> None:
        """One write transaction that changes nothing: raises :class:`CatalogUnavailableError`
        when the database cannot take a write now (a server down, or on SQLite another process
        holding the write lock past the busy timeout)."""
        with self.core.tx() as session:
            session.execute(select(literal(1)))

    def state(self) -> CatalogState:
        """Whether the database answered the last operation (``/health``)."""
        return self.health.state()
