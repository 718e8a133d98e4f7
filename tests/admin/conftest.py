"""Fixtures for the admin API tests: a real CacheManager on tmp_path behind the real app.

The app is ``cachesvc.serving.app.create_app`` itself (see :mod:`tests.support.apps`), so the tests
exercise the wiring ``cachesvc serve`` uses; only the peer address is set by the test.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import pytest
from litestar import Litestar
from litestar.testing import TestClient

from cachesvc.cache.manager import CacheManager
from cachesvc.cache.profiles import BuildOptions, BundleKey
from cachesvc.http.metrics import MetricsState
from tests.support.apps import LOOPBACK, LOOPBACK_URL, service_app
from tests.support.cache import FileBuilder, make_checkpoint
from tests.support.databases import catalog_url_for

ADMIN_KEY = "admin-secret-key"
COMPLETION_KEY = "completion-secret-key"
REMOTE = "203.0.113.7"
MAX_SIZE = 10**12


def build_app(
    manager: CacheManager, *, admin_api_key: str | None = None, peer: str = LOOPBACK
) -> tuple[Litestar, MetricsState]:
    """The service's own app (``create_app``) over ``manager``, requests arriving from ``peer``.

    Builds may read checkpoints from the test's own directory (the cache's parent), as an
    operator would allow with ``--allowed-model-roots``.
    """
    roots = str(manager.layout.root.parent)
    return service_app(manager, peer=peer, admin_api_key=admin_api_key, allowed_model_roots=roots)


def open_manager(cache_dir: Path, builder: FileBuilder | None = None) -> CacheManager:
    """A real manager (SQLite catalog, locks, store) with the small file-writing test builder.

    Offline: a generated model name such as ``org/x`` fails fast instead of reaching the hub.
    """
    return CacheManager.open(
        cache_dir,
        catalog_url=catalog_url_for(cache_dir),
        max_size_bytes=MAX_SIZE,
        builders={"onnxruntime": builder or FileBuilder(files=3, file_size=256)},
        offline=True,
    )


@pytest.fixture
def cache_dir(tmp_path: Path, catalog_db: str) -> Path:
    """The test's cache directory; every admin test runs on SQLite and on PostgreSQL."""
    return tmp_path / "cache"


@pytest.fixture
def builder() -> FileBuilder:
    return FileBuilder(files=3, file_size=256)


@pytest.fixture
def manager(cache_dir: Path, builder: FileBuilder) -> Iterator[CacheManager]:
    m = open_manager(cache_dir, builder)
    try:
        yield m
    finally:
        m.close()


@pytest.fixture
def checkpoint(tmp_path: Path) -> Path:
    return make_checkpoint(tmp_path / "models" / "tiny", seed=1)


@pytest.fixture
def make_client(manager: CacheManager) -> Iterator[Callable[..., TestClient[Litestar]]]:
    """``make_client(admin_api_key=..., peer=...)`` -> an entered TestClient (closed at teardown)."""
    clients: list[TestClient[Litestar]] = []

    def make(*, admin_api_key: str | None = None, peer: str = LOOPBACK) -> TestClient[Litestar]:
        app, _ = build_app(manager, admin_api_key=admin_api_key, peer=peer)
        client = TestClient(app, base_url=LOOPBACK_URL, raise_server_exceptions=False)
        client.__enter__()
        clients.append(client)
        return client

    yield make
    for client in clients:
        client.__exit__(None, None, None)


@pytest.fixture
def client(make_client: Callable[..., TestClient[Litestar]]) -> TestClient[Litestar]:
    """Loopback client, no admin key configured."""
    return make_client()


def seed_rows(manager: CacheManager, count: int, *, start: datetime | None = None) -> list[str]:
    """Insert ``count`` ready bundle rows through the catalog API (no files: list tests only).

    Sizes, creation and last-use times and hit counts differ per row so every sort key orders
    them differently; every 7th is pinned, models alternate between three names.
    """
    base = start or datetime(2025, 1, 1, tzinfo=UTC)
    ids: list[str] = []
    for i in range(count):
        digest = f"{i + 1:016x}" + "ab" * 24
        opts = BuildOptions(max_input_len=128 + (i % 5), builder_version="seed")
        key = BundleKey.of(digest, opts)
        bid = key.id
        manager.catalog.bundles.adopt(
            key,
            model=f"org/model-{i % 3}",
            size_bytes=1000 + (i * 7919) % 5003,
            file_count=3,
            built_at=base + timedelta(minutes=(i * 37) % count),
        )
        used = base + timedelta(hours=1, seconds=(i * 53) % (count * 2) + i * 1e-3)
        manager.catalog.bundles.touch(bid, used)
        if i % 7 == 0:
            manager.catalog.bundles.set_pinned(bid, True)
        ids.append(bid)
    return ids


def problem(response: Any) -> dict[str, Any]:
    """The problem body of an error response (asserts the media type)."""
    assert response.headers["content-type"].startswith("application/problem+json"), response.text
    body: dict[str, Any] = response.json()
    assert body["status"] == response.status_code
    assert body["type"].startswith("urn:cachesvc:problem:")
    assert body["title"] and body["detail"]
    return body
