"""The catalog database goes away while the server runs (issue 22, item 1).

A real PostgreSQL cluster owned by the test is stopped and started again under a real server;
a real SQLite catalog file is write-locked by another connection past the busy timeout. While
the catalog is unavailable every catalog-backed route answers 503 with ``Retry-After`` and one
line of our own (never the driver's text), the outage is logged once, loaded models keep
serving, serving metrics stay exported, builds are refused up front; afterwards everything
works again without a restart.
"""

from __future__ import annotations

import logging
import sqlite3
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from sqlalchemy import create_engine, text
from sqlalchemy.engine import make_url

from cachesvc.cache.catalog import Catalog
from cachesvc.cache.catalog import session as catalog_session
from cachesvc.cache.manager import CacheManager
from cachesvc.errors import CatalogUnavailableError
from tests.admin.conftest import open_manager
from tests.support.cache import FileBuilder, make_checkpoint
from tests.support.pg_cluster import PgCluster, own_cluster
from tests.support.whole_app import App, running_app

COMPLETION = {"model": "tiny", "prompt": "hi", "max_tokens": 2}


@pytest.fixture
def cluster() -> Iterator[PgCluster]:
    pg = own_cluster()
    try:
        yield pg
    finally:
        pg.destroy()


def _manager(cache: Path, url: str | None) -> CacheManager:
    return CacheManager.open(
        cache,
        catalog_url=url,
        max_size_bytes=10**12,
        builders={"onnxruntime": FileBuilder(files=2, file_size=256)},
        offline=True,
    )


def _assert_catalog_503(r: httpx.Response, *, openai: bool) -> str:
    assert r.status_code == 503, r.text
    assert int(r.headers["retry-after"]) > 0
    message = r.json()["error"]["message"] if openai else r.json()["detail"]
    assert message.startswith("catalog unavailable: "), message
    assert "\n" not in message
    return str(message)


def _outage_checks(app: App, cold_model: str, bundle_id: str) -> list[str]:
    """Everything that must hold while the catalog is unavailable; the messages seen."""
    messages: list[str] = []
    with app.http() as h:
        for _ in range(5):  # repeated: logged once, not per request
            messages.append(_assert_catalog_503(h.get("/admin/bundles"), openai=False))
        messages.append(_assert_catalog_503(h.put(f"/admin/bundles/{bundle_id}/pin"), openai=False))
        messages.append(_assert_catalog_503(h.get("/admin/stats"), openai=False))
        messages.append(_assert_catalog_503(h.get("/admin/events"), openai=False))
        messages.append(_assert_catalog_503(h.get("/admin/models"), openai=False))
        messages.append(_assert_catalog_503(h.get("/admin/nodes"), openai=False))
        messages.append(_assert_catalog_503(h.get("/metrics", params={"node": "other"}), openai=False))
        r = h.post("/admin/builds", json={"model": cold_model})
        messages.append(_assert_catalog_503(r, openai=False))  # refused, not 202 then failed
        assert h.get("/admin/builds").json()["items"] == []
        r = h.get("/v1/models")
        messages.append(_assert_catalog_503(r, openai=True))
        assert r.json()["error"]["code"] == "catalog_unavailable"
        r = h.post("/v1/completions", json={**COMPLETION, "model": cold_model})
        messages.append(_assert_catalog_503(r, openai=True))  # a cold load needs the catalog
        # The loaded model keeps serving.
        for _ in range(3):
            r = h.post("/v1/completions", json=COMPLETION)
            assert r.status_code == 200, r.text
        metrics = h.get("/metrics")
        assert metrics.status_code == 200, metrics.text
        assert "cachesvc_catalog_up 0.0" in metrics.text
        # This process's serving figures stay (the test's startup model has no observer of its
        # own, so the request metrics stand for them).
        assert 'cachesvc_http_requests_total{method="POST",route="/v1/completions",status="200"}' in (
            metrics.text
        )
        health = h.get("/health").json()
        assert health["catalog"]["status"] == "unavailable", health
        assert health["catalog"]["reason"]
        assert h.get("/health/ready").status_code == 200
    return messages


def _recovered(app: App, bundle_id: str) -> None:
    with app.http() as h:
        deadline = time.monotonic() + 30
        while h.get("/admin/bundles").status_code != 200:
            assert time.monotonic() < deadline, "the catalog did not come back without a restart"
            time.sleep(0.2)
        assert h.put(f"/admin/bundles/{bundle_id}/pin").status_code == 200
        assert h.get("/v1/models").status_code == 200
        assert h.get("/health").json()["catalog"]["status"] == "ok"
        assert "cachesvc_catalog_up 1.0" in h.get("/metrics").text


class _Records(logging.Handler):
    """Every record of the ``cachesvc`` and ``inference`` loggers at INFO and above (the app
    logs from its worker threads too; the fixture sets both loggers to INFO for the test)."""

    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)


@pytest.fixture
def logs() -> Iterator[_Records]:
    handler = _Records()
    loggers = [logging.getLogger(name) for name in ("cachesvc", "inference")]
    levels = [logger.level for logger in loggers]
    for logger in loggers:
        logger.addHandler(handler)
        logger.setLevel(logging.INFO)
    try:
        yield handler
    finally:
        for logger, level in zip(loggers, levels, strict=True):
            logger.removeHandler(handler)
            logger.setLevel(level)


def _logged_once(logs: _Records) -> None:
    messages = [r.getMessage() for r in logs.records]
    starts = [m for m in messages if m.startswith("catalog unavailable: ")]
    assert len(starts) == 1, starts
    assert len([m for m in messages if m.startswith("catalog available again")]) == 1, messages
    tracebacks = [r.getMessage() for r in logs.records if r.exc_info and r.levelno >= logging.WARNING]
    assert not tracebacks, tracebacks


def test_postgresql_stopped_and_started(tmp_path: Path, cluster: PgCluster, logs: _Records) -> None:
    manager = _manager(tmp_path / "cache", cluster.url)
    other = make_checkpoint(tmp_path / "models" / "other", seed=9)
    with running_app(tmp_path, manager=manager, allowed_model_roots=str(tmp_path)) as app:
        cold = manager.prepare(str(other))  # a ready bundle, not loaded
        cluster.stop()
        try:
            messages = _outage_checks(app, str(other), cold.bundle_id)
        finally:
            cluster.start()
        for message in messages:
            assert "psycopg" not in message and str(cluster.dir) not in message, message
        _recovered(app, cold.bundle_id)
    _logged_once(logs)


def test_sqlite_locked_past_its_timeout(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, logs: _Records
) -> None:
    monkeypatch.setattr(catalog_session, "SQLITE_BUSY_TIMEOUT_MS", 300)
    manager = _manager(tmp_path / "cache", None)
    other = make_checkpoint(tmp_path / "models" / "other", seed=9)
    with running_app(tmp_path, manager=manager, allowed_model_roots=str(tmp_path)) as app:
        cold = manager.prepare(str(other))
        holder = sqlite3.connect(tmp_path / "cache" / "catalog.sqlite3", isolation_level=None)
        holder.execute("BEGIN EXCLUSIVE")  # another process's writer that does not let go
        try:
            with app.http() as h:
                for _ in range(3):
                    r = h.put(f"/admin/bundles/{cold.bundle_id}/pin")
                    message = _assert_catalog_503(r, openai=False)
                    assert "locked" in message
                r = h.post("/admin/builds", json={"model": str(other)})
                _assert_catalog_503(r, openai=False)
                assert h.post("/v1/completions", json=COMPLETION).status_code == 200
                assert "cachesvc_catalog_up 0.0" in h.get("/metrics").text
                assert h.get("/health").json()["catalog"]["status"] == "unavailable"
                # Nothing changed: the pin was refused.
                assert not manager.catalog.bundles.require(cold.bundle_id).pinned
        finally:
            holder.execute("ROLLBACK")
            holder.close()
        with app.http() as h:
            assert h.put(f"/admin/bundles/{cold.bundle_id}/pin").status_code == 200
            assert h.get("/health").json()["catalog"]["status"] == "ok"
    _logged_once(logs)


def test_a_statement_refused_by_a_running_server_is_503_but_no_outage(
    tmp_path: Path, catalog_db: str
) -> None:
    if catalog_db != "postgresql":
        pytest.skip("a lock timeout of a running server: PostgreSQL")
    manager = open_manager(tmp_path / "cache")
    bid = manager.prepare(str(make_checkpoint(tmp_path / "ckpt", seed=8))).bundle_id
    url = make_url(manager.catalog.url).update_query_dict({"options": "-c lock_timeout=200"})
    impatient = Catalog(url.render_as_string(hide_password=False), node=manager.node)
    holder = create_engine(manager.catalog.url)
    try:
        with holder.begin() as conn:  # another writer holds the bundle's row
            conn.execute(text("SELECT 1 FROM bundles WHERE id = :id FOR UPDATE"), {"id": bid})
            with pytest.raises(CatalogUnavailableError) as caught:
                impatient.bundles.set_pinned(bid, True)
        # The error class names the cause; the driver's sentence ("canceling statement ...") stays out.
        assert str(caught.value) == (
            "catalog unavailable: the database server failed the operation (LockNotAvailable)"
        )
        assert impatient.state().available, "one refused statement is not an outage"
        assert impatient.bundles.set_pinned(bid, True).pinned
    finally:
        holder.dispose()
        impatient.close()
        manager.close()
