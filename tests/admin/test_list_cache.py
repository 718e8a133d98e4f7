"""The bundle listing is answered from memory only while the catalog is unchanged."""

from __future__ import annotations

from datetime import timedelta
from pathlib import Path

from litestar import Litestar
from litestar.testing import TestClient

from cachesvc.cache.catalog import utcnow
from cachesvc.cache.manager import CacheManager
from tests.admin.conftest import open_manager, seed_rows


def ids(client: TestClient[Litestar], query: str = "") -> list[str]:
    r = client.get(f"/admin/bundles{query}")
    assert r.status_code == 200, r.text
    return [b["id"] for b in r.json()["items"]]


def test_every_change_shows_in_the_next_listing(
    client: TestClient[Litestar], manager: CacheManager, cache_dir: Path
) -> None:
    bundles = seed_rows(manager, 3)
    before = ids(client)
    assert sorted(before) == sorted(bundles)
    assert ids(client) == before  # same answer again (from memory)

    manager.catalog.bundles.set_pinned(bundles[0], True)  # an event
    items = client.get("/admin/bundles").json()["items"]
    assert [b["pinned"] for b in items if b["id"] == bundles[0]] == [True]

    manager.catalog.bundles.touch(bundles[2], utcnow() + timedelta(days=1))  # no event, still seen
    assert ids(client)[0] == bundles[2]

    # A change made by another process sharing the catalog is seen too.
    other = open_manager(cache_dir)
    try:
        other.evictor.remove(bundles[1])
    finally:
        other.close()
    assert bundles[1] not in ids(client)
    assert client.get("/admin/bundles").json()["total"] == 2
