"""Every admin route against a real manager: success, not found, conflict and bad input."""

from __future__ import annotations

from collections.abc import Callable
from datetime import datetime, timedelta
from pathlib import Path
from typing import Any

import pytest
from litestar import Litestar
from litestar.testing import TestClient

from cachesvc.cache.manager import CacheManager
from cachesvc.cache.profiles import ProfileRequest
from cachesvc.errors import CorruptBundleError
from tests.admin.conftest import problem, seed_rows
from tests.support.cache import make_checkpoint

Client = TestClient[Litestar]
UNKNOWN_ID = "0123456789abcdef-0123456789ab"


def _pages(client: Client, params: dict[str, Any], *, by: str) -> tuple[list[dict[str, Any]], list[Any]]:
    """Follow ``next_cursor`` (by="cursor") or ``next_offset`` (by="offset") to the end."""
    items: list[dict[str, Any]] = []
    totals: list[Any] = []
    query = dict(params)
    for _ in range(100):
        r = client.get("/admin/bundles", params=query)
        assert r.status_code == 200, r.text
        page = r.json()
        items += page["items"]
        totals.append((page["total"], page["total_bytes"]))
        assert page["limit"] == params["limit"]
        handle = page["next_cursor"] if by == "cursor" else page["next_offset"]
        if handle is None:
            return items, totals
        query = {**params, by: handle}
    raise AssertionError("pagination did not end")


_SORT_FIELD = {
    "last_used": "last_used_at",
    "size": "size_bytes",
    "created": "created_at",
    "hits": "hit_count",
}


@pytest.mark.parametrize(
    ("sort", "order", "by"),
    [
        ("last_used", "desc", "cursor"),
        ("size", "asc", "cursor"),
        ("created", "desc", "cursor"),
        ("hits", "desc", "cursor"),  # every hit count ties: the id tiebreak must keep pages disjoint
        ("size", "desc", "offset"),
    ],
)
def test_pagination_over_250_returns_each_bundle_once_in_order(
    client: Client, manager: CacheManager, sort: str, order: str, by: str
) -> None:
    ids = seed_rows(manager, 250)
    items, totals = _pages(client, {"limit": 40, "sort": sort, "order": order}, by=by)
    got = [b["id"] for b in items]
    assert sorted(got) == sorted(ids)
    assert len(got) == len(set(got)) == 250
    expected_bytes = sum(b["size_bytes"] for b in items)
    assert set(totals) == {(250, expected_bytes)}
    field = _SORT_FIELD[sort]

    def key(b: dict[str, Any]) -> tuple[Any, str]:
        value = b[field]
        return (datetime.fromisoformat(value) if field.endswith("_at") else value, b["id"])

    assert [key(b) for b in items] == sorted((key(b) for b in items), reverse=order == "desc")


def test_filters_model_state_backend_pinned(client: Client, manager: CacheManager) -> None:
    ids = seed_rows(manager, 30)
    manager.catalog.bundles.set_verified(ids[1], ok=False, detail="tampered")
    everything = client.get("/admin/bundles", params={"limit": 1000}).json()["items"]

    def ids_for(**params: Any) -> set[str]:
        r = client.get("/admin/bundles", params={"limit": 1000, **params})
        assert r.status_code == 200, r.text
        assert r.json()["total"] == len(r.json()["items"])
        return {b["id"] for b in r.json()["items"]}

    assert ids_for(model="org/model-1") == {b["id"] for b in everything if b["model"] == "org/model-1"}
    assert ids_for(state="corrupt") == {ids[1]}
    assert ids_for(state="ready") == set(ids) - {ids[1]}
    assert ids_for(backend="onnxruntime") == set(ids)
    assert ids_for(backend="tensorrt") == set()
    pinned = {ids[i] for i in range(0, 30, 7)}
    assert ids_for(pinned="true") == pinned
    assert ids_for(pinned="false") == set(ids) - pinned
    assert ids_for(model="org/model-0", pinned="true") == {
        b["id"] for b in everything if b["model"] == "org/model-0" and b["pinned"]
    }


def test_list_defaults_to_50_newest_first(client: Client, manager: CacheManager) -> None:
    seed_rows(manager, 60)
    page = client.get("/admin/bundles").json()
    assert len(page["items"]) == 50 and page["limit"] == 50 and page["total"] == 60
    used = [b["last_used_at"] for b in page["items"]]
    assert used == sorted(used, reverse=True)


@pytest.mark.parametrize(
    ("params", "field"),
    [
        ({"limit": 0}, "limit"),
        ({"limit": 1001}, "limit"),
        ({"limit": "ten"}, "limit"),
        ({"sort": "name"}, "sort"),
        ({"order": "up"}, "order"),
        ({"state": "gone"}, "state"),
        ({"backend": "cuda"}, "backend"),
        ({"pinned": "maybe"}, "pinned"),
        ({"offset": -1}, "offset"),
        ({"cursor": "not-a-cursor"}, "cursor"),
        ({"cursor": "abc", "offset": 3}, "cursor"),
    ],
)
def test_list_bad_input_is_400_naming_the_field(client: Client, params: dict[str, Any], field: str) -> None:
    body = problem(client.get("/admin/bundles", params=params))
    assert body["status"] == 400
    assert body["field"] == field, body


def test_cursor_from_another_sort_is_rejected(client: Client, manager: CacheManager) -> None:
    seed_rows(manager, 5)
    cursor = client.get("/admin/bundles", params={"limit": 2, "sort": "size"}).json()["next_cursor"]
    body = problem(client.get("/admin/bundles", params={"limit": 2, "sort": "hits", "cursor": cursor}))
    assert body["field"] == "cursor"


def test_bundle_detail_has_manifest_files_holders_events(
    client: Client, manager: CacheManager, checkpoint: Path
) -> None:
    result = manager.prepare(str(checkpoint))
    r = client.get(f"/admin/bundles/{result.bundle_id}")
    assert r.status_code == 200, r.text
    detail = r.json()
    assert detail["bundle"]["id"] == result.bundle_id
    assert detail["bundle"]["state"] == "ready"
    assert detail["manifest"]["bundle_id"] == result.bundle_id
    on_disk = sorted(p.name for p in result.bundle_dir.iterdir() if p.name != "manifest.json")
    assert sorted(Path(f["path"]).name for f in detail["files"]) == on_disk
    assert all(len(f["sha256"]) == 64 and f["size"] > 0 for f in detail["files"])
    assert detail["holders"] == []
    assert [e["kind"] for e in detail["events"]] == ["build_ok", "miss"]
    assert sum(f["size"] for f in detail["files"]) <= detail["bundle"]["size_bytes"]


def test_unknown_bundle_is_404_and_malformed_id_is_400(client: Client) -> None:
    for method, suffix in [
        ("GET", ""),
        ("DELETE", ""),
        ("PUT", "/pin"),
        ("DELETE", "/pin"),
        ("POST", "/verify"),
    ]:
        body = problem(client.request(method, f"/admin/bundles/{UNKNOWN_ID}{suffix}"))
        assert body["status"] == 404, (method, suffix, body)
        assert UNKNOWN_ID in body["detail"]
        body = problem(client.request(method, f"/admin/bundles/not-an-id{suffix}"))
        assert body["status"] == 400 and body["field"] == "bundle_id"


def test_delete_frees_bytes_and_removes_files(
    client: Client, manager: CacheManager, checkpoint: Path
) -> None:
    result = manager.prepare(str(checkpoint))
    size = manager.catalog.bundles.require(result.bundle_id).size_bytes
    r = client.delete(f"/admin/bundles/{result.bundle_id}")
    assert r.status_code == 200, r.text
    assert r.json() == {"bundle_id": result.bundle_id, "freed_bytes": size}
    assert not result.bundle_dir.exists()
    evict = client.get("/admin/events", params={"kind": "evict"}).json()["items"][0]
    assert (evict["bundle_id"], evict["reason"], evict["bytes"]) == (result.bundle_id, "manual", size)
    assert problem(client.delete(f"/admin/bundles/{result.bundle_id}"))["status"] == 404


def test_pin_blocks_delete_with_409_until_unpinned(
    client: Client, manager: CacheManager, checkpoint: Path
) -> None:
    bid = manager.prepare(str(checkpoint)).bundle_id
    r = client.put(f"/admin/bundles/{bid}/pin")
    assert r.status_code == 200 and r.json()["pinned"] is True
    body = problem(client.delete(f"/admin/bundles/{bid}"))
    assert body["status"] == 409 and body["reason"] == "pinned"
    assert "unpin" in body["detail"]
    assert manager.queries.bundle_dir(manager.catalog.bundles.require(bid)).exists()
    r = client.delete(f"/admin/bundles/{bid}/pin")
    assert r.status_code == 200 and r.json()["pinned"] is False
    assert client.delete(f"/admin/bundles/{bid}").status_code == 200


def test_verify_reports_files_and_marks_tampered_bundle_corrupt(
    client: Client, manager: CacheManager, checkpoint: Path
) -> None:
    result = manager.prepare(str(checkpoint))
    bid = result.bundle_id
    r = client.post(f"/admin/bundles/{bid}/verify")
    assert r.status_code == 200, r.text
    ok = r.json()
    assert ok["ok"] is True and ok["mismatches"] == [] and ok["state"] == "ready"
    assert ok["files_checked"] == len(client.get(f"/admin/bundles/{bid}").json()["files"])
    victim = next(p for p in sorted(result.bundle_dir.iterdir()) if p.name != "manifest.json")
    data = bytearray(victim.read_bytes())
    data[0] ^= 0xFF
    victim.write_bytes(bytes(data))
    bad = client.post(f"/admin/bundles/{bid}/verify").json()
    assert bad["ok"] is False and bad["state"] == "corrupt"
    assert [m["path"] for m in bad["mismatches"]] == [victim.name]
    assert client.get("/admin/bundles", params={"state": "corrupt"}).json()["items"][0]["id"] == bid
    with pytest.raises(CorruptBundleError):
        manager.lease(bid)


def test_prune_dry_run_plans_then_prune_evicts_lru_skipping_pinned(
    client: Client, manager: CacheManager, tmp_path: Path
) -> None:
    ids = [manager.prepare(str(make_checkpoint(tmp_path / f"m{i}", seed=10 + i))).bundle_id for i in range(3)]
    sizes = {b: manager.catalog.bundles.require(b).size_bytes for b in ids}
    manager.catalog.bundles.set_pinned(ids[0], True)
    total = sum(sizes.values())
    plan = client.post("/admin/cache/prune", json={"max_size_bytes": 0, "dry_run": True})
    assert plan.status_code == 200, plan.text
    body = plan.json()
    assert body["dry_run"] is True and body["total_before"] == total and body["max_bytes"] == 0
    assert [p["bundle_id"] for p in body["planned"]] == ids[1:]  # LRU: oldest first
    assert body["skipped"] == [
        {"bundle_id": ids[0], "size_bytes": sizes[ids[0]], "reason": "pinned", "stale": False,
         "kind": "bundle"}
    ]
    assert body["freed_bytes"] == sizes[ids[1]] + sizes[ids[2]]
    assert all(manager.queries.bundle_dir(manager.catalog.bundles.require(b)).exists() for b in ids)
    done = client.post("/admin/cache/prune", json={"max_size_bytes": 0}).json()
    assert done["dry_run"] is False and sorted(done["evicted"]) == sorted(ids[1:])
    assert done["total_after"] == sizes[ids[0]]
    assert [b["id"] for b in client.get("/admin/bundles").json()["items"]] == [ids[0]]
    # Default cap (10**12) is far above what is left: nothing to do.
    assert client.post("/admin/cache/prune", json={}).json()["planned"] == []


@pytest.mark.parametrize(
    ("route", "payload", "field"),
    [
        ("/admin/cache/prune", {"max_size_bytes": -1}, "max_size_bytes"),
        ("/admin/cache/prune", {"max_size_bytes": "1GB"}, "max_size_bytes"),
        ("/admin/cache/prune", {"dry_run": "yes"}, "dry_run"),
        ("/admin/cache/prune", {"dryrun": True}, "dryrun"),
        ("/admin/cache/clear", {"dry_run": "maybe"}, "dry_run"),
        ("/admin/cache/clear", [], "body"),
        ("/admin/builds", {}, "model"),
        ("/admin/builds", {"model": ""}, "model"),
        ("/admin/builds", {"model": "m", "max_batch_size": 0}, "max_batch_size"),
        ("/admin/builds", {"model": "m", "precision": "fp8"}, "precision"),
        ("/admin/builds", {"model": "m", "colour": "red"}, "colour"),
    ],
)
def test_bad_bodies_are_400_naming_the_field(client: Client, route: str, payload: Any, field: str) -> None:
    body = problem(client.post(route, json=payload))
    assert body["status"] == 400 and body["field"] == field, body


def test_non_json_and_missing_bodies_are_400(client: Client) -> None:
    for route in ("/admin/cache/prune", "/admin/cache/clear", "/admin/builds"):
        r = client.post(route, content=b"{not json", headers={"content-type": "application/json"})
        body = problem(r)
        assert body["status"] == 400 and body["field"] == "body" and "JSON" in body["detail"]
        body = problem(client.post(route))
        assert body["status"] == 400 and body["field"] == "body"


def test_clear_removes_idle_bundles_but_keeps_checkpoints(
    client: Client, manager: CacheManager, tmp_path: Path
) -> None:
    ids = [manager.prepare(str(make_checkpoint(tmp_path / f"c{i}", seed=20 + i))).bundle_id for i in range(2)]
    manager.catalog.bundles.set_pinned(ids[1], True)
    dry = client.post("/admin/cache/clear", json={"dry_run": True}).json()
    assert dry["reason"] == "clear" and dry["evicted"] == [ids[0]] and dry["dry_run"] is True
    assert manager.catalog.bundles.require(ids[0]) is not None
    done = client.post("/admin/cache/clear", json={}).json()
    assert done["evicted"] == [ids[0]] and done["skipped"][0]["reason"] == "pinned"
    reasons = {e["reason"] for e in client.get("/admin/events", params={"kind": "evict"}).json()["items"]}
    assert reasons == {"clear"}
    checkpoints = client.get("/admin/checkpoints").json()["items"]
    assert len(checkpoints) == 2 and all(Path(c["path"]).exists() for c in checkpoints)


def test_reconcile_forgets_vanished_and_removes_stale_staging(
    client: Client, manager: CacheManager, checkpoint: Path
) -> None:
    result = manager.prepare(str(checkpoint))
    staging = manager.store.new_staging_dir(result.bundle_id)
    (staging / "half-written.bin").write_bytes(b"x")
    for p in result.bundle_dir.iterdir():
        p.unlink()
    result.bundle_dir.rmdir()
    r = client.post("/admin/cache/reconcile")
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["forgotten"] == [result.bundle_id]
    assert body["staging_removed"] == [staging.name] and not staging.exists()
    assert body["adopted"] == [] and body["corrupt"] == []
    assert problem(client.get(f"/admin/bundles/{result.bundle_id}"))["status"] == 404


def test_events_filters_and_newest_first(client: Client, manager: CacheManager, checkpoint: Path) -> None:
    bid = manager.prepare(str(checkpoint)).bundle_id
    manager.prepare(str(checkpoint))
    manager.catalog.bundles.set_pinned(bid, True)
    items = client.get("/admin/events").json()["items"]
    assert [e["kind"] for e in items] == ["pin", "hit", "build_ok", "miss"]
    assert [e["id"] for e in items] == sorted((e["id"] for e in items), reverse=True)
    assert [e["kind"] for e in client.get("/admin/events", params={"kind": "hit"}).json()["items"]] == ["hit"]
    assert len(client.get("/admin/events", params={"limit": 2}).json()["items"]) == 2
    assert {
        e["bundle_id"] for e in client.get("/admin/events", params={"bundle_id": bid}).json()["items"]
    } == {bid}
    future = (datetime.fromisoformat(items[0]["at"]) + timedelta(seconds=1)).isoformat()
    assert client.get("/admin/events", params={"since": future}).json()["items"] == []
    naive_past = (datetime.fromisoformat(items[-1]["at"]) - timedelta(minutes=1)).replace(tzinfo=None)
    assert len(client.get("/admin/events", params={"since": naive_past.isoformat()}).json()["items"]) == 4


@pytest.mark.parametrize(
    ("params", "field"),
    [
        ({"kind": "explode"}, "kind"),
        ({"since": "yesterday"}, "since"),
        ({"limit": 0}, "limit"),
        ({"limit": 5000}, "limit"),
        ({"bundle_id": "../etc"}, "bundle_id"),
    ],
)
def test_events_bad_input(client: Client, params: dict[str, Any], field: str) -> None:
    body = problem(client.get("/admin/events", params=params))
    assert body["status"] == 400 and body["field"] == field


def test_checkpoints_list_digest_size_and_bundles(
    client: Client, manager: CacheManager, checkpoint: Path
) -> None:
    a = manager.prepare(str(checkpoint)).bundle_id
    b = manager.prepare(
        str(checkpoint), ProfileRequest(max_input_len=64, max_kv_cache_capacity=128)
    ).bundle_id
    (item,) = client.get("/admin/checkpoints").json()["items"]
    resolved = manager.resolve(str(checkpoint))
    assert item["digest"] == resolved.digest and item["size_bytes"] == resolved.size_bytes
    assert item["path"] == str(resolved.path)
    assert sorted(item["bundle_ids"]) == sorted([a, b])


def test_unknown_build_is_404(client: Client) -> None:
    body = problem(client.get("/admin/builds/build-doesnotexist"))
    assert body["status"] == 404


def test_openapi_describes_every_route_and_docs_ui_is_served(client: Client) -> None:
    spec = client.get("/schema/openapi.json").json()
    ops = {(m.upper(), p) for p, item in spec["paths"].items() for m in item}
    assert ops == {
        ("GET", "/admin/bundles"),
        ("GET", "/admin/bundles/{bundle_id}"),
        ("DELETE", "/admin/bundles/{bundle_id}"),
        ("PUT", "/admin/bundles/{bundle_id}/pin"),
        ("DELETE", "/admin/bundles/{bundle_id}/pin"),
        ("POST", "/admin/bundles/{bundle_id}/verify"),
        ("POST", "/admin/bundles/{bundle_id}/push"),
        ("POST", "/admin/builds"),
        ("GET", "/admin/builds"),
        ("GET", "/admin/builds/{build_id}"),
        ("POST", "/admin/pulls"),
        ("GET", "/admin/pulls"),
        ("GET", "/admin/pulls/{pull_id}"),
        ("POST", "/admin/cache/prune"),
        ("POST", "/admin/cache/clear"),
        ("POST", "/admin/cache/reconcile"),
        ("GET", "/admin/stats"),
        ("GET", "/admin/events"),
        ("GET", "/admin/checkpoints"),
        ("DELETE", "/admin/checkpoints/{checkpoint_id}"),
        ("GET", "/admin/lora-adapters"),
        ("POST", "/admin/lora-adapters"),
        ("DELETE", "/admin/lora-adapters/{adapter_id}"),
        ("POST", "/admin/lora-adapters/{adapter_id}/pin"),
        ("POST", "/admin/lora-adapters/{adapter_id}/unpin"),
        ("GET", "/admin/nodes"),
        ("GET", "/admin/nodes/{node}/desired"),
        ("PUT", "/admin/nodes/{node}/desired"),
        ("DELETE", "/admin/nodes/{node}/desired"),
        ("GET", "/admin/fleet/desired"),
        ("PUT", "/admin/fleet/desired"),
        ("GET", "/admin/dashboard"),
        ("GET", "/admin/engines"),
        ("POST", "/admin/engines"),
        ("DELETE", "/admin/engines/{bundle_id}"),
        ("GET", "/admin/models"),
        ("PUT", "/admin/models/{name}"),
        ("DELETE", "/admin/models/{name}"),
        ("GET", "/metrics"),
        ("GET", "/health"),
        ("GET", "/health/ready"),
        ("GET", "/v1/models"),
        ("POST", "/v1/completions"),
        ("POST", "/v1/chat/completions"),
        ("POST", "/v1/embeddings"),
        ("POST", "/v1/load_lora_adapter"),
        ("POST", "/v1/unload_lora_adapter"),
        ("GET", "/v1/models/{model_id}"),
        ("POST", "/v1/messages"),
        ("POST", "/v1/messages/count_tokens"),
        ("POST", "/v1/responses"),
        ("POST", "/tokenize"),
        ("POST", "/detokenize"),
    }
    delete = spec["paths"]["/admin/bundles/{bundle_id}"]["delete"]["responses"]
    assert {"200", "400", "401", "403", "404", "409"} <= set(delete)
    assert "application/problem+json" in delete["409"]["content"]
    assert spec["paths"]["/admin/builds"]["post"]["responses"]["202"]
    limit = next(p for p in spec["paths"]["/admin/bundles"]["get"]["parameters"] if p["name"] == "limit")
    assert (limit["schema"]["minimum"], limit["schema"]["maximum"], limit["schema"]["default"]) == (
        1,
        1000,
        50,
    )
    offset = next(p for p in spec["paths"]["/admin/bundles"]["get"]["parameters"] if p["name"] == "offset")
    assert offset["schema"]["minimum"] == 0
    # Swagger UI and ReDoc on the server's own assets (tests/admin/test_api_docs.py); no other viewer.
    for viewer in ("/schema/swagger", "/schema/redoc"):
        page = client.get(viewer)
        assert page.status_code == 200 and "cdn" not in page.text.split("<body>")[0], page.text[:500]
    for viewer in ("/schema/scalar", "/schema/rapidoc", "/schema/elements"):
        assert client.get(viewer).status_code == 404


def test_openapi_schema_needs_the_admin_key_when_there_is_one(make_client: Callable[..., Client]) -> None:
    keyed = make_client(admin_api_key="adm-key")
    for path in ("/schema", "/schema/openapi.json"):
        assert keyed.get(path).status_code == 401
        assert keyed.get(path, headers={"x-api-key": "wrong"}).status_code == 401
        r = keyed.get(path, headers={"Authorization": "Bearer adm-key"})
        assert r.status_code == 200 and "/v1/chat/completions" in r.json()["paths"]


def test_unexpected_error_is_a_500_problem_not_a_crash(
    make_client: Callable[..., Client], manager: CacheManager, monkeypatch: pytest.MonkeyPatch
) -> None:
    def broken(*_: object) -> None:
        raise RuntimeError("disk on fire")

    monkeypatch.setattr(manager.queries, "stats", broken)
    body = problem(make_client().get("/admin/stats"))
    assert body["status"] == 500 and "disk on fire" in body["detail"]


def test_options_lists_every_method_of_a_path(client: Client) -> None:
    allow = {
        path: client.options(path).headers["allow"]
        for path in (f"/admin/bundles/{UNKNOWN_ID}", f"/admin/bundles/{UNKNOWN_ID}/pin", "/admin/builds")
    }
    assert allow == {
        f"/admin/bundles/{UNKNOWN_ID}": "DELETE, GET, OPTIONS",
        f"/admin/bundles/{UNKNOWN_ID}/pin": "DELETE, OPTIONS, PUT",
        "/admin/builds": "GET, OPTIONS, POST",
    }
