"""Own rows only: reconcile and the stale-first eviction of one node never see another node's rows.

Two nodes share a catalog, each with its own disk; both built bundle X (one id, a row per node),
and node B's copy of X is stale (built for a GPU B no longer has). Node A must still adopt its
own X when its row is lost, never report B's bundles as forgotten, and a prune on A must take
A's own least recently used bundle, not A's ready X because B's X is stale. Run on SQLite and
PostgreSQL (the ``catalog_db`` parameter of ``fleet_url``).
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

from cachesvc.cache.catalog import utcnow
from cachesvc.cache.manager import CacheManager
from tests.support.cache import FileBuilder, make_checkpoint


def test_reconcile_and_the_stale_sweep_see_only_their_own_node(
    tmp_path: Path, open_node: Callable[..., CacheManager]
) -> None:
    a, b = open_node("node-a"), open_node("node-b")
    shared, only_a, only_b = (
        str(make_checkpoint(tmp_path / "models" / name, seed=seed))
        for name, seed in (("shared", 61), ("only-a", 62), ("only-b", 63))
    )
    y = a.prepare(only_a).bundle_id  # A's least recently used bundle
    x = a.prepare(shared).bundle_id
    assert b.prepare(shared).bundle_id == x  # the same bundle, a row per node
    z = b.prepare(only_b).bundle_id
    b.catalog.bundles.set_stale(x, "built for a GPU this node no longer has")

    # Reconcile on A: B's bundles are not A's to forget, and A's own X is adopted back.
    a.catalog.bundles.forget(x)  # A's row lost (e.g. a catalog restored from an old backup)
    report = a.reconciler.reconcile()
    assert x in report.adopted, report
    assert z not in report.forgotten and x not in report.forgotten, report
    assert a.catalog.bundles.require(x).state == "ready"
    assert {(r.id, r.state) for r in b.queries.list_bundles(node="node-b", limit=10).items} == {
        (x, "stale"),
        (z, "ready"),
    }

    a.catalog.bundles.touch(x, utcnow())  # X is A's most recently used bundle
    # A prune on A frees one bundle's bytes: A's LRU one (Y), never A's ready X for B's stale X.
    total = sum(r.size_bytes for r in a.queries.list_bundles(node="node-a", limit=10).items)
    result = a.evictor.prune(total - 1)
    assert result.evicted == (y,), result
    assert a.catalog.bundles.require(x).state == "ready"
    assert (a.layout.root / a.catalog.bundles.require(x).path / "manifest.json").exists()
    assert b.catalog.bundles.require(x).state == "stale"


def test_the_first_serve_takes_over_what_commands_did_before_it_and_nothing_else(
    tmp_path: Path, fleet_url: str, open_node: Callable[..., CacheManager]
) -> None:
    """Commands on a directory no server claimed act as its provisional node; the server that
    claims it takes those rows over (issue 30, item 11): a row it has already wins, event totals
    add up, another node's rows stay where they are, and no provisional node is left."""
    b = open_node("node-b")
    cache = tmp_path / "cache-a"

    def open_dir(**kwargs: Any) -> CacheManager:
        return CacheManager.open(cache, catalog_url=fleet_url, max_size_bytes=10**12, offline=True,
                                 builders={"onnxruntime": FileBuilder(files=2, file_size=1000)}, **kwargs)

    x, y = (str(make_checkpoint(tmp_path / "models" / n, seed=seed)) for n, seed in (("x", 71), ("y", 72)))
    early = open_dir(node="node-a")  # an older row of node-a for y (as a cache from before the rule)
    yid = early.prepare(y).bundle_id
    early.close()
    command = open_dir()  # a command: no node recorded, none given
    provisional = command.node
    assert provisional.startswith("unclaimed-")
    xid = command.prepare(x).bundle_id
    assert command.prepare(y).bundle_id == yid  # on disk: adopted as the provisional node's row too
    command.close()
    b_rows = {(r.id, r.node) for r in b.queries.list_bundles(node="node-b", limit=10).items}
    b.prepare(x)
    misses_before = b.queries.stats("node-a").misses  # node-a's own (y's build)

    server = open_dir(node="node-a", claim_node=True)
    try:
        rows = server.queries.list_bundles(limit=20).items
        assert sorted((r.id, r.node) for r in rows if r.node != "node-b") == sorted(
            [(xid, "node-a"), (yid, "node-a")]
        )
        assert {(r.id, r.node) for r in rows if r.node == "node-b"} == b_rows | {(xid, "node-b")}
        assert {n.name for n in server.fleet.nodes()} == {"node-a", "node-b"}
        assert all(e.node != provisional for e in server.catalog.events.recent(limit=1000))
        assert server.queries.stats("node-a").misses == misses_before + 1  # x's miss, moved over
    finally:
        server.close()
    later = open_dir()  # commands now act as the node that claimed the directory
    assert later.node == "node-a"
    later.close()
