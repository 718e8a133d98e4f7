"""Push a bundle to a real registry from one node, pull it into another (two cache dirs, two
catalogs): the pulled bundle verifies, is recorded as pulled, and nothing is built."""

from __future__ import annotations

import threading
from pathlib import Path

from cachesvc.cache.manager import CacheManager
from cachesvc.cache.profiles import ProfileRequest
from cachesvc.cache.records import PrepareResult
from tests.cache.conftest import assert_consistent
from tests.registry.conftest import Registry, open_node
from tests.support.cache import FileBuilder

INT4 = ProfileRequest(precision="int4")


def test_push_then_pull_round_trip_into_a_second_node(
    tmp_path: Path, registry: Registry, checkpoint: Path
) -> None:
    a = open_node(tmp_path / "node-a", registry)
    built = a.prepare(str(checkpoint), INT4)
    assert built.built and built.pulled_from is None
    pushed = a.registry.push(built.bundle_id)
    # The test builder's three files hold the same bytes: one blob, uploaded once.
    assert pushed.tags[0] == built.bundle_id and (pushed.blobs_uploaded, pushed.blobs_skipped) == (1, 2)
    again = a.registry.push(built.bundle_id)
    assert again.blobs_uploaded == 0 and again.blobs_skipped == 3 and again.digest == pushed.digest

    builder_b = FileBuilder(files=3, file_size=4096)
    b = open_node(tmp_path / "node-b", registry, builder=builder_b)
    got = b.prepare(str(checkpoint), INT4)
    assert got.bundle_id == built.bundle_id
    assert not got.built and got.pulled_from == f"{registry.url}:{built.bundle_id}"
    assert builder_b.calls == 0
    assert b.verifier.verify(got.bundle_id).ok
    assert (got.bundle_dir / "manifest.json").read_bytes() == (
        built.bundle_dir / "manifest.json"
    ).read_bytes()
    kinds = [e.kind for e in b.catalog.events.recent(limit=20)]
    assert "pull" in kinds and "build_ok" not in kinds
    assert_consistent(b)
    pulled, pushed_stats = b.queries.stats(), a.queries.stats()
    assert (pulled.pulls, pulled.pulled_bytes, pulled.builds_ok, pulled.misses) == (1, 3 * 4096, 0, 1)
    assert (pushed_stats.pushes, pushed_stats.pushed_bytes) == (2, 4096)
    # The next prepare is a plain hit.
    assert b.prepare(str(checkpoint), INT4).pulled_from is None
    a.close()
    b.close()


def test_concurrent_misses_for_one_key_make_one_pull(
    tmp_path: Path, registry: Registry, checkpoint: Path
) -> None:
    # Files of 4 MiB: a pull long enough that two unlocked misses would both see the miss.
    a = open_node(tmp_path / "node-a", registry, builder=FileBuilder(files=3, file_size=4 << 20))
    a.registry.push(a.prepare(str(checkpoint), INT4).bundle_id)
    # Two managers on one cache directory, as two processes of one node would be.
    builders = [FileBuilder(files=3, file_size=4 << 20) for _ in range(2)]
    nodes = [open_node(tmp_path / "node-b", registry, builder=b) for b in builders]
    barrier = threading.Barrier(2)
    results: list[PrepareResult] = []

    def prepare(m: CacheManager) -> None:
        barrier.wait()
        results.append(m.prepare(str(checkpoint), INT4))

    threads = [threading.Thread(target=prepare, args=(m,)) for m in nodes]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert len(results) == 2 and sum(r.pulled_from is not None for r in results) == 1
    assert not any(r.built for r in results) and all(b.calls == 0 for b in builders)
    assert [e.kind for e in nodes[0].catalog.events.recent(kind="pull")] == ["pull"]
    for m in (a, *nodes):
        m.close()
