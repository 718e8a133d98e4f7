"""Shared pieces of the reliability suite: invariants checked after every scenario."""

from __future__ import annotations

import sys
from pathlib import Path

from cachesvc.cache.manager import CacheManager
from cachesvc.cache.store import verify_bundle
from tests.service.conftest import demo_dir  # noqa: F401 - fixture (the tiny demo checkpoint)

#: ``python -m tests.support.prepare_child CACHE CHECKPOINT MODE``
CHILD = [sys.executable, "-m", "tests.support.prepare_child"]


def assert_consistent(manager: CacheManager) -> None:
    """Every row is ready with a directory that verifies; every bundle directory has a row;
    nothing is left in staging or trash."""
    root = manager.layout.root
    rows = {b.id: b for b in manager.catalog.bundles.all()}
    for bid, info in rows.items():
        assert info.state == "ready", f"row {bid} is {info.state}"
        report = verify_bundle(root / info.path)
        assert report.ok, f"row {bid}: {report.mismatches}"
    dirs = {p.relative_to(root).as_posix() for p in (root / "engines").glob("*/*")}
    assert dirs == {str(b.path) for b in rows.values()}, (
        "directories without rows or rows without directories"
    )
    assert list((root / ".staging").iterdir()) == []
    assert list((root / ".trash").iterdir()) == []


def checkpoints(root: Path, count: int) -> list[Path]:
    """``count`` distinct tiny checkpoints under ``root`` (one bundle each)."""
    from tests.support.cache import make_checkpoint

    return [make_checkpoint(root / f"ckpt-{i:02d}", seed=100 + i) for i in range(count)]
