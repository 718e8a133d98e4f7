"""Fixtures shared by every suite."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests.support.databases import PG_URL_ENV, catalog_backend, pg_server_url


@pytest.fixture(params=["sqlite", "postgresql"])
def catalog_db(request: pytest.FixtureRequest) -> Iterator[str]:
    """Run the test once on SQLite and once on PostgreSQL (the catalog suites use this)."""
    kind = str(request.param)
    if kind == "postgresql" and pg_server_url() is None:
        pytest.skip(f"no PostgreSQL server configured ({PG_URL_ENV} unset; .ci/run starts one)")
    with catalog_backend(kind):
        yield kind
