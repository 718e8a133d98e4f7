"""Context records on disk (``<cache>/context/<bundle_id>/``) belong to their bundle: counted in the
cache's size (stats and the cap that drives eviction), removed when the bundle is evicted or
removed, and dropped by reconcile when their bundle is gone."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from cachesvc.cache.manager import CacheManager
from cachesvc.cache.profiles import ProfileRequest
from inference.serving.context_cache import PrefixStore
from inference.serving.context_disk import DiskRecords
from tests.support.cache import FileBuilder, make_checkpoint
from tests.support.databases import catalog_url_for

pytestmark = pytest.mark.usefixtures("catalog_db")

BUNDLE_BYTES = 5 * 1024  # FileBuilder(files=5)


def open_manager(cache: Path, cap: int = 10**12) -> CacheManager:
    return CacheManager.open(
        cache, catalog_url=catalog_url_for(cache), max_size_bytes=cap,
        builders={"onnxruntime": FileBuilder(files=5)},
    )


def _records(m: CacheManager, bid: str, blocks: int) -> int:
    """Write ``blocks`` records for ``bid`` as a server would; their bytes on disk."""
    directory = m.layout.context_dir(bid)
    store = PrefixStore(f"bundle:{bid}", max_records=64, disk=DiskRecords(directory, max_bytes=1 << 30))
    tokens = list(range(64 * blocks))
    kv = np.ones((2, 1, 64, 4), dtype=np.float32)
    for i, key in enumerate(store.block_keys(tokens)):
        store.insert(key, tokens[i * 64:(i + 1) * 64], kv)
    store.close()
    nbytes = store.stats().disk_bytes
    assert nbytes == sum(p.stat().st_size for p in directory.iterdir()) > blocks * kv.nbytes
    return nbytes


def _bundle(m: CacheManager, tmp_path: Path, i: int) -> str:
    ckpt = make_checkpoint(tmp_path / f"ckpt{i}")
    return m.prepare(str(ckpt), ProfileRequest(max_input_len=64 + i)).bundle_id


def test_records_count_in_the_size_and_go_with_their_bundle(tmp_path: Path) -> None:
    m = open_manager(tmp_path / "cache")
    a, b = _bundle(m, tmp_path, 0), _bundle(m, tmp_path, 1)
    assert m.queries.stats().size_bytes == 2 * BUNDLE_BYTES
    nbytes = _records(m, a, 3)
    _records(m, b, 1)
    assert m.queries.stats().size_bytes == 2 * BUNDLE_BYTES + nbytes + m.layout.context_bytes(b)
    assert m.layout.context_bytes() == nbytes + m.layout.context_bytes(b)

    freed = m.evictor.remove(a)
    assert freed == BUNDLE_BYTES + nbytes
    assert not m.layout.context_dir(a).exists() and m.layout.context_dir(b).is_dir()
    assert not list(m.layout.trash.iterdir())
    assert m.queries.stats().size_bytes == BUNDLE_BYTES + m.layout.context_bytes(b)

    result = m.evictor.clear()
    assert result.evicted == (b,) and not m.layout.context_dir(b).exists()
    assert m.queries.stats().size_bytes == 0 and m.layout.context_bundle_ids() == []


def test_the_cap_counts_the_records(tmp_path: Path) -> None:
    m = open_manager(tmp_path / "cache")
    a, b = _bundle(m, tmp_path, 0), _bundle(m, tmp_path, 1)
    nbytes = _records(m, b, 2)
    # The bundles alone fit 2.5 bundles' worth; with b's records they do not: the least
    # recently used (a) goes, and the plan counts each bundle's records with it.
    plan = m.evictor.plan(int(2.5 * BUNDLE_BYTES))
    assert plan.total_before == 2 * BUNDLE_BYTES + nbytes
    assert [e.bundle_id for e in plan.evict] == [a]
    m.evictor.prune(int(2.5 * BUNDLE_BYTES))
    assert m.catalog.bundles.get(a) is None and m.catalog.bundles.get(b) is not None
    # Now b's records push b itself over a cap its files alone would fit.
    plan = m.evictor.plan(BUNDLE_BYTES + nbytes // 2)
    assert [(e.bundle_id, e.size_bytes) for e in plan.evict] == [(b, BUNDLE_BYTES + nbytes)]


def test_reconcile_drops_the_records_of_bundles_that_are_gone(tmp_path: Path) -> None:
    m = open_manager(tmp_path / "cache")
    a = _bundle(m, tmp_path, 0)
    _records(m, a, 1)
    _records(m, "0123456789abcdef-gone", 2)  # a bundle this catalog does not know
    m.reconciler.reconcile()
    assert m.layout.context_bundle_ids() == [a]
    # A bundle whose directory vanished is forgotten, and its records with it.
    m.store.remove(m.catalog.bundles.require(a).path)
    m.reconciler.reconcile()
    assert m.catalog.bundles.get(a) is None and m.layout.context_bundle_ids() == []
