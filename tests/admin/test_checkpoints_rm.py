"""Removing checkpoints: ``DELETE /admin/checkpoints/{id}`` and ``cachesvc checkpoints rm``.

Real manager, real catalog (SQLite, and PostgreSQL when ``CACHESVC_TEST_PG_URL`` is set), real
files: a refused removal changes nothing, bundles go only when asked, a user's directory is
only forgotten, the cache's own downloads and conversions are deleted, every removal is an
event.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
from litestar import Litestar
from litestar.testing import TestClient

from cachesvc.cache.manager import CacheManager
from cachesvc.cache.profiles import ProfileRequest
from cachesvc.cli import main
from tests.admin.conftest import problem
from tests.admin.test_leases import leased  # noqa: F401  (fixture)
from tests.support.cache import REPO_ROOT, FileBuilder, child_env, make_checkpoint

Client = TestClient[Litestar]
PROFILE = ProfileRequest(max_input_len=128)


def _tree(path: Path) -> dict[str, bytes]:
    """Every file under ``path`` with its bytes (links followed), to prove nothing changed."""
    return {
        str(p.relative_to(path)): p.read_bytes() for p in sorted(path.rglob("*")) if p.is_file()
    }


def _state(client: Client) -> tuple[list[tuple[str, list[str]]], list[str]]:
    """Checkpoints (digest, bundle ids) and bundle ids as the admin API lists them."""
    ckpts = client.get("/admin/checkpoints").json()["items"]
    bundles = client.get("/admin/bundles").json()["items"]
    return [(c["digest"], c["bundle_ids"]) for c in ckpts], [b["id"] for b in bundles]


def _rm_events(client: Client) -> list[dict[str, object]]:
    r = client.get("/admin/events", params={"kind": "checkpoint_rm"})
    items: list[dict[str, object]] = r.json()["items"]
    return items


def test_a_local_checkpoint_is_forgotten_and_its_files_stay(
    client: Client, manager: CacheManager, checkpoint: Path
) -> None:
    before = _tree(checkpoint)
    digest = manager.resolve(str(checkpoint)).digest
    r = client.delete(f"/admin/checkpoints/{digest[:12]}")  # a prefix names it too
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["digest"] == digest and body["files_deleted"] is False and body["file_bytes"] == 0
    assert body["bundles_removed"] == [] and body["path"] == str(checkpoint)
    assert _tree(checkpoint) == before  # a user's directory: never touched
    assert client.get("/admin/checkpoints").json()["items"] == []
    (event,) = _rm_events(client)
    assert event["checkpoint_digest"] == digest and "left in place" in str(event["detail"])
    # Gone: a second removal is a 404, like any unknown id.
    assert problem(client.delete(f"/admin/checkpoints/{digest}"))["status"] == 404


@pytest.mark.parametrize("bad", ["0" * 64, "deadbeef", "not-a-digest", "..%2F..%2Fetc"])
def test_unknown_ids_are_404_and_change_nothing(
    client: Client, manager: CacheManager, checkpoint: Path, bad: str
) -> None:
    manager.resolve(str(checkpoint))
    before = _state(client)
    r = client.delete(f"/admin/checkpoints/{bad}")
    assert r.status_code == 404, r.text
    if "%" not in bad:  # (an encoded path separator matches no route at all: 404 all the same)
        assert "checkpoints ls" in problem(r)["detail"]
    assert _state(client) == before and _rm_events(client) == []


def test_bundles_go_only_when_asked(client: Client, manager: CacheManager, checkpoint: Path) -> None:
    result = manager.prepare(str(checkpoint), PROFILE)
    other = manager.prepare(str(checkpoint), ProfileRequest(max_input_len=256))
    digest = manager.resolve(str(checkpoint)).digest
    before, files = _state(client), _tree(checkpoint)
    r = client.delete(f"/admin/checkpoints/{digest}")
    assert r.status_code == 409, r.text
    body = problem(r)
    assert body["reason"] == "has_bundles"
    assert "2 bundle(s)" in body["detail"] and "with_bundles=true" in body["detail"]
    assert _state(client) == before and result.bundle_dir.is_dir()

    r = client.delete(f"/admin/checkpoints/{digest}", params={"with_bundles": "true"})
    assert r.status_code == 200, r.text
    body = r.json()
    assert sorted(body["bundles_removed"]) == sorted([result.bundle_id, other.bundle_id])
    assert body["bundle_bytes"] > 0 and body["files_deleted"] is False
    assert not result.bundle_dir.exists() and not other.bundle_dir.exists()
    assert _state(client) == ([], []) and _tree(checkpoint) == files
    evicts = client.get("/admin/events", params={"kind": "evict"}).json()["items"]
    assert {(e["bundle_id"], e["reason"]) for e in evicts} == {
        (result.bundle_id, "manual"), (other.bundle_id, "manual")
    }
    assert len(_rm_events(client)) == 1


def test_a_pinned_bundle_blocks_removal(client: Client, manager: CacheManager, checkpoint: Path) -> None:
    result = manager.prepare(str(checkpoint), PROFILE)
    manager.catalog.bundles.set_pinned(result.bundle_id, True)
    digest = manager.resolve(str(checkpoint)).digest
    before = _state(client)
    r = client.delete(f"/admin/checkpoints/{digest}", params={"with_bundles": "true"})
    assert r.status_code == 409, r.text
    body = problem(r)
    assert body["reason"] == "pinned" and result.bundle_id in body["detail"]
    assert _state(client) == before and result.bundle_dir.is_dir() and _rm_events(client) == []


def test_a_leased_bundle_blocks_removal(
    client: Client, manager: CacheManager, checkpoint: Path, leased: tuple[str, subprocess.Popen[str]]  # noqa: F811
) -> None:
    bundle_id, proc = leased
    digest = manager.resolve(str(checkpoint)).digest
    before = _state(client)
    r = client.delete(f"/admin/checkpoints/{digest}", params={"with_bundles": "true"})
    assert r.status_code == 409, r.text
    body = problem(r)
    assert body["reason"] == "leased" and [h["pid"] for h in body["holders"]] == [proc.pid]
    info = manager.catalog.bundles.require(bundle_id)
    assert _state(client) == before and info is not None and manager.queries.bundle_dir(info).is_dir()
    assert _rm_events(client) == []


def test_a_converted_checkpoint_under_the_cache_is_deleted(
    client: Client, manager: CacheManager, tmp_path: Path
) -> None:
    # Where GGUF conversions land: checkpoints/gguf/<digest16>-gguf-1/.
    own = make_checkpoint(manager.layout.checkpoints / "gguf" / "0123456789abcdef-gguf-1", seed=3)
    size = sum(p.stat().st_size for p in own.rglob("*") if p.is_file())
    digest = manager.resolve(str(own)).digest
    r = client.delete(f"/admin/checkpoints/{digest}")
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["files_deleted"] is True and body["file_bytes"] == size
    assert not own.exists() and (manager.layout.checkpoints / "gguf").is_dir()
    assert list(manager.layout.trash.iterdir()) == []
    (event,) = _rm_events(client)
    assert event["bytes"] == size and "deleted" in str(event["detail"])


def test_a_link_under_the_cache_is_only_forgotten(
    client: Client, manager: CacheManager, tmp_path: Path
) -> None:
    # A symbolic link inside checkpoints/ may point at anyone's files: never deleted through.
    users = make_checkpoint(tmp_path / "users-model", seed=4)
    before = _tree(users)
    link = manager.layout.checkpoints / "linked"
    link.symlink_to(users, target_is_directory=True)
    digest = manager.resolve(str(link)).digest
    r = client.delete(f"/admin/checkpoints/{digest}")
    assert r.status_code == 200, r.text
    assert r.json()["files_deleted"] is False
    assert _tree(users) == before and link.is_symlink()


def _hub_snapshot(checkpoints: Path, repo: str, source: Path) -> Path:
    """A huggingface_hub cache entry for ``repo`` built from ``source``'s files: blobs named by
    their hash, a snapshot of relative links to them, refs/main; returns the snapshot dir."""
    root = checkpoints / f"models--{repo.replace('/', '--')}"
    commit = hashlib.sha1(repo.encode()).hexdigest()
    snapshot = root / "snapshots" / commit
    snapshot.mkdir(parents=True)
    (root / "blobs").mkdir()
    (root / "refs").mkdir()
    (root / "refs" / "main").write_text(commit)
    for f in sorted(source.iterdir()):
        data = f.read_bytes()
        blob = root / "blobs" / hashlib.sha256(data).hexdigest()
        blob.write_bytes(data)
        os.symlink(os.path.relpath(blob, snapshot), snapshot / f.name)
    return snapshot


def test_a_hub_download_is_deleted_with_its_blobs(
    client: Client, manager: CacheManager, tmp_path: Path
) -> None:
    source = make_checkpoint(tmp_path / "src", seed=5)
    snapshot = _hub_snapshot(manager.layout.checkpoints, "org/tiny", source)
    repo_dir = snapshot.parent.parent
    kept = _hub_snapshot(manager.layout.checkpoints, "org/other", make_checkpoint(tmp_path / "o", seed=6))
    digest = manager.resolve(str(snapshot)).digest
    r = client.delete(f"/admin/checkpoints/{digest}")
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["files_deleted"] is True and body["file_bytes"] == sum(
        p.stat().st_size for p in source.iterdir()
    )
    assert not repo_dir.exists()  # its only revision: the repo folder, blobs and refs go
    assert _tree(kept) and kept.is_dir()  # another repo of the cache stays


def test_cli_checkpoints_rm(
    cache_dir: Path, manager: CacheManager, checkpoint: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    cache = ["--cache-dir", str(cache_dir), "--catalog-url", manager.catalog.url]
    result = manager.prepare(str(checkpoint), PROFILE)

    assert main([*cache, "checkpoints", "rm", str(checkpoint)]) == 1
    err = capsys.readouterr().err
    assert err.startswith("cachesvc: error: ") and "--with-bundles" in err and "1 bundle(s)" in err
    assert result.bundle_dir.is_dir() and len(manager.catalog.checkpoints.all()) == 1

    assert main([*cache, "checkpoints", "rm", str(checkpoint / "nope")]) == 2
    assert "no checkpoint" in capsys.readouterr().err

    assert main([*cache, "checkpoints", "rm", str(checkpoint), "--with-bundles"]) == 0
    out = capsys.readouterr().out
    assert "removed 1 bundle(s)" in out and "forgot checkpoint" in out
    assert not result.bundle_dir.exists() and manager.catalog.checkpoints.all() == []
    assert checkpoint.is_dir() and (checkpoint / "config.json").is_file()


def test_checkpoint_row_of_another_nodes_bundles_is_refused(
    client: Client, manager: CacheManager, checkpoint: Path, cache_dir: Path
) -> None:
    # Another node's bundle of the same checkpoint: its files are on that node's disk.
    other = CacheManager.open(
        cache_dir.parent / "other-node-cache",
        catalog_url=manager.catalog.url,
        max_size_bytes=10**12,
        builders=manager.builders,
        node="other-node",
        offline=True,
    )
    try:
        other.prepare(str(checkpoint), PROFILE)
    finally:
        other.close()
    digest = manager.resolve(str(checkpoint)).digest
    before = _state(client)
    r = client.delete(f"/admin/checkpoints/{digest}", params={"with_bundles": "true"})
    assert r.status_code == 409, r.text
    body = problem(r)
    assert body["reason"] == "other_nodes" and "other-node" in body["detail"]
    assert _state(client) == before
    shutil.rmtree(cache_dir.parent / "other-node-cache", ignore_errors=True)


def test_a_draft_checkpoint_counts_the_bundles_that_use_it(
    client: Client, manager: CacheManager, checkpoint: Path, tmp_path: Path
) -> None:
    draft = make_checkpoint(tmp_path / "models" / "draft", seed=7)
    spec = ProfileRequest(max_input_len=128, speculative_method="draft_model", draft_model=str(draft))
    target = manager.prepare(str(checkpoint), spec)
    digest = manager.resolve(str(draft)).digest
    ids = {b["id"] for b in client.get("/admin/bundles").json()["items"]}
    assert target.bundle_id in ids and len(ids) == 2  # the target and its draft's own bundle
    r = client.delete(f"/admin/checkpoints/{digest}")
    assert r.status_code == 409 and "2 bundle(s)" in problem(r)["detail"], r.text
    r = client.delete(f"/admin/checkpoints/{digest}", params={"with_bundles": "true"})
    assert r.status_code == 200, r.text
    assert set(r.json()["bundles_removed"]) == ids  # no target is left without its draft
    assert client.get("/admin/bundles").json()["items"] == []


def test_the_gates_kept_fp32_answers_go_with_the_checkpoint(
    client: Client, manager: CacheManager, checkpoint: Path
) -> None:
    # The quality gate keeps fp32's answers per checkpoint (gate-references/<digest32>.npz);
    # they are the cache's own file and leave with the checkpoint, the other checkpoints' stay.
    digest = manager.resolve(str(checkpoint)).digest
    kept = manager.layout.gate_reference_file(digest)
    other = manager.layout.gate_reference_file("f" * 64)
    for path in (kept, other):
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(b"answers")
    assert client.delete(f"/admin/checkpoints/{digest}").status_code == 200
    assert not kept.exists() and other.read_bytes() == b"answers"


def _building(client: Client, timeout: float = 30.0) -> str:
    """The id of the bundle whose build is under way, once its row says ``building``."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        items = client.get("/admin/bundles", params={"state": "building"}).json()["items"]
        if items:
            return str(items[0]["id"])
        time.sleep(0.01)
    raise AssertionError("no build started")


def test_a_build_in_this_process_is_named_as_one(
    client: Client, manager: CacheManager, checkpoint: Path
) -> None:
    # The server's own background build holds the bundle's lock: the refusal says that, not
    # "in use by another process" (nobody leases a bundle being built).
    manager.builders["onnxruntime"] = FileBuilder(files=40, file_size=64, delay=0.05)
    r = client.post("/admin/builds", json={"model": str(checkpoint), "max_input_len": 128})
    assert r.status_code == 202, r.text
    bundle_id = _building(client)
    digest = manager.resolve(str(checkpoint)).digest
    for r in (
        client.delete(f"/admin/checkpoints/{digest}", params={"with_bundles": "true"}),
        client.delete(f"/admin/bundles/{bundle_id}"),
    ):
        assert r.status_code == 409, r.text
        body = problem(r)
        assert body["reason"] == "building" and bundle_id in body["detail"], body
        assert "being built by this process" in body["detail"], body
        assert "another process" not in body["detail"] and body["holders"] == [], body
    (build,) = manager.builds.all_builds()
    build = manager.builds.wait(build.id, timeout=60)
    assert build.state == "done" and _rm_events(client) == []
    r = client.delete(f"/admin/checkpoints/{digest}", params={"with_bundles": "true"})
    assert r.status_code == 200 and r.json()["bundles_removed"] == [bundle_id], r.text


def test_a_build_in_another_process_is_named_as_one(
    client: Client, manager: CacheManager, checkpoint: Path, cache_dir: Path
) -> None:
    proc = subprocess.Popen(
        [sys.executable, "-m", "tests.support.prepare_child", str(cache_dir), str(checkpoint), "prepare"],
        cwd=REPO_ROOT, env=child_env(CACHESVC_TEST_DELAY="0.2"), stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE, text=True,
    )
    try:
        bundle_id = _building(client, timeout=60)
        digest = manager.resolve(str(checkpoint)).digest
        r = client.delete(f"/admin/checkpoints/{digest}", params={"with_bundles": "true"})
        assert r.status_code == 409, r.text
        body = problem(r)
        assert body["reason"] == "building" and bundle_id in body["detail"], body
        assert "being built by another process" in body["detail"], body
        assert proc.wait(timeout=60) == 0
    finally:
        proc.kill()
        proc.wait(timeout=10)
        if proc.stderr is not None:
            proc.stderr.close()
    assert client.get(f"/admin/bundles/{bundle_id}").json()["bundle"]["state"] == "ready"


def test_a_build_and_a_lease_are_both_named(
    client: Client, manager: CacheManager, checkpoint: Path, leased: tuple[str, subprocess.Popen[str]]  # noqa: F811
) -> None:
    served, proc = leased
    manager.builders["onnxruntime"] = FileBuilder(files=40, file_size=64, delay=0.05)
    r = client.post("/admin/builds", json={"model": str(checkpoint), "max_input_len": 128})
    assert r.status_code == 202, r.text
    built = _building(client)
    digest = manager.resolve(str(checkpoint)).digest
    r = client.delete(f"/admin/checkpoints/{digest}", params={"with_bundles": "true"})
    assert r.status_code == 409, r.text
    body = problem(r)
    detail = body["detail"]
    assert body["reason"] == "building" and [h["pid"] for h in body["holders"]] == [proc.pid], body
    assert f"being built by this process ({built})" in detail, detail
    assert f"in use ({served}) by pid {proc.pid}" in detail, detail
    (build,) = manager.builds.all_builds()
    assert manager.builds.wait(build.id, timeout=60).state == "done"
