"""Fleet fixtures: several nodes (managers with their own cache dirs) on one shared catalog."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from cachesvc.cache.manager import CacheManager
from tests.support.cache import FileBuilder
from tests.support.databases import shared_catalog_url


@pytest.fixture
def fleet_url(tmp_path: Path, catalog_db: str) -> str:
    """One catalog for every node of the test: a PostgreSQL database or a shared SQLite file."""
    return shared_catalog_url("fleet") or f"sqlite:///{tmp_path / 'fleet.sqlite3'}"


@pytest.fixture
def open_node(tmp_path: Path, fleet_url: str) -> Iterator[Callable[..., CacheManager]]:
    """``open_node(name, cap=...)``: a manager for node ``name`` with its own cache directory."""
    opened: list[CacheManager] = []

    def open_(name: str, *, cap: int = 10**12, builder: FileBuilder | None = None) -> CacheManager:
        m = CacheManager.open(
            tmp_path / f"cache-{name}",
            catalog_url=fleet_url,
            node=name,
            max_size_bytes=cap,
            builders={"onnxruntime": builder or FileBuilder(files=2, file_size=1000)},
            offline=True,
        )
        opened.append(m)
        return m

    yield open_
    for m in opened:
        m.close()
