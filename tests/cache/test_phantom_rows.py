"""Item 5: an interrupted or failed build leaves no row (its failure stays an event)."""

from __future__ import annotations

import signal
import subprocess
import sys
from pathlib import Path

from cachesvc.cache.catalog.models import BundleRow
from cachesvc.cache.records import BundleInfo
from tests.admin.conftest import open_manager, seed_rows
from tests.support.cache import child_env, make_checkpoint

CHILD = [sys.executable, "-m", "tests.support.prepare_child"]


def test_a_build_killed_mid_way_leaves_no_row_after_reconcile(tmp_path: Path) -> None:
    cache = tmp_path / "cache"
    ckpt = make_checkpoint(tmp_path / "ckpt")
    proc = subprocess.run(
        [*CHILD, str(cache), str(ckpt), "prepare"],
        env=child_env(CACHESVC_TEST_KILL_AT="5"),
        capture_output=True,
        timeout=120,
    )
    assert proc.returncode == -signal.SIGKILL
    m = open_manager(cache)
    try:
        building: list[BundleInfo] = list(m.catalog.bundles.all())
        assert [b.state for b in building] == ["building"]
        report = m.reconciler.reconcile()
        assert report.forgotten == (building[0].id,)
        assert m.queries.list_bundles().total == 0, "bundles ls lists a directory that does not exist"
        stats = m.queries.stats()
        assert stats.bundles == 0 and stats.builds_failed == 1
        failed = m.catalog.events.recent(kind="build_failed")
        assert len(failed) == 1 and "interrupted" in (failed[0].detail or "")
    finally:
        m.close()


def test_failed_rows_from_older_versions_are_forgotten(tmp_path: Path) -> None:
    m = open_manager(tmp_path / "cache")
    try:
        (bid,) = seed_rows(m, 1)
        with m.catalog.core.tx() as session:  # a row as older versions left it
            row = session.get(BundleRow, (bid, m.catalog.node))
            assert row is not None
            row.state = "failed"
        assert bid in m.reconciler.reconcile().forgotten
        assert m.queries.list_bundles().total == 0
    finally:
        m.close()
