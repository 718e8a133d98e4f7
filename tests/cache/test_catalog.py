"""Catalog schema and queries on a real SQLite file and on a real PostgreSQL database."""

from __future__ import annotations

import sqlite3
from datetime import timedelta
from pathlib import Path

import pytest
from alembic.autogenerate import compare_metadata
from alembic.migration import MigrationContext
from sqlalchemy import inspect, text
from sqlalchemy.exc import IntegrityError

from cachesvc.cache.catalog import Catalog, utcnow
from cachesvc.cache.catalog.migrate import downgrade, head_revision
from cachesvc.cache.catalog.models import Base
from cachesvc.cache.profiles import BundleKey
from cachesvc.errors import ConfigError, NotFoundError
from tests.support.databases import catalog_url_for

pytestmark = pytest.mark.usefixtures("catalog_db")


def catalog(tmp_path: Path) -> Catalog:
    url = catalog_url_for(tmp_path) or f"sqlite:///{tmp_path / 'catalog.sqlite3'}"
    c = Catalog(url, node="test-node")
    c.upgrade()
    return c


def add(c: Catalog, i: int, *, model: str = "m", size: int = 100, backend: str = "onnxruntime") -> str:
    bid = f"{i:016x}-{i:012x}"
    key = BundleKey(
        id=bid,
        checkpoint_digest=f"{i:064x}",
        draft_digest=None,
        profile={"i": i},
        name=f"p{i}",
        backend=backend,
        relpath=Path(f"engines/{i:016x}/p{i}"),
    )
    c.bundles.adopt(
        key,
        model=model,
        size_bytes=size,
        file_count=3,
        built_at=utcnow() - timedelta(days=1),
    )
    return bid


def test_upgrade_downgrade_upgrade_on_fresh_file(tmp_path: Path) -> None:
    c = catalog(tmp_path)
    assert c.current_revision() == head_revision()
    tables = set(inspect(c.engine).get_table_names())
    assert {"bundles", "checkpoints", "leases", "events", "event_totals", "alembic_version"} <= tables
    downgrade(c.engine, "base")
    assert c.current_revision() is None
    assert set(inspect(c.engine).get_table_names()) <= {"alembic_version"}
    c.upgrade()
    assert c.current_revision() == head_revision()
    c.upgrade()  # idempotent


def test_migrated_schema_matches_models(tmp_path: Path) -> None:
    c = catalog(tmp_path)
    with c.engine.connect() as conn:
        ctx = MigrationContext.configure(conn, opts={"compare_type": True, "compare_server_default": True})
        assert compare_metadata(ctx, Base.metadata) == []


def test_sqlite_pragmas(tmp_path: Path, catalog_db: str) -> None:
    if catalog_db != "sqlite":
        pytest.skip("SQLite connection pragmas")
    c = catalog(tmp_path)
    with c.engine.connect() as conn:
        assert conn.exec_driver_sql("PRAGMA journal_mode").scalar() == "wal"
        assert conn.exec_driver_sql("PRAGMA foreign_keys").scalar() == 1
        assert (conn.exec_driver_sql("PRAGMA busy_timeout").scalar() or 0) >= 1000
    # Foreign keys are enforced: a lease for an unknown bundle is refused.
    with pytest.raises(Exception, match="FOREIGN KEY"):
        c.leases.add("nope", 1)
    # The file really is a SQLite database another client can read.
    with sqlite3.connect(tmp_path / "catalog.sqlite3") as raw:
        assert raw.execute("select count(*) from bundles").fetchone() == (0,)


def test_timestamps_are_utc_aware(tmp_path: Path) -> None:
    c = catalog(tmp_path)
    bid = add(c, 1)
    info = c.bundles.require(bid)
    assert info.created_at.tzinfo is not None and info.created_at.utcoffset() == timedelta(0)


def test_pagination_cursor_and_offset_cover_each_row_once(tmp_path: Path) -> None:
    c = catalog(tmp_path)
    ids = [add(c, i, size=(i * 37) % 11) for i in range(57)]
    base = utcnow() - timedelta(hours=1)
    for i, bid in enumerate(ids):
        c.bundles.touch(bid, base + timedelta(seconds=i % 7))  # many ties: the id breaks them
    for sort in ("last_used", "size", "created", "hits"):
        for order in ("asc", "desc"):
            seen: list[str] = []
            cursor = None
            while True:
                page = c.bundles.page(sort=sort, order=order, limit=10, cursor=cursor)
                assert page.total == 57
                seen += [b.id for b in page.items]
                cursor = page.next_cursor
                if cursor is None:
                    break
            assert sorted(seen) == sorted(ids) and len(seen) == 57, (sort, order)
            by_offset: list[str] = []
            offset = 0
            while True:
                page = c.bundles.page(sort=sort, order=order, limit=10, offset=offset)
                by_offset += [b.id for b in page.items]
                if page.next_offset is None:
                    break
                offset = page.next_offset
            assert by_offset == seen
    sizes = [b.size_bytes for b in c.bundles.page(sort="size", order="asc", limit=100).items]
    assert sizes == sorted(sizes)


def test_filters_and_totals(tmp_path: Path) -> None:
    c = catalog(tmp_path)
    a = [add(c, i, model="a", size=10) for i in range(3)]
    add(c, 10, model="b", size=5, backend="tensorrt")
    c.bundles.set_pinned(a[0], True)
    assert c.bundles.page(model="a").total == 3
    assert c.bundles.page(model="a").total_bytes == 30
    assert c.bundles.page(backend="tensorrt").total == 1
    assert [b.id for b in c.bundles.page(pinned=True).items] == [a[0]]
    assert c.bundles.page(pinned=False).total == 3
    assert c.bundles.page(state="failed").total == 0
    with pytest.raises(ConfigError, match="sort"):
        c.bundles.page(sort="nope")
    with pytest.raises(ConfigError, match="cursor"):
        c.bundles.page(cursor="garbage!")
    cursor = c.bundles.page(sort="size", limit=1).next_cursor
    assert cursor is not None
    with pytest.raises(ConfigError, match="cursor"):
        c.bundles.page(sort="hits", cursor=cursor)  # a cursor from another sort


def test_event_totals_agree_with_the_log(tmp_path: Path) -> None:
    c = catalog(tmp_path)
    bid = add(c, 1, model="m1")
    for _ in range(3):
        c.bundles.record_hit(bid)
    c.bundles.delete(bid, reason="manual", nbytes=100)
    stats = c.events.stats(max_size_bytes=1000)
    log = c.events.recent(limit=1000)
    assert stats.hits == sum(e.kind == "hit" for e in log) == 3
    assert stats.evictions_by_reason == {"manual": 1}
    assert stats.evicted_bytes_by_reason == {"manual": 100}
    assert stats.per_model[0].model == "m1" and stats.per_model[0].hits == 3
    with pytest.raises(NotFoundError):
        c.bundles.record_hit(bid)


def _set_state(c: Catalog, bid: str, state: str) -> None:
    with c.engine.begin() as conn:
        conn.execute(text("UPDATE bundles SET state = :s WHERE id = :i"), {"s": state, "i": bid})


def test_0004_widens_the_state_check_and_downgrades_stale_to_ready(tmp_path: Path) -> None:
    url = catalog_url_for(tmp_path) or f"sqlite:///{tmp_path / 'catalog.sqlite3'}"
    c = Catalog(url, node="test-node")
    c.upgrade("0003")
    bid, other = add(c, 1), add(c, 2)
    c.leases.add(bid, 4242)
    with pytest.raises(IntegrityError):
        _set_state(c, bid, "stale")
    c.upgrade("0004")
    assert c.current_revision() == "0004"
    # The table was recreated on SQLite: rows and the display-only lease rows survive.
    assert [h.pid for h in c.leases.holders(bid)] == [4242]
    assert c.bundles.set_stale(bid, "built for compute capability 9.0; this GPU is 8.9").state == "stale"
    assert c.bundles.page(state="stale").total == 1
    with pytest.raises(IntegrityError):
        _set_state(c, other, "bogus")
    downgrade(c.engine, "0003")
    back = c.bundles.require(bid)
    assert (back.state, back.error) == ("ready", None)
    assert [h.pid for h in c.leases.holders(bid)] == [4242]
    with pytest.raises(IntegrityError):
        _set_state(c, bid, "stale")
    c.upgrade()
    assert c.bundles.set_stale(bid, "no CUDA device answers").state == "stale"


def test_0005_adds_the_adapters_table_and_drops_it_on_downgrade(tmp_path: Path) -> None:
    url = catalog_url_for(tmp_path) or f"sqlite:///{tmp_path / 'catalog.sqlite3'}"
    c = Catalog(url, node="test-node")
    c.upgrade("0004")
    bid = add(c, 1)
    assert "adapters" not in inspect(c.engine).get_table_names()
    c.upgrade()
    assert c.current_revision() == head_revision() == "0005"
    info, added = c.adapters.add(adapter_id="ab" * 8, digest="ab" * 32, source="/a",
                                 path=Path("adapters/x/f"), rank=4, targets=("q_proj",), size_bytes=10)
    assert added and info.targets == ("q_proj",) and c.adapters.total_size() == 10
    assert c.adapters.add(adapter_id="ab" * 8, digest="ab" * 32, source="/a", path=Path("adapters/x/f"),
                          rank=4, targets=("q_proj",), size_bytes=10)[1] is False
    with pytest.raises(IntegrityError), c.engine.begin() as conn:
        conn.execute(text("UPDATE adapters SET size_bytes = -1"))
    downgrade(c.engine, "0004")
    assert "adapters" not in inspect(c.engine).get_table_names()
    assert c.bundles.require(bid).state == "ready"  # bundle rows untouched
    c.upgrade()
    assert c.adapters.all() == []


def test_adapter_rows_are_per_node(tmp_path: Path) -> None:
    c = catalog(tmp_path)
    other = Catalog(c.url, node="other-node")
    c.adapters.add(adapter_id="cd" * 8, digest="cd" * 32, source="s", path=Path("adapters/cd/f"), rank=2,
                  targets=("v_proj",), size_bytes=7)
    assert other.adapters.all() == [] and other.adapters.total_size() == 0
    assert other.adapters.delete("cd" * 8, reason="manual", nbytes=7) is False
    assert [a.id for a in c.adapters.all()] == ["cd" * 8]
    assert c.adapters.set_pinned("cd" * 8, True).pinned
    with pytest.raises(NotFoundError):
        other.adapters.set_pinned("cd" * 8, True)
    with pytest.raises(NotFoundError):
        other.adapters.touch("cd" * 8)
    assert c.adapters.delete("cd" * 8, reason="manual", nbytes=7)
    assert [e.kind for e in c.events.recent()][:3] == ["adapter_rm", "adapter_pin", "adapter_add"]


def test_stale_and_back_are_events_and_verify_marks_either_way(tmp_path: Path) -> None:
    c = catalog(tmp_path)
    bid = add(c, 1)
    assert c.bundles.set_stale(bid, None).state == "ready"  # nothing to restore: no event
    c.bundles.set_stale(bid, "other GPU")
    c.bundles.set_stale(bid, "other GPU")  # already stale: no second event
    assert [(e.reason, e.detail) for e in c.events.recent(kind="reconcile", bundle_id=bid)][:1] == [
        ("stale", "other GPU")
    ]
    assert len(c.events.recent(kind="reconcile", bundle_id=bid)) == 2  # adopted + stale
    assert c.bundles.set_stale(bid, None).state == "ready"
    assert c.events.recent(kind="reconcile", bundle_id=bid)[0].reason == "ready"
    info = c.bundles.set_verified(bid, ok=True, detail=None, stale="TensorRT 10.13 here is 10.14")
    assert (info.state, info.error) == ("stale", "TensorRT 10.13 here is 10.14")
    assert c.bundles.set_verified(bid, ok=True, detail=None).state == "ready"
    assert [e.reason for e in c.events.recent(kind="verify", bundle_id=bid)] == ["ok", "stale"]
    # Corrupt wins over stale; a failed build is never made stale.
    assert c.bundles.set_verified(bid, ok=False, detail="x: sha256", stale="other GPU").state == "corrupt"
    assert c.bundles.set_stale(bid, "other GPU").state == "corrupt"
