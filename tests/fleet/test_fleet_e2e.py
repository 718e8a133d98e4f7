"""A simulated 3-node fleet: 3 server processes, 3 cache dirs, one catalog (PostgreSQL in CI).

Desired state set fleet-wide through one node converges on all three; a node killed with
SIGKILL is shown down and its bundles stay listed; eviction on node A never touches B or C.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.support.cache import REPO_ROOT, child_env, make_checkpoint
from tests.support.net import free_port, wait_http_ok

pytestmark = pytest.mark.usefixtures("catalog_db")

NAMES = ("node-a", "node-b", "node-c")


def _until(check: Callable[[], Any], timeout: float, what: str) -> Any:
    deadline = time.monotonic() + timeout
    while True:
        value = check()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.2)


@pytest.fixture
def fleet(tmp_path: Path, fleet_url: str) -> Iterator[dict[str, tuple[subprocess.Popen[bytes], str]]]:
    nodes: dict[str, tuple[subprocess.Popen[bytes], str]] = {}
    for name in NAMES:
        port = free_port()
        proc = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "tests.support.fleet_node",
                str(tmp_path / name),
                fleet_url,
                name,
                str(port),
            ],
            cwd=REPO_ROOT,
            env=child_env(),
        )
        nodes[name] = (proc, f"http://127.0.0.1:{port}")
    try:
        for proc, base in nodes.values():
            wait_http_ok(f"{base}/health", timeout=60, proc=proc)
        yield nodes
    finally:
        for proc, _ in nodes.values():
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
        for proc, _ in nodes.values():
            try:
                proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


def _bundle_files(root: Path) -> dict[str, int]:
    return {str(p.relative_to(root)): p.stat().st_ino for p in (root / "engines").rglob("*") if p.is_file()}


def test_three_nodes_converge_go_down_and_evict_only_at_home(
    fleet: dict[str, tuple[subprocess.Popen[bytes], str]], tmp_path: Path, fleet_url: str
) -> None:
    a = fleet["node-a"][1]
    client = httpx.Client(timeout=10.0)
    nodes = _until(
        lambda: [n for n in client.get(f"{a}/admin/nodes").json()["items"] if n["state"] == "up"],
        30,
        "three nodes up",
    )
    assert len(nodes) == 3
    ckpts = [str(make_checkpoint(tmp_path / "models" / f"m{i}", seed=40 + i)) for i in range(2)]
    desired = {
        "bundles": [{"model": ckpts[0], "pin": True}, {"model": ckpts[1], "max_input_len": 256}],
        "max_size_bytes": 10**8,
    }
    put = client.put(f"{a}/admin/fleet/desired", json=desired)
    assert put.status_code == 200, put.text

    def converged() -> list[dict[str, Any]] | None:
        items = client.get(f"{a}/admin/nodes").json()["items"]
        done = [n for n in items if n["convergence"] == "converged"]
        return items if len(done) == 3 else None

    items = _until(converged, 90, "all three nodes converged")
    for n in items:
        assert n["bundles"] == 2 and n["size_bytes"] == 2 * 3 * 2000, n
        assert [i["state"] for i in n["items"]] == ["pinned", "ready", "ready"], n
    listing = client.get(f"{a}/admin/bundles", params={"limit": 100}).json()
    assert listing["total"] == 6 and {b["node"] for b in listing["items"]} == set(NAMES)

    # `cachesvc fleet status` agrees (exit 0: every node converged).
    status = subprocess.run(
        [sys.executable, "-m", "cachesvc.cli", "fleet", "status", "--catalog-url", fleet_url],
        cwd=REPO_ROOT,
        env=child_env(),
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert status.returncode == 0, status.stdout + status.stderr
    assert sum(" converged " in line for line in status.stdout.splitlines()) == 3, status.stdout

    # Eviction on A: A's unpinned bundle goes, B's and C's files and rows are untouched.
    before_b = _bundle_files(tmp_path / "node-b")
    pruned = client.post(f"{a}/admin/cache/prune", json={"max_size_bytes": 0}).json()
    assert len(pruned["evicted"]) == 1
    assert _bundle_files(tmp_path / "node-b") == before_b
    b_rows = client.get(f"{a}/admin/bundles", params={"node": "node-b"}).json()
    assert b_rows["total"] == 2 and {r["state"] for r in b_rows["items"]} == {"ready"}

    # SIGKILL node C: shown down (never deleted), its bundles stay listed.
    proc_c = fleet["node-c"][0]
    os.kill(proc_c.pid, signal.SIGKILL)
    proc_c.wait(timeout=10)
    down = _until(
        lambda: [n for n in client.get(f"{a}/admin/nodes").json()["items"] if n["state"] == "down"],
        15,
        "node-c shown down",
    )
    assert [n["name"] for n in down] == ["node-c"] and down[0]["bundles"] == 2
    assert client.get(f"{a}/admin/bundles", params={"node": "node-c"}).json()["total"] == 2
    client.close()
