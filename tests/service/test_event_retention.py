"""The audit log has a retention (issue 22, item 5): an age and a row cap per node.

Model swapping writes two events per swap (unload, load); without a bound the events table grew
about 1,000 rows a minute. A real server swapping models as fast as requests come stays within
``--event-retention-rows``; the running totals (stats, metrics) keep counting; the age limit
drops what is older; another node's events are never touched.
"""

from __future__ import annotations

import time
from datetime import timedelta
from pathlib import Path

from cachesvc.cache.catalog import Catalog, utcnow
from cachesvc.cache.manager import CacheManager
from inference.demo import write_demo_checkpoint
from inference.openai import load_tokenizer
from tests.admin.conftest import open_manager
from tests.support.cache import ServableFileBuilder, make_checkpoint
from tests.support.engines import TableEngine
from tests.support.whole_app import running_app

CAP = 30


def _my_events(manager: CacheManager) -> int:
    return len(manager.catalog.events.recent(limit=100_000, node=manager.node))


def test_a_model_swap_storm_stays_bounded(tmp_path: Path) -> None:
    demo = write_demo_checkpoint(tmp_path / "demo", size="tiny")
    vocab = load_tokenizer(demo).vocab_size
    manager = open_manager(tmp_path / "cache", ServableFileBuilder(demo))
    models = [str(make_checkpoint(tmp_path / "models" / f"m{i}", seed=40 + i)) for i in range(2)]
    for model in models:
        manager.prepare(model)

    def engines(bundle_dir: Path, *, max_slots: int) -> TableEngine:
        return TableEngine(vocab_size=vocab, capacity=256, max_slots=max_slots)

    settings = {"max_loaded_models": 1, "heartbeat_seconds": 0.05, "event_retention_rows": CAP}
    with running_app(tmp_path, manager=manager, engine_factory=engines, **settings) as app:
        written_before = manager.catalog.events.version()
        with app.http() as h:
            for i in range(60):  # one engine at a time: every request swaps
                r = h.post("/v1/completions", json={"model": models[i % 2], "prompt": "hi", "max_tokens": 1})
                assert r.status_code == 200, r.text
        written = manager.catalog.events.version() - written_before
        assert written >= 100, "the storm did not swap models"
        deadline = time.monotonic() + 20
        while _my_events(manager) > CAP:
            assert time.monotonic() < deadline, f"{_my_events(manager)} events kept, cap {CAP}"
            time.sleep(0.1)
        # Totals are kept: counters and stats go on counting what retention dropped.
        assert manager.catalog.events.version() - written_before >= written
        mine = manager.catalog.events.recent(limit=CAP, node=manager.node)
        loads = sum(1 for e in mine if e.kind == "load")
        assert loads > 0, "the newest events were dropped instead of the oldest"


def test_age_limit_and_other_nodes(tmp_path: Path, catalog_db: str) -> None:
    manager = open_manager(tmp_path / "cache")
    other = Catalog(manager.catalog.url, node="other-node")
    try:
        old = utcnow() - timedelta(days=8)
        for catalog in (manager.catalog, other):
            catalog.events.add("load", bundle_id="b" * 16, model="m", at=old)
            catalog.events.add("load", bundle_id="b" * 16, model="m")
        assert manager.catalog.events.apply_retention(max_age_days=7, max_rows=0) == 1
        mine = manager.catalog.events.recent(limit=100, node=manager.node)
        assert len(mine) == 1 and mine[0].at > old + timedelta(days=1)
        theirs = manager.catalog.events.recent(limit=100, node="other-node")
        assert len(theirs) == 2, "another node's events went"
        assert manager.catalog.events.apply_retention(max_age_days=0, max_rows=1) == 0
        manager.catalog.events.add("unload", bundle_id="b" * 16, model="m", reason="idle")
        assert manager.catalog.events.apply_retention(max_age_days=0, max_rows=1) == 1
        assert [e.kind for e in manager.catalog.events.recent(limit=100, node=manager.node)] == ["unload"]
        # 0, 0: keep everything
        assert manager.catalog.events.apply_retention(max_age_days=0, max_rows=0) == 0
    finally:
        other.close()
        manager.close()
