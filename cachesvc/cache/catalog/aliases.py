"""The ``model_aliases`` table: operator-given served names of a bundle or a checkpoint."""

from __future__ import annotations

from sqlalchemy import select

from cachesvc.cache.catalog.base import CatalogTable, utcnow
from cachesvc.cache.catalog.models import AliasRow
from cachesvc.cache.records import AliasInfo
from cachesvc.errors import ConfigError, NotFoundError


class AliasTable(CatalogTable):
    """Set, remove and list aliases."""

    def set(self, name: str, *, bundle_id: str | None = None, model: str | None = None) -> AliasInfo:
        """Create or replace the alias ``name`` (exactly one of ``bundle_id``, ``model``)."""
        if (bundle_id is None) == (model is None):
            raise ConfigError("bundle_id", "give exactly one of bundle_id and model")
        self.core.untracked_changes += 1  # listings name models by alias: their caches go stale
        with self.core.tx() as session:
            row = session.get(AliasRow, name)
            if row is None:
                row = AliasRow(name=name, created_at=utcnow())
                session.add(row)
            row.bundle_id, row.model = bundle_id, model
            return AliasInfo(name=name, bundle_id=bundle_id, model=model, created_at=row.created_at)

    def remove(self, name: str) -> None:
        """Delete the alias ``name`` (NotFoundError when there is none)."""
        self.core.untracked_changes += 1
        with self.core.tx() as session:
            row = session.get(AliasRow, name)
            if row is None:
                raise NotFoundError(f"no model alias named {name!r}")
            session.delete(row)

    def all(self) -> list[AliasInfo]:
        """Every alias, by name."""
        with self.core.read() as session:
            rows = session.scalars(select(AliasRow).order_by(AliasRow.name)).all()
            return [
                AliasInfo(name=r.name, bundle_id=r.bundle_id, model=r.model, created_at=r.created_at)
                for r in rows
            ]
