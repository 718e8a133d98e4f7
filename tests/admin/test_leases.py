"""A bundle leased by another process cannot be evicted over the API, and says who holds it."""

from __future__ import annotations

import json
import socket
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import IO

import pytest
from litestar import Litestar
from litestar.testing import TestClient

from cachesvc.cache.manager import CacheManager
from tests.admin.conftest import problem
from tests.support.cache import REPO_ROOT, child_env

Client = TestClient[Litestar]


def _read_json_line(stream: IO[str], proc: subprocess.Popen[str]) -> dict[str, object]:
    line = stream.readline()
    if not line:
        proc.wait(timeout=10)
        raise AssertionError(f"child exited ({proc.returncode}): {proc.stderr.read() if proc.stderr else ''}")
    result: dict[str, object] = json.loads(line)
    return result


@pytest.fixture
def leased(
    cache_dir: Path, checkpoint: Path, manager: CacheManager
) -> Iterator[tuple[str, subprocess.Popen[str]]]:
    """A child process that prepares the checkpoint's bundle, leases it and sleeps: (bundle id, process)."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "tests.support.prepare_child", str(cache_dir), str(checkpoint), "lease"],
        cwd=REPO_ROOT,
        env=child_env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        assert proc.stdout is not None
        prepared = _read_json_line(proc.stdout, proc)
        ready = _read_json_line(proc.stdout, proc)
        assert ready == {"leased": prepared["bundle_id"]}
        yield str(prepared["bundle_id"]), proc
    finally:
        proc.kill()
        proc.wait(timeout=10)
        for stream in (proc.stdout, proc.stderr):
            if stream is not None:
                stream.close()


def test_delete_of_leased_bundle_is_409_with_holder_and_files_stay(
    client: Client, manager: CacheManager, leased: tuple[str, subprocess.Popen[str]]
) -> None:
    bid, pid = leased[0], leased[1].pid
    bundle_dir = manager.queries.bundle_dir(manager.catalog.bundles.require(bid))
    files_before = sorted(p.name for p in bundle_dir.iterdir())
    body = problem(client.delete(f"/admin/bundles/{bid}"))
    assert body["status"] == 409 and body["reason"] == "leased"
    assert [(h["pid"], h["host"]) for h in body["holders"]] == [(pid, socket.gethostname())]
    assert body["holders"][0]["since"]
    assert str(pid) in body["detail"]
    assert sorted(p.name for p in bundle_dir.iterdir()) == files_before
    assert manager.catalog.bundles.require(bid).state == "ready"

    detail = client.get(f"/admin/bundles/{bid}").json()
    assert [h["pid"] for h in detail["holders"]] == [pid]

    plan = client.post("/admin/cache/prune", json={"max_size_bytes": 0}).json()
    assert plan["evicted"] == [] and plan["skipped"][0] == {
        "bundle_id": bid,
        "size_bytes": manager.catalog.bundles.require(bid).size_bytes,
        "reason": "leased",
        "stale": False,
        "kind": "bundle",
    }
    cleared = client.post("/admin/cache/clear", json={}).json()
    assert cleared["evicted"] == [] and cleared["skipped"][0]["reason"] == "leased"
    assert sorted(p.name for p in bundle_dir.iterdir()) == files_before


def test_once_the_holder_is_gone_the_bundle_can_be_evicted(
    client: Client, manager: CacheManager, leased: tuple[str, subprocess.Popen[str]]
) -> None:
    bid, proc = leased
    bundle_dir = manager.queries.bundle_dir(manager.catalog.bundles.require(bid))
    assert problem(client.delete(f"/admin/bundles/{bid}"))["status"] == 409
    proc.kill()  # a crashed server: the OS drops its lock, its holder record is stale
    proc.wait(timeout=10)
    r = client.delete(f"/admin/bundles/{bid}")
    assert r.status_code == 200, r.text
    assert r.json()["freed_bytes"] > 0
    assert not bundle_dir.exists()
