"""Two nodes, one catalog, one registry: node A builds and pushes (``--registry-push``), node B
serves the same bundle after a pull with no build; the fleet view says who pulled and who built."""

from __future__ import annotations

import logging
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
from litestar import Litestar
from litestar.testing import TestClient

from cachesvc.cache.catalog import utcnow
from cachesvc.cache.fleet_records import DesiredBundle, DesiredSpec
from cachesvc.cache.manager import CacheManager
from cachesvc.cache.profiles import ProfileRequest
from cachesvc.fleet.converge import Converger
from cachesvc.fleet.status import status_lines
from tests.admin.conftest import build_app
from tests.registry.conftest import Registry, fleet_catalog_url, open_node
from tests.support.apps import LOOPBACK_URL
from tests.support.cache import FileBuilder
from tests.support.net import free_port

INT4 = ProfileRequest(precision="int4")


def test_node_b_pulls_what_node_a_built_and_pushed(
    tmp_path: Path, catalog_db: str, registry: Registry, checkpoint: Path
) -> None:
    shared = fleet_catalog_url(tmp_path)
    a = open_node(tmp_path / "a", registry, push=True, catalog_url=shared, node="node-a")
    built = a.prepare(str(checkpoint), INT4)
    assert built.built
    builder_b = FileBuilder(files=3, file_size=4096)
    b = open_node(tmp_path / "b", registry, builder=builder_b, catalog_url=shared, node="node-b")
    got = b.prepare(str(checkpoint), INT4)
    assert got.pulled_from is not None and builder_b.calls == 0 and got.bundle_id == built.bundle_id
    assert b.verifier.verify(got.bundle_id).ok
    assert (got.bundle_dir / "part-000.bin").read_bytes() == (built.bundle_dir / "part-000.bin").read_bytes()

    nodes = {n.name: n for n in b.fleet.nodes()}
    assert (nodes["node-a"].pulled, nodes["node-a"].built) == (0, 1)
    assert (nodes["node-b"].pulled, nodes["node-b"].built) == (1, 0)
    lines = status_lines(list(nodes.values()))
    assert "PULLED/BUILT" in lines[0]
    assert any(line.startswith("node-b") and " 1/0 " in line for line in lines)
    # Per node, the whole catalog's stats split by node agree.
    assert b.queries.stats("node-b").pulls == 1 and b.queries.stats("node-a").pushes == 1
    a.close()
    b.close()


def test_a_desired_item_names_a_registry_and_the_node_pulls_from_it(
    tmp_path: Path, catalog_db: str, registry: Registry, checkpoint: Path, caplog: pytest.LogCaptureFixture
) -> None:
    shared = fleet_catalog_url(tmp_path)
    a = open_node(tmp_path / "a", registry, push=True, catalog_url=shared, node="node-a")
    bid = a.prepare(str(checkpoint), INT4).bundle_id
    builder_b = FileBuilder(files=3, file_size=4096)
    # Node B has no --registry of its own: the desired item names one.
    b = open_node(tmp_path / "b", builder=builder_b, catalog_url=shared, node="node-b")
    with _client(b) as client:
        bad = client.put(
            "/admin/nodes/node-b/desired",
            json={"bundles": [{"model": str(checkpoint), "registry": "oci://h/ns:tag"}]},
        )
        assert bad.status_code == 400 and "not a tag" in bad.json()["detail"]
        item = {"model": str(checkpoint), "precision": "int4", "registry": registry.url}
        put = client.put("/admin/nodes/node-b/desired", json={"bundles": [item]})
        assert put.status_code == 200, put.text
        assert put.json()["bundles"][0]["registry"] == registry.url
    status = Converger(b, on_status=lambda _: None).run_once()
    assert status is not None and status["state"] == "converged"
    (done,) = status["items"]
    assert (done["bundle_id"], done["source"], done["state"]) == (bid, "pulled", "ready")
    assert builder_b.calls == 0
    # The status a node's agent reports: /admin/nodes and `fleet status` show the source.
    b.fleet.heartbeat(
        pid=1,
        max_size_bytes=10**9,
        heartbeat_seconds=60.0,
        loaded_models=[],
        started_at=utcnow(),
        desired_status=status,
        report_status=True,
    )
    node_b = {n.name: n for n in b.fleet.nodes()}["node-b"]
    assert node_b.items[0].source == "pulled" and node_b.pulled == 1

    # A desired item whose registry is down: one warning, built here.
    down = f"oci://127.0.0.1:{free_port()}/ns"
    c = open_node(tmp_path / "c", catalog_url=shared, node="node-c")
    c.set_desired(
        "node-c", DesiredSpec(bundles=(DesiredBundle(str(checkpoint), {"precision": "int4"}, registry=down),))
    )
    with caplog.at_level(logging.WARNING, logger="cachesvc.fleet"):
        status = Converger(c, on_status=lambda _: None).run_once()
    assert status is not None and status["items"][0]["source"] == "built"
    assert [r for r in caplog.records if r.levelno == logging.WARNING and "unreachable" in r.getMessage()]
    for m in (a, b, c):
        m.close()


@contextmanager
def _client(manager: CacheManager) -> Iterator[TestClient[Litestar]]:
    app, _ = build_app(manager)
    with TestClient(app, base_url=LOOPBACK_URL, raise_server_exceptions=False) as client:
        yield client
