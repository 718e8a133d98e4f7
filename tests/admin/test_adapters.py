"""LoRA adapters over the admin API (``/admin/lora-adapters``) and the CLI (``cachesvc adapters``).

Real app, real manager and catalog (SQLite, and PostgreSQL when configured), real PEFT adapters."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import pytest
from litestar import Litestar
from litestar.testing import TestClient

from cachesvc.cache.manager import CacheManager
from cachesvc.cli import main
from tests.admin.conftest import ADMIN_KEY, problem
from tests.support.adapters import write_adapter, write_base

Client = TestClient[Litestar]


@pytest.fixture
def models(tmp_path: Path) -> dict[str, Path]:
    """A base model and an adapter of it, under the directories builds may read (tmp_path)."""
    base = write_base(tmp_path / "models" / "base")
    return {"base": base, "a": write_adapter(base, tmp_path / "models" / "adapter-a", seed=1, rank=2)}


def test_add_list_pin_remove_over_http(
    make_client: Callable[..., Client], manager: CacheManager, models: dict[str, Path]
) -> None:
    client = make_client(admin_api_key=ADMIN_KEY)
    auth = {"x-api-key": ADMIN_KEY}
    body = {"source": str(models["a"]), "base": str(models["base"])}
    # The base must be a checkpoint in the catalog: nothing is hashed or downloaded for it here.
    unknown = problem(client.post("/admin/lora-adapters", json=body, headers=auth))
    assert unknown["status"] == 404 and "POST /admin/builds" in unknown["detail"]
    manager.resolve(str(models["base"]))
    assert problem(client.post("/admin/lora-adapters", json=body))["status"] == 401
    assert problem(client.get("/admin/lora-adapters"))["status"] == 401
    r = client.post("/admin/lora-adapters", json=body, headers=auth)
    assert r.status_code == 201, r.text
    row = r.json()
    assert row["rank"] == 2 and row["pinned"] is False and Path(row["path"]).is_file()
    assert row["path"] == str(manager.layout.root / "adapters" / row["id"] / "adapter.onnx_adapter")
    again = client.post("/admin/lora-adapters", json=body, headers=auth).json()
    assert again["id"] == row["id"] and again["created_at"] == row["created_at"]
    items = client.get("/admin/lora-adapters", headers=auth).json()["items"]
    assert [i["id"] for i in items] == [row["id"]]
    aid = row["id"]
    assert client.post(f"/admin/lora-adapters/{aid}/pin", headers=auth).json()["pinned"] is True
    refused = problem(client.delete(f"/admin/lora-adapters/{aid}", headers=auth))
    assert refused["status"] == 409 and "pinned" in refused["detail"]
    assert client.post(f"/admin/lora-adapters/{aid}/unpin", headers=auth).json()["pinned"] is False
    lease = manager.adapters.lease(aid)
    try:
        assert problem(client.delete(f"/admin/lora-adapters/{aid}", headers=auth))["status"] == 409
    finally:
        lease.release()
    done = client.delete(f"/admin/lora-adapters/{aid}", headers=auth)
    assert done.status_code == 200 and done.json() == {"id": aid, "freed_bytes": row["size_bytes"]}
    assert problem(client.delete(f"/admin/lora-adapters/{aid}", headers=auth))["status"] == 404
    assert problem(client.post(f"/admin/lora-adapters/{aid}/pin", headers=auth))["status"] == 404
    assert problem(client.post("/admin/lora-adapters/not-an-id/pin", headers=auth))["status"] == 400
    kinds = [e["kind"] for e in client.get("/admin/events", headers=auth).json()["items"]]
    assert kinds[:4] == ["adapter_rm", "adapter_unpin", "adapter_pin", "adapter_add"]
    assert client.get("/admin/events", params={"kind": "adapter_rm"}, headers=auth).status_code == 200


def test_bad_requests_are_400_in_one_line(
    client: Client, manager: CacheManager, models: dict[str, Path], tmp_path: Path
) -> None:
    base = str(models["base"])
    manager.resolve(base)
    cases = [
        ({"source": str(models["base"]), "base": base}, "adapter_config.json"),
        ({"source": "/etc", "base": base}, "outside the directories"),
        ({"source": str(models["a"]), "base": "/etc"}, "outside the directories"),
        ({"source": "bad id!", "base": base}, "source"),
        ({"source": str(models["a"])}, "base"),
        ({"source": str(models["a"]), "base": base, "extra": 1}, "extra"),
    ]
    for body, needle in cases:
        detail = problem(client.post("/admin/lora-adapters", json=body))
        assert detail["status"] == 400 and needle in detail["detail"] and "\n" not in detail["detail"], body
    assert client.get("/admin/lora-adapters").json() == {"items": []}
    hub = {"source": "org/x", "base": "org/y"}
    assert problem(client.post("/admin/lora-adapters", json=hub))["status"] == 404


def test_cli_adapters(
    cache_dir: Path, manager: CacheManager, models: dict[str, Path], capsys: pytest.CaptureFixture[str]
) -> None:
    cache = ["--cache-dir", str(cache_dir), "--catalog-url", manager.catalog.url]
    assert main([*cache, "adapters", "add", str(models["a"]), "--base", str(models["base"]), "--json"]) == 0
    row = json.loads(capsys.readouterr().out)
    aid = row["id"]
    assert Path(row["path"]).is_file() and row["rank"] == 2
    assert main([*cache, "adapters", "ls"]) == 0
    out = capsys.readouterr().out
    assert aid in out and "RANK" in out
    assert main([*cache, "adapters", "pin", aid]) == 0 and "pinned adapter" in capsys.readouterr().out
    assert main([*cache, "adapters", "rm", aid]) == 1
    assert "pinned" in capsys.readouterr().err
    assert main([*cache, "adapters", "unpin", aid, "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["pinned"] is False
    assert main([*cache, "adapters", "rm", aid[:10], "--json"]) == 0
    assert json.loads(capsys.readouterr().out) == {"id": aid, "freed_bytes": row["size_bytes"]}
    assert main([*cache, "adapters", "ls", "--json"]) == 0 and json.loads(capsys.readouterr().out) == []
    assert main([*cache, "adapters", "add", str(models["base"]), "--base", str(models["base"])]) == 2
    err = capsys.readouterr().err
    assert err.startswith("cachesvc: error: ") and "adapter_config.json" in err and err.count("\n") == 1
    assert main([*cache, "adapters", "rm", "0" * 16]) == 2
