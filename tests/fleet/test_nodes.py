"""Nodes on one catalog: own rows, own disk, heartbeats, desired state (SQLite and PostgreSQL)."""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path

import pytest
from litestar.testing import TestClient

from cachesvc.cache.catalog import utcnow
from cachesvc.cache.fleet_records import FLEET_DEFAULT, DesiredBundle, DesiredSpec
from cachesvc.cache.manager import CacheManager
from cachesvc.cache.profiles import ProfileRequest
from cachesvc.fleet import Converger, NodeAgent
from inference.demo import write_demo_checkpoint
from tests.support.apps import LOOPBACK_URL, service_app
from tests.support.cache import make_checkpoint

pytestmark = pytest.mark.usefixtures("catalog_db")

NodeOpener = Callable[..., CacheManager]
SMALL_PROFILE: dict[str, object] = {"max_input_len": 32, "max_kv_cache_capacity": 64}


def test_same_bundle_on_two_nodes_is_two_rows_and_eviction_stays_home(
    open_node: NodeOpener, tmp_path: Path
) -> None:
    a, b = open_node("node-a"), open_node("node-b")
    ckpt = str(make_checkpoint(tmp_path / "ckpt", seed=3))
    ra, rb = a.prepare(ckpt), b.prepare(ckpt)
    assert ra.bundle_id == rb.bundle_id and ra.built and rb.built  # each node builds on its own disk
    assert ra.bundle_dir != rb.bundle_dir
    page = a.queries.list_bundles()
    assert page.total == 2 and {i.node for i in page.items} == {"node-a", "node-b"}
    assert a.queries.list_bundles(node="node-b").total == 1
    # Node A evicts everything it can: B's row and files stay.
    cleared = a.evictor.clear()
    assert cleared.evicted == (ra.bundle_id,)
    assert not ra.bundle_dir.exists() and rb.bundle_dir.is_dir()
    assert b.catalog.bundles.require(rb.bundle_id).state == "ready"
    assert [i.node for i in a.queries.list_bundles().items] == ["node-b"]
    # Events and stats carry and filter by node.
    assert {e.node for e in a.catalog.events.recent(node="node-a")} == {"node-a"}
    assert a.queries.stats().evictions_by_reason == {"clear": 1}
    assert a.queries.stats("node-b").evictions_by_reason == {}
    b_stats = a.queries.stats("node-b")
    assert (b_stats.builds_ok, b_stats.size_bytes) == (1, rb_size(b, rb.bundle_id))


def rb_size(m: CacheManager, bid: str) -> int:
    return m.catalog.bundles.require(bid).size_bytes


def test_nodes_list_heartbeat_and_down(open_node: NodeOpener, tmp_path: Path) -> None:
    a, b = open_node("node-a", cap=5000), open_node("node-b")
    b.prepare(str(make_checkpoint(tmp_path / "ckpt", seed=4)))
    agent = NodeAgent(a, interval=0.2, loaded_models=lambda: ["tiny"])
    agent.beat()
    b.fleet.heartbeat(
        pid=1,
        max_size_bytes=7,
        heartbeat_seconds=0.01,
        loaded_models=[],
        started_at=utcnow(),
    )
    import time

    time.sleep(0.1)  # node-b misses three of its 0.01 s heartbeats
    nodes = {n.name: n for n in a.fleet.nodes()}
    assert nodes["node-a"].state == "up" and nodes["node-a"].max_size_bytes == 5000
    assert nodes["node-a"].loaded_models == ("tiny",)
    assert nodes["node-b"].state == "down"
    assert nodes["node-b"].bundles == 1 and nodes["node-b"].size_bytes == 2000  # rows kept
    assert nodes["node-a"].convergence == "none"


def test_converger_builds_pins_and_evicts_to_the_cap(open_node: NodeOpener, tmp_path: Path) -> None:
    a, b = open_node("node-a"), open_node("node-b")
    ckpts = [str(make_checkpoint(tmp_path / f"ck{i}", seed=10 + i)) for i in range(3)]
    old = a.prepare(ckpts[2]).bundle_id  # not desired: evicted to reach the cap
    other = b.prepare(ckpts[2]).bundle_id  # on node B: never touched
    spec = DesiredSpec(
        bundles=(
            DesiredBundle(ckpts[0], {"max_input_len": 64}, pin=True),
            DesiredBundle(ckpts[1]),
            DesiredBundle(str(tmp_path / "missing")),
        ),
        max_size_bytes=4000,
    )
    a.fleet.set_desired(FLEET_DEFAULT, spec)
    seen: list[dict[str, object] | None] = []
    status = Converger(a, on_status=seen.append).run_once()
    assert status is not None and status["state"] == "failed"
    states = {i["item"]: i["state"] for i in status["items"]}
    assert states[f"{ckpts[0]}[max_input_len=64]"] == "pinned"
    assert states[ckpts[1]] == "ready" and states[str(tmp_path / "missing")] == "failed"
    assert states["max_size_bytes"] == "ready"
    assert a.catalog.bundles.get(old) is None and b.catalog.bundles.require(other).state == "ready"
    pinned = a.prepare(ckpts[0], ProfileRequest(max_input_len=64)).bundle_id
    assert a.catalog.bundles.require(pinned).pinned
    # A node-specific state wins over the fleet default; a failed item is not retried per pass.
    a.fleet.set_desired("node-a", DesiredSpec(bundles=(DesiredBundle(ckpts[1]),)))
    again = Converger(a, on_status=seen.append).run_once()
    assert again is not None and again["state"] == "converged"


def test_admin_routes_for_nodes_and_desired(open_node: NodeOpener) -> None:
    a = open_node("node-a")
    app, _ = service_app(a, heartbeat_seconds=0.2)
    with TestClient(app, base_url=LOOPBACK_URL) as client:
        nodes = client.get("/admin/nodes").json()
        assert nodes["this_node"] == "node-a"
        assert [n["name"] for n in nodes["items"]] == ["node-a"] and nodes["items"][0]["state"] == "up"
        body = {"bundles": [{"model": "org/x", "max_input_len": 64, "pin": True}], "max_size_bytes": 10}
        put = client.put("/admin/fleet/desired", json=body)
        assert put.status_code == 200, put.text
        assert put.json()["generation"] == 1 and put.json()["bundles"][0]["profile"]["max_input_len"] == 64
        assert client.get("/admin/nodes/node-a/desired").json()["node"] == FLEET_DEFAULT
        own = client.put("/admin/nodes/node-a/desired", json={"pin": [], "max_size_bytes": 0})
        assert own.status_code == 200 and own.json()["node"] == "node-a"
        assert (
            client.put("/admin/fleet/desired", json={"bundles": [{"model": "x", "oops": 1}]}).status_code
            == 400
        )
        assert client.delete("/admin/nodes/node-a/desired").status_code == 204
        assert client.get("/admin/nodes/node-a/desired").json()["node"] == FLEET_DEFAULT
        assert client.get("/admin/bundles", params={"node": "node-z"}).json()["total"] == 0
        unknown = client.get("/admin/stats", params={"node": "node-z"})
        assert unknown.status_code == 404 and "node-z" in unknown.json()["detail"]


def test_metrics_node_filter_gives_that_nodes_cache_families(open_node: NodeOpener, tmp_path: Path) -> None:
    a, b = open_node("node-a"), open_node("node-b")
    for i in range(2):
        b.prepare(str(make_checkpoint(tmp_path / f"ck{i}", seed=40 + i)))
    a.prepare(str(make_checkpoint(tmp_path / "ck-a", seed=50)))
    app, _ = service_app(a, heartbeat_seconds=0.2)
    with TestClient(app, base_url=LOOPBACK_URL) as client:
        own = client.get("/metrics").text
        assert 'cachesvc_bundles{state="ready"} 1.0' in own and "cachesvc_http_requests" in own
        assert client.get("/metrics", params={"node": "node-a"}).text.count("cachesvc_http_requests") > 0
        other = client.get("/metrics", params={"node": "node-b"})
        assert other.status_code == 200, other.text
        assert 'cachesvc_bundles{state="ready"} 2.0' in other.text
        assert "cachesvc_cache_size_bytes 4000.0" in other.text  # two bundles of 2 x 1000 bytes
        assert "cachesvc_http_requests" not in other.text  # another process's serving metrics
        missing = client.get("/metrics", params={"node": "node-z"})
        assert missing.status_code == 404 and "node-z" in missing.json()["detail"]


def test_dashboard_page_is_open_but_its_data_is_guarded(open_node: NodeOpener) -> None:
    a = open_node("node-a")
    app, _ = service_app(a, peer="203.0.113.7", heartbeat_seconds=0.2)
    with TestClient(app, base_url=LOOPBACK_URL) as client:
        page = client.get("/admin/dashboard")
        assert page.status_code == 200 and "text/html" in page.headers["content-type"]
        assert "default-src 'none'" in page.headers["content-security-policy"]
        assert "node-a" not in page.text  # no data in the page itself
        assert client.get("/admin/dashboard/assets/dashboard.js").status_code == 200
        assert client.get("/admin/dashboard/assets/other.js").status_code == 404
        assert client.get("/admin/stats").status_code == 403  # remote, no admin key
        assert client.get("/admin/nodes").status_code == 403


def test_converger_loads_desired_models_and_reports_load_failures(
    open_node: NodeOpener, tmp_path: Path
) -> None:
    a = open_node("node-a")
    ckpts = [str(make_checkpoint(tmp_path / f"ck{i}", seed=20 + i)) for i in range(2)]
    a.fleet.set_desired(
        FLEET_DEFAULT,
        DesiredSpec(bundles=(DesiredBundle(ckpts[0], load=True), DesiredBundle(ckpts[1], load=True))),
    )
    broken = a.prepare(ckpts[1]).bundle_id
    loaded: list[str] = []

    def load(bundle_id: str) -> None:
        if bundle_id == broken:
            raise RuntimeError("memory budget exceeded")
        loaded.append(bundle_id)

    status = Converger(a, on_status=lambda _: None, load_model=load).run_once()
    assert status is not None and status["state"] == "failed"
    items = {i["item"]: i for i in status["items"]}
    assert items[ckpts[0]]["state"] == "loaded" and loaded == [items[ckpts[0]]["bundle_id"]]
    assert items[ckpts[1]]["state"] == "failed" and "memory budget exceeded" in str(items[ckpts[1]]["error"])
    # A load failure is retried on the next pass (memory may have freed up), unlike a build failure.
    loaded.clear()
    broken = ""
    again = Converger(a, on_status=lambda _: None, load_model=load).run_once()
    assert again is not None and again["state"] == "converged" and len(loaded) == 2
    # A process without a model pool reports why it cannot load.
    none = Converger(a, on_status=lambda _: None).run_once()
    assert none is not None and {i["error"] for i in none["items"]} == {"this process serves no models"}


def test_desired_load_true_loads_the_model_in_the_serving_pool(tmp_path: Path, fleet_url: str) -> None:
    """The real app: the node's converger builds the desired tiny model and its pool loads it."""
    ckpt = write_demo_checkpoint(tmp_path / "llama-tiny", arch="llama", size="tiny", seed=5)
    manager = CacheManager.open(
        tmp_path / "cache", catalog_url=fleet_url, node="node-a", max_size_bytes=10**12, offline=True
    )
    try:
        manager.fleet.set_desired(
            "node-a",
            DesiredSpec(bundles=(DesiredBundle(str(ckpt), SMALL_PROFILE, load=True),)),
        )
        app, _ = service_app(
            manager, node_name="node-a", catalog_url=fleet_url, heartbeat_seconds=0.2,
            allowed_model_roots=str(tmp_path),
        )
        with TestClient(app, base_url=LOOPBACK_URL) as client:
            deadline = time.monotonic() + 240
            engines: list[dict[str, object]] = []
            while time.monotonic() < deadline:
                engines = client.get("/admin/engines").json()["engines"]
                if engines:
                    break
                time.sleep(0.3)
            assert engines, "the desired model was never loaded"
            bundle_id = engines[0]["bundle_id"]
            assert engines[0]["keep_alive"] == -1  # desired loaded models stay loaded
            deadline = time.monotonic() + 30
            node: dict[str, object] = {}
            while time.monotonic() < deadline:
                node = next(n for n in client.get("/admin/nodes").json()["items"] if n["name"] == "node-a")
                if node.get("convergence") == "converged" and node.get("loaded_models"):
                    break
                time.sleep(0.2)
            assert node["convergence"] == "converged", node
            items = node["items"]
            assert isinstance(items, list) and items[0]["state"] == "loaded"
            assert items[0]["bundle_id"] == bundle_id
            assert node["loaded_models"]  # the heartbeat reports what the pool holds
    finally:
        manager.close()
