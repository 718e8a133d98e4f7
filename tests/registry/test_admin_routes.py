"""``POST /admin/bundles/{id}/push`` and ``POST /admin/pulls`` (a background job like builds)
over the real app, a real registry and two cache directories; errors as problem JSON."""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from litestar import Litestar
from litestar.testing import TestClient

from cachesvc.cache.manager import CacheManager
from cachesvc.cache.profiles import ProfileRequest
from tests.admin.conftest import build_app
from tests.registry.conftest import Registry, open_node
from tests.support.apps import LOOPBACK_URL
from tests.support.cache import FileBuilder
from tests.support.net import free_port

Client = TestClient[Litestar]
INT4 = {"precision": "int4"}


@contextmanager
def _client(manager: CacheManager) -> Iterator[Client]:
    app, _ = build_app(manager)
    with TestClient(app, base_url=LOOPBACK_URL, raise_server_exceptions=False) as client:
        yield client


def _wait(client: Client, pull_id: str, timeout: float = 30.0) -> dict[str, Any]:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        status: dict[str, Any] = client.get(f"/admin/pulls/{pull_id}").json()
        if status["state"] in ("done", "failed"):
            return status
        time.sleep(0.02)
    raise AssertionError(f"pull {pull_id} did not finish in {timeout} s")


def test_push_route_then_a_pull_job_on_another_node(
    tmp_path: Path, registry: Registry, checkpoint: Path
) -> None:
    a = open_node(tmp_path / "node-a", registry)
    bid = a.prepare(str(checkpoint), ProfileRequest(precision="int4")).bundle_id
    with _client(a) as client:
        r = client.post(f"/admin/bundles/{bid}/push")
        assert r.status_code == 200, r.text
        body = r.json()
        assert body["bundle_id"] == bid and body["tags"][0] == bid and body["ref"] == registry.url
        missing = client.post("/admin/bundles/0123456789abcdef-0123456789ab/push")
        assert missing.status_code == 404 and "no bundle with id" in missing.json()["detail"]

    builder = FileBuilder(files=3, file_size=4096)
    b = open_node(tmp_path / "node-b", registry, builder=builder)
    with _client(b) as client:
        r = client.post("/admin/pulls", json={"model": str(checkpoint), **INT4})
        assert r.status_code == 202, r.text
        assert r.json()["id"].startswith("pull-")
        done = _wait(client, r.json()["id"])
        assert done["state"] == "done" and done["bundle_id"] == bid and done["built"] is False
        assert [p["id"] for p in client.get("/admin/pulls").json()["items"]] == [r.json()["id"]]
        events = client.get("/admin/events", params={"kind": "pull"}).json()["items"]
        assert len(events) == 1 and events[0]["detail"] == f"{registry.url}:{bid}"
        stats = client.get("/admin/stats").json()
        assert (stats["pulls"], stats["pulled_bytes"], stats["builds_ok"]) == (1, 3 * 4096, 0)
        metrics = client.get("/metrics").text
        assert 'cachesvc_registry_transfers_total{direction="pull"} 1.0' in metrics
        assert 'cachesvc_registry_bytes_total{direction="pull"} 12288.0' in metrics
        # A profile the registry does not hold: the job fails with the registry's 404, nothing built.
        other = client.post("/admin/pulls", json={"model": str(checkpoint), "precision": "fp32"})
        failed = _wait(client, other.json()["id"])
        assert failed["state"] == "failed" and "404" in failed["error"]
        bad = client.post("/admin/pulls", json={"model": str(checkpoint), "ref": "http://x/ns"})
        assert bad.status_code == 400 and bad.json()["field"] == "ref"
    assert builder.calls == 0
    a.close()
    b.close()


def test_push_without_a_registry_or_with_one_down(tmp_path: Path, checkpoint: Path) -> None:
    plain = open_node(tmp_path / "plain")
    bid = plain.prepare(str(checkpoint), ProfileRequest()).bundle_id
    with _client(plain) as client:
        r = client.post(f"/admin/bundles/{bid}/push")
        assert r.status_code == 400 and "no registry is configured" in r.json()["detail"]
        r = client.post("/admin/pulls", json={"model": str(checkpoint)})
        assert r.status_code == 400 and r.json()["field"] == "registry"
    plain.close()

    down = Registry(f"127.0.0.1:{free_port()}", tmp_path, f"oci://127.0.0.1:{free_port()}/fleet/x")
    node = open_node(tmp_path / "down", down)
    bid = node.prepare(str(checkpoint), ProfileRequest()).bundle_id
    with _client(node) as client:
        r = client.post(f"/admin/bundles/{bid}/push")
        assert r.status_code == 502 and "unreachable" in r.json()["detail"]
        assert r.json()["type"] == "urn:cachesvc:problem:registry"
    node.close()
