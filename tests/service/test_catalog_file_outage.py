"""The SQLite catalog file deleted, or made read-only, under a real ``cachesvc serve`` (issue 30,
item 3).

The server used to go on writing to the unlinked file: 200s for pins, aliases and builds,
``/health`` ``ok``, ``cachesvc_catalog_up 1``, all of it lost at the next start, whose reconcile
then deleted every converted adapter folder the fresh catalog did not know. A read-only file
reported healthy too, and the heartbeat's failure was logged on every beat. Now the file that is
no longer the one opened (or cannot be written) is an outage like a stopped PostgreSQL server:
writing routes answer 503 in our own words, ``/health`` and ``/metrics`` say so, the outage is
logged once, loaded models keep serving, the file is not created again while the server runs,
and a restart on a fresh catalog keeps the cache's files (bundles are adopted, adapter files
kept).
"""

from __future__ import annotations

import contextlib
import os
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tests.service.conftest import MODEL, ServerProcess, running_server
from tests.support.adapters import write_adapter

CATALOG = "catalog.sqlite3"
COMPLETION = {"model": MODEL, "prompt": "hi", "max_tokens": 2}


def _assert_503(r: httpx.Response, *, openai: bool = False) -> str:
    assert r.status_code == 503, r.text
    assert int(r.headers["retry-after"]) > 0
    message = str(r.json()["error"]["message"] if openai else r.json()["detail"])
    assert message.startswith("catalog unavailable: "), message
    assert "\n" not in message and "/" not in message, message  # our words: no path, no driver text
    return message


def _log_lines(server: ServerProcess, text: str) -> list[str]:
    return [line for line in server.log_path.read_text(errors="replace").splitlines() if text in line]


def _writes_refused(server: ServerProcess, bundle_id: str, demo_dir: Path) -> list[str]:
    """Every catalog-writing route answers 503 while loaded models keep serving."""
    with server.http() as h:
        messages = [
            _assert_503(h.put(f"/admin/bundles/{bundle_id}/pin")),
            _assert_503(h.put("/admin/models/alias", json={"bundle_id": bundle_id})),
            _assert_503(h.post("/admin/builds", json={"model": str(demo_dir), "max_input_len": 32})),
        ]
        for _ in range(3):
            assert h.post("/v1/completions", json=COMPLETION).status_code == 200
        health = h.get("/health").json()["catalog"]
        assert health["status"] == "unavailable", health
        assert "cachesvc_catalog_up 0.0" in h.get("/metrics").text
    return messages


@pytest.fixture
def adapter_dir(demo_dir: Path, tmp_path: Path) -> Path:
    return write_adapter(demo_dir, tmp_path / "adapter", seed=5)


def test_a_deleted_catalog_is_an_outage_and_the_restart_keeps_the_cache_files(
    demo_dir: Path, adapter_dir: Path, tmp_path: Path
) -> None:
    cache = tmp_path / "cache"
    flags = ("--max-input-len", "64", "--max-kv-cache-capacity", "128", "--heartbeat-seconds", "0.3")
    with running_server(demo_dir, cache, tmp_path, *flags, "--lora-modules", f"sql={adapter_dir}") as server:
        bundle_id = server.bundle_id()
        (adapter_file,) = (cache / "adapters").glob("*/adapter.onnx_adapter")
        adapter_inode = adapter_file.stat().st_ino
        for suffix in ("", "-wal", "-shm"):
            (cache / f"{CATALOG}{suffix}").unlink(missing_ok=True)
        messages = _writes_refused(server, bundle_id, demo_dir)
        assert all("deleted" in m for m in messages), messages
        time.sleep(1.5)  # five heartbeats and desired-state passes: none of them brings the file back
        assert not (cache / CATALOG).exists(), "the running server created a new, empty catalog"
        assert len(_log_lines(server, "catalog unavailable: ")) == 1, server.log_tail()
        assert not _log_lines(server, "Traceback"), server.log_tail()
    # A restart opens a fresh catalog: the bundle is adopted from its manifest, the adapter's
    # converted file (no row knows it now) is kept, not deleted.
    with running_server(None, cache, tmp_path, "--heartbeat-seconds", "0.3") as again:
        with again.http() as h:
            ids = [b["id"] for b in h.get("/admin/bundles").json()["items"]]
        assert bundle_id in ids
        assert adapter_file.stat().st_ino == adapter_inode, "reconcile removed the converted adapter"
        assert not _log_lines(again, "adapter folders removed"), again.log_tail()


@contextlib.contextmanager
def _read_only(path: Path) -> Iterator[None]:
    """``path`` cannot be written, even by root (the immutable flag; mode bits for other users)."""
    if os.geteuid() != 0:
        path.chmod(0o444)
        try:
            yield
        finally:
            path.chmod(0o644)
        return
    r = subprocess.run(["chattr", "+i", str(path)], capture_output=True, text=True, check=False)
    if r.returncode != 0:
        pytest.skip(f"cannot make a file immutable here ({r.stderr.strip()})")
    try:
        yield
    finally:
        subprocess.run(["chattr", "-i", str(path)], check=True)


def test_a_read_only_catalog_is_an_outage_logged_once_and_ends_without_a_restart(
    demo_dir: Path, tmp_path: Path
) -> None:
    cache = tmp_path / "cache"
    flags = ("--max-input-len", "64", "--max-kv-cache-capacity", "128", "--heartbeat-seconds", "0.2")
    with running_server(demo_dir, cache, tmp_path, *flags) as server:
        bundle_id = server.bundle_id()
        with _read_only(cache / CATALOG):
            messages = _writes_refused(server, bundle_id, demo_dir)
            assert all("read-only" in m for m in messages), messages
            time.sleep(2.0)  # ten heartbeats
            assert len(_log_lines(server, "catalog unavailable: ")) == 1, server.log_tail()
            assert not _log_lines(server, "heartbeat of node"), server.log_tail()
        deadline = time.monotonic() + 10
        with server.http() as h:
            while h.put(f"/admin/bundles/{bundle_id}/pin").status_code != 200:
                assert time.monotonic() < deadline, server.log_tail()
                time.sleep(0.2)
            assert h.get("/health").json()["catalog"]["status"] == "ok"
            assert "cachesvc_catalog_up 1.0" in h.get("/metrics").text
        assert len(_log_lines(server, "catalog available again")) == 1, server.log_tail()
        assert not _log_lines(server, "Traceback"), server.log_tail()
