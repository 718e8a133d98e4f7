"""The one liveness check of a SQLite catalog: the file this process opened is still there (same
device and inode) and writable (issue 30, item 3).

A real catalog file is deleted or replaced under an open catalog: every transaction is refused
with one line of our own (nothing is written to the unlinked inode, no new empty file appears
in its place, the replacement is never touched), the state says unavailable, and putting the
very file back ends the outage without reopening anything.
"""

from __future__ import annotations

import os
import sqlite3
from pathlib import Path

import pytest

from cachesvc.cache.catalog import Catalog
from cachesvc.cache.catalog.session import DELETED, REPLACED, default_catalog_url
from cachesvc.errors import CatalogUnavailableError


def _catalog(tmp_path: Path) -> tuple[Catalog, Path]:
    catalog = Catalog(default_catalog_url(tmp_path), node="n")
    catalog.upgrade()
    catalog.ping()
    return catalog, tmp_path / "catalog.sqlite3"


def _refused(catalog: Catalog, reason: str) -> None:
    with pytest.raises(CatalogUnavailableError) as caught:
        catalog.ping()  # a write transaction
    assert str(caught.value) == f"catalog unavailable: {reason}"
    with pytest.raises(CatalogUnavailableError):
        catalog.aliases.all()  # a read: the data it would show is no longer the catalog's
    catalog.engine.dispose()  # a new connection neither creates the file nor opens another one
    with pytest.raises(CatalogUnavailableError):
        catalog.aliases.all()
    state = catalog.state()
    assert not state.available and state.reason == reason


def test_a_deleted_file_is_an_outage_and_never_created_again(tmp_path: Path) -> None:
    catalog, path = _catalog(tmp_path)
    aside = tmp_path / "aside.sqlite3"
    try:
        os.rename(path, aside)
        _refused(catalog, DELETED)
        assert not path.exists()
        os.rename(aside, path)  # the very file is back: the next write ends the outage
        catalog.ping()
        assert catalog.state().available
        catalog.aliases.set("back", model="org/m")
        assert [a.name for a in catalog.aliases.all()] == ["back"]
    finally:
        catalog.close()


def test_a_replaced_file_is_an_outage_and_the_replacement_is_not_touched(tmp_path: Path) -> None:
    catalog, path = _catalog(tmp_path)
    other = tmp_path / "other.sqlite3"
    with sqlite3.connect(other) as conn:
        conn.execute("CREATE TABLE t (x)")
    before = other.read_bytes()
    try:
        os.replace(other, path)
        _refused(catalog, REPLACED)
        assert path.read_bytes() == before
    finally:
        catalog.close()
