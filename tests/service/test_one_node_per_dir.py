"""One node per cache directory (issue 22, item 3).

Two ``serve`` processes with different ``--node-name`` on one ``--cache-dir`` used to take each
other's bundles as their own rows, and a prune from one deleted directories the other's rows
still pointed to. Now the root records the node that owns it: a real second ``serve`` with
another name (or none, where a name is recorded) exits with one line and changes nothing, and
CLI commands on the directory act as its node.
"""

from __future__ import annotations

import socket
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

from cachesvc.cache.manager import CacheManager
from cachesvc.cache.store.layout import NODE_FILE_NAME, UNCLAIMED_NODE_FILE_NAME
from tests.service.conftest import REPO_ROOT, cachesvc_command, child_env, run_cli, running_server
from tests.support.cache import FileBuilder, make_checkpoint
from tests.support.pg_cluster import own_cluster


def _tree(root: Path) -> dict[str, int]:
    """Every file under the cache root but the catalog and locks, with its size."""
    skip = ("catalog.sqlite3", ".locks/")
    return {
        p.relative_to(root).as_posix(): p.stat().st_size
        for p in root.rglob("*")
        if p.is_file() and not p.relative_to(root).as_posix().startswith(skip)
    }


def _serve_refused(cache: Path, *flags: str) -> str:
    r = subprocess.run(
        [
            *cachesvc_command(),
            "serve",
            "--cache-dir",
            str(cache),
            "--host",
            "127.0.0.1",
            "--port",
            "1",
            *flags,
        ],
        capture_output=True,
        text=True,
        env=child_env(),
        cwd=REPO_ROOT,
        timeout=120,
        check=False,
    )
    assert r.returncode == 1, r.stderr
    errors = [line for line in r.stderr.splitlines() if " ERROR " in line]
    assert len(errors) == 1, r.stderr
    assert "Traceback" not in r.stderr
    return errors[0]


def _rows(cache: Path, node: str) -> list[tuple[str, str, str]]:
    m = CacheManager.open(cache, node=node, max_size_bytes=10**12, builders={}, offline=True)
    try:
        return sorted((b.id, b.node, b.state) for b in m.queries.list_bundles(limit=100).items)
    finally:
        m.close()


def test_a_second_node_on_one_cache_directory_is_refused_and_commands_act_as_its_node(
    tmp_path: Path,
) -> None:
    cache = tmp_path / "cache"
    seeded = CacheManager.open(
        cache,
        node="node-a",
        max_size_bytes=10**12,
        builders={"onnxruntime": FileBuilder(files=2, file_size=256)},
        offline=True,
    )
    bid = seeded.prepare(str(make_checkpoint(tmp_path / "ckpt", seed=4))).bundle_id
    seeded.close()
    assert not (cache / NODE_FILE_NAME).exists(), "only a server claims the directory"

    with running_server(None, cache, tmp_path, "--node-name", "node-a") as server:
        assert (cache / NODE_FILE_NAME).read_text().strip() == "node-a"
        rows, files = _rows(cache, "node-a"), _tree(cache)
        for flags in (("--node-name", "node-b"), ()):  # another name, or none where one is recorded
            line = _serve_refused(cache, *flags)
            assert "node-a" in line and "--node-name" in line, line
            assert _rows(cache, "node-a") == rows, "the refused process changed the catalog"
            assert _tree(cache) == files, "the refused process changed the disk"
        assert server.proc.poll() is None
        assert server.http().get("/health").status_code == 200
    assert rows == [(bid, "node-a", "ready")]

    # A command on the directory acts as its node: node-a's bundle is found and evicted.
    r = run_cli(cache, "bundles", "rm", bid)
    assert r.returncode == 0, r.stderr
    assert _rows(cache, "node-a") == []
    # The same node name starts again.
    with running_server(None, cache, tmp_path, "--node-name", "node-a") as again:
        assert again.http().get("/health").status_code == 200


@pytest.fixture(params=["sqlite", "postgresql"])
def catalog_flags(request: pytest.FixtureRequest) -> Iterator[tuple[str, ...]]:
    """``--catalog-url`` of a PostgreSQL cluster the test owns, or nothing (the SQLite file)."""
    if request.param == "sqlite":
        yield ()
        return
    cluster = own_cluster()
    try:
        yield ("--catalog-url", cluster.url)
    finally:
        cluster.destroy()


def test_commands_before_the_first_serve_are_the_serving_node_s(
    tmp_path: Path, demo_dir: Path, catalog_flags: tuple[str, ...]
) -> None:
    """``prepare`` then ``serve --node-name a`` (issue 30, item 11): what the command built is
    node a's, with its history; no node named after the host (down, never seen) is left
    holding rows that point at node a's files."""
    cache = tmp_path / "cache"
    profile = ("--max-input-len", "64", "--max-kv-cache-capacity", "128")
    done = run_cli(cache, *catalog_flags, "prepare", str(demo_dir), *profile, "--json", timeout=300)
    assert done.returncode == 0, done.stderr
    assert not (cache / NODE_FILE_NAME).exists(), "only a server claims the directory"
    assert (cache / UNCLAIMED_NODE_FILE_NAME).read_text().startswith("unclaimed-")
    with (
        running_server(None, cache, tmp_path, "--node-name", "a", *catalog_flags) as server,
        server.http() as h,
    ):
        nodes = h.get("/admin/nodes").json()["items"]
        bundles = h.get("/admin/bundles").json()["items"]
        builds = h.get("/admin/events", params={"kind": "build_ok"}).json()["items"]
    assert not (cache / UNCLAIMED_NODE_FILE_NAME).exists()
    assert [n["name"] for n in nodes] == ["a"], nodes
    assert socket.gethostname() not in {n["name"] for n in nodes}
    assert len(bundles) == 1 and bundles[0]["node"] == "a", bundles
    assert [e["node"] for e in builds] == ["a"], builds
    # Commands now act as node a, and find the bundle.
    listed = run_cli(cache, *catalog_flags, "bundles", "ls", "--json")
    assert listed.returncode == 0, listed.stderr
    assert bundles[0]["id"] in listed.stdout
