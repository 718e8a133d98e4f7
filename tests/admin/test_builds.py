"""Background builds over the API: 202 with an id, joining, progress while running, failure."""

from __future__ import annotations

import threading
import time
from pathlib import Path
from typing import Any

import pytest
from litestar import Litestar
from litestar.testing import TestClient

from cachesvc.cache.manager import CacheManager
from tests.support.cache import FileBuilder

Client = TestClient[Litestar]


@pytest.fixture
def builder() -> FileBuilder:
    # 20 files, 40 ms apart: a build that runs long enough (~0.8 s) to be watched and joined.
    return FileBuilder(files=20, file_size=512, delay=0.04)


def _wait(client: Client, build_id: str, timeout: float = 30.0) -> dict[str, Any]:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        status: dict[str, Any] = client.get(f"/admin/builds/{build_id}").json()
        if status["state"] in ("done", "failed"):
            return status
        time.sleep(0.02)
    raise AssertionError(f"build {build_id} did not finish in {timeout} s")


def test_concurrent_posts_for_one_profile_make_one_build_with_visible_progress(
    client: Client, manager: CacheManager, builder: FileBuilder, checkpoint: Path
) -> None:
    request = {"model": str(checkpoint), "max_input_len": 256, "max_kv_cache_capacity": 512}
    barrier = threading.Barrier(2)
    answers: list[Any] = []

    def post() -> None:
        barrier.wait()
        answers.append(client.post("/admin/builds", json=request))

    threads = [threading.Thread(target=post) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert [r.status_code for r in answers] == [202, 202], [r.text for r in answers]
    ids = {r.json()["id"] for r in answers}
    assert len(ids) == 1
    (build_id,) = ids

    seen: list[dict[str, Any]] = []
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        status = client.get(f"/admin/builds/{build_id}").json()
        seen.append(status)
        if status["state"] in ("done", "failed"):
            break
        if status["state"] == "running" and len(seen) == 3:
            # A later request for the same profile joins the running build too.
            late = client.post("/admin/builds", json=request)
            assert late.status_code == 202 and late.json()["id"] == build_id
        time.sleep(0.02)
    running = [s for s in seen if s["state"] == "running" and s["stage"] == "write"]
    assert running, seen
    assert any(0 < s["progress"] < 1 for s in running)
    assert any(s["bytes_written"] > 0 for s in running)
    elapsed = [s["elapsed_seconds"] for s in running]
    assert elapsed == sorted(elapsed) and elapsed[-1] > 0

    final = _wait(client, build_id)
    assert final["state"] == "done", final
    assert final["progress"] == 1.0 and final["error"] is None and final["built"] is True
    assert final["bytes_written"] == manager.catalog.bundles.require(final["bundle_id"]).size_bytes
    assert builder.calls == 1
    assert [b["id"] for b in client.get("/admin/builds").json()["items"]] == [build_id]
    bundle = client.get(f"/admin/bundles/{final['bundle_id']}").json()["bundle"]
    assert bundle["state"] == "ready" and bundle["profile"]["max_input_len"] == 256


def test_build_of_existing_bundle_is_a_hit_not_a_rebuild(
    client: Client, manager: CacheManager, builder: FileBuilder, checkpoint: Path
) -> None:
    manager.prepare(str(checkpoint))
    r = client.post("/admin/builds", json={"model": str(checkpoint)})
    assert r.status_code == 202
    final = _wait(client, r.json()["id"])
    assert final["state"] == "done" and final["built"] is False
    assert builder.calls == 1


def test_failed_build_reports_the_error(client: Client, tmp_path: Path) -> None:
    missing = tmp_path / "no-such-model"
    r = client.post("/admin/builds", json={"model": str(missing)})
    assert r.status_code == 400  # checked before anything is queued
    assert str(missing) in r.json()["detail"]
    assert client.get("/admin/builds").json()["items"] == []
    not_a_checkpoint = tmp_path / "empty"
    not_a_checkpoint.mkdir()
    r = client.post("/admin/builds", json={"model": str(not_a_checkpoint)})
    assert r.status_code == 400  # no config.json: checked before anything is queued
    assert "config.json" in r.json()["detail"]
    (not_a_checkpoint / "config.json").write_text("{}")
    r = client.post("/admin/builds", json={"model": str(not_a_checkpoint)})
    assert r.status_code == 400  # a config.json of no model family: checked before anything is queued
    assert "names no model family" in r.json()["detail"]
    (not_a_checkpoint / "config.json").write_text('{"architectures": ["LlamaForCausalLM"]}')
    r = client.post("/admin/builds", json={"model": str(not_a_checkpoint)})
    assert r.status_code == 202  # only resolving finds that the weights are missing
    final = _wait(client, r.json()["id"])
    assert final["state"] == "failed"
    assert "weight" in final["error"]
    assert final["finished_at"] is not None


def test_task_embed_builds_an_embedding_profile_apart(client: Client, builder: FileBuilder,
                                                      checkpoint: Path) -> None:
    """``"task": "embed"`` asks for an embedding bundle: its own profile (and bundle id), pooling
    defaulting to last; a pooling without it, or a quantized embedding, is a 400 naming the field."""
    base = {"model": str(checkpoint), "max_input_len": 256, "max_kv_cache_capacity": 512}
    text = _wait(client, client.post("/admin/builds", json=base).json()["id"])
    embed = _wait(client, client.post("/admin/builds", json={**base, "task": "embed"}).json()["id"])
    assert text["state"] == embed["state"] == "done"
    assert embed["profile"]["task"] == "embed" and embed["profile"]["pooling"] == "last"
    assert "task" not in text["profile"] and embed["bundle_id"] != text["bundle_id"]
    half = _wait(client, client.post("/admin/builds", json={**base, "kv_cache_dtype": "fp16"}).json()["id"])
    assert half["profile"]["kv_cache_dtype"] == "fp16" and "kv_cache_dtype" not in text["profile"]
    assert half["bundle_id"] != text["bundle_id"]
    mean = client.post("/admin/builds", json={**base, "task": "embed", "pooling": "mean"}).json()
    assert _wait(client, mean["id"])["profile"]["pooling"] == "mean"
    for body, field in (({**base, "pooling": "mean"}, "pooling"),
                        ({**base, "task": "embed", "precision": "int8"}, "task"),
                        ({**base, "task": "rerank"}, "task"),
                        ({**base, "task": "embed", "kv_cache_dtype": "fp16"}, "kv_cache_dtype"),
                        ({**base, "kv_cache_dtype": "q8_0"}, "kv_cache_dtype"),
                        # Image-token limits: a text-only checkpoint takes no images (400, not a 202).
                        ({**base, "max_image_tokens": 64}, "max_image_tokens"),
                        ({**base, "max_image_tokens_per_image": 0}, "max_image_tokens_per_image"),
                        ({**base, "max_image_tokens": 16, "max_image_tokens_per_image": 32},
                         "max_image_tokens_per_image")):
        r = client.post("/admin/builds", json=body)
        assert r.status_code == 400, r.text
        assert field in r.text
