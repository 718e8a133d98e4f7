"""The catalog under concurrent writers, on SQLite and PostgreSQL.

SQLite serialises writers with BEGIN IMMEDIATE; PostgreSQL must get the same answers from row
locks (FOR UPDATE), ON CONFLICT upserts and the advisory lock around schema upgrades.
"""

from __future__ import annotations

import subprocess
import sys
import threading
from pathlib import Path

import pytest

from cachesvc.cache.catalog import Catalog, utcnow
from cachesvc.cache.catalog.migrate import head_revision
from cachesvc.cache.profiles import BundleKey
from tests.support.cache import REPO_ROOT, child_env

pytestmark = pytest.mark.usefixtures("catalog_db")


def _key(i: int) -> BundleKey:
    return BundleKey(
        id=f"{i:016x}-{i:012x}",
        checkpoint_digest=f"{i:064x}",
        draft_digest=None,
        profile={"i": i},
        name=f"p{i}",
        backend="onnxruntime",
        relpath=Path(f"engines/{i:016x}/p{i}"),
    )


def test_concurrent_hits_lose_no_update(fleet_url: str) -> None:
    nodes = [Catalog(fleet_url, node=n) for n in ("node-a", "node-a", "node-b")]
    nodes[0].upgrade()
    for c in (nodes[0], nodes[2]):
        c.bundles.adopt(_key(1), model="m", size_bytes=10, file_count=1, built_at=utcnow())
    errors: list[BaseException] = []

    def hammer(c: Catalog) -> None:
        try:
            for _ in range(25):
                c.bundles.record_hit(_key(1).id)
        except BaseException as exc:  # pragma: no cover - reported below
            errors.append(exc)

    threads = [threading.Thread(target=hammer, args=(c,)) for c in nodes for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []
    # Two catalogs (four threads) on node-a's row, one (two threads) on node-b's.
    assert nodes[0].bundles.require(_key(1).id).hit_count == 100
    assert nodes[2].bundles.require(_key(1).id).hit_count == 50
    assert nodes[0].events.stats(max_size_bytes=1, node="node-a").hits == 100
    assert nodes[0].events.stats(max_size_bytes=1).hits == 150
    for c in nodes:
        c.close()


def test_concurrent_first_starts_migrate_once(fleet_url: str) -> None:
    code = (
        "import sys\n"
        "from cachesvc.cache.catalog import Catalog\n"
        "c = Catalog(sys.argv[1], node=sys.argv[2]); c.upgrade(); print(c.current_revision()); c.close()\n"
    )
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", code, fleet_url, f"n{i}"],
            cwd=REPO_ROOT,
            env=child_env(),
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for i in range(4)
    ]
    outs = [p.communicate(timeout=120) for p in procs]
    assert [p.returncode for p in procs] == [0] * 4, [o[1][-2000:] for o in outs]
    assert {o[0].strip() for o in outs} == {head_revision()}
