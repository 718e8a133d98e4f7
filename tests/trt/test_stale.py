"""Bundles for another GPU or TensorRT version: flagged ``stale`` at start, never served,
evicted first; ``ready`` again when the GPU they were built for is back.

A real catalog (SQLite file and PostgreSQL), a real cache directory, TensorRT bundles built
with the fake ``tensorrt``/``pycuda`` pair whose GPU (compute capability, name, count) is set
through its environment knobs; "restarting with another GPU" is a new CacheManager on the same
cache directory after the knob changed.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
from litestar.testing import TestClient

from cachesvc.cache.manager import CacheManager
from cachesvc.cache.profiles import ProfileRequest
from cachesvc.cli import main
from cachesvc.errors import CorruptBundleError
from cachesvc.serving.served_models import CatalogModels
from inference.openai.errors import ModelNotFoundError
from tests.admin.conftest import build_app
from tests.support.apps import LOOPBACK_URL
from tests.support.databases import catalog_url_for
from tests.trt.conftest import FAKE_DIR

pytestmark = pytest.mark.usefixtures("catalog_db")

REPO = Path(__file__).resolve().parents[2]
SHAPES: dict[str, Any] = {"max_input_len": 8, "max_kv_cache_capacity": 64, "max_batch_size": 1}
GPU_A = ("9.0", "Fake NVIDIA H100 (CPU emulation)")
GPU_B = ("8.9", "Fake NVIDIA L40S (CPU emulation)")


class Node:
    """One cache directory, opened again ("restarted") on whatever GPU the fake shows now."""

    def __init__(self, cache: Path, monkeypatch: pytest.MonkeyPatch) -> None:
        self.cache = cache
        self._monkeypatch = monkeypatch
        self.manager: CacheManager | None = None

    def gpu(self, gpu: tuple[str, str]) -> None:
        self._monkeypatch.setenv("FAKE_CUDA_CC", gpu[0])
        self._monkeypatch.setenv("FAKE_CUDA_NAME", gpu[1])

    def start(self) -> CacheManager:
        """Close the running manager (if any), open a new one and reconcile, as ``serve`` does."""
        self.stop()
        self.manager = CacheManager.open(
            self.cache, catalog_url=catalog_url_for(self.cache), max_size_bytes=10**12
        )
        return self.manager

    def stop(self) -> None:
        if self.manager is not None:
            self.manager.close()
            self.manager = None


@pytest.fixture
def node(fake_trt: ModuleType, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Node]:
    monkeypatch.delenv("CACHESVC_DISABLE_GPU", raising=False)
    n = Node(tmp_path / "cache", monkeypatch)
    n.gpu(GPU_A)
    try:
        yield n
    finally:
        n.stop()


@pytest.fixture
def built(node: Node, hf_checkpoint: Callable[..., Path]) -> tuple[str, str]:
    """On GPU A: an onnxruntime bundle (least recently used), then a TensorRT one."""
    m = node.start()
    ckpt = str(hf_checkpoint("llama"))
    ort = m.prepare(ckpt, ProfileRequest(backend="onnxruntime", **SHAPES))
    trt = m.prepare(ckpt, ProfileRequest(backend="tensorrt", **SHAPES))
    assert trt.built and "-tensorrt-sm90-" in trt.bundle_dir.name
    assert m.reconciler.reconcile().stale == ()  # built here: it runs here
    return ort.bundle_id, trt.bundle_id


def _cli(cache: Path, capsys: pytest.CaptureFixture[str], *argv: str) -> dict[str, Any]:
    url = catalog_url_for(cache)
    extra = ["--catalog-url", url] if url else []
    assert main(["--cache-dir", str(cache), *extra, *argv, "--json"]) == 0
    out: dict[str, Any] = json.loads(capsys.readouterr().out)
    return out


def test_another_gpu_flags_stale_never_serves_evicts_first_and_the_gpu_back_restores(
    node: Node, built: tuple[str, str], capsys: pytest.CaptureFixture[str]
) -> None:
    ort_id, trt_id = built
    node.gpu(GPU_B)
    m = node.start()
    report = m.reconciler.reconcile()
    assert report.stale == (trt_id,) and report.restored == ()
    info = m.catalog.bundles.require(trt_id)
    assert info.state == "stale" and "compute capability 9.0" in (info.error or "")
    assert "8.9" in (info.error or "") and m.catalog.bundles.require(ort_id).state == "ready"
    event = m.catalog.events.recent(kind="reconcile", bundle_id=trt_id)[0]
    assert (event.reason, event.detail) == ("stale", info.error)
    assert m.reconciler.reconcile().stale == ()  # flagged once

    # Never served: no lease, not listed by the pool, a clear 404 by name.
    with pytest.raises(CorruptBundleError, match="stale"):
        m.lease(trt_id)
    models = CatalogModels(m, max_slots=1)
    assert trt_id not in {r.bundle_id for r in models.servable()}
    assert ort_id in {r.bundle_id for r in models.servable()}
    with pytest.raises(ModelNotFoundError, match="stale"):
        models.resolve(trt_id)
    app, _ = build_app(m)
    with TestClient(app, base_url=LOOPBACK_URL) as client:
        listed = client.get("/admin/bundles", params={"state": "stale"})
        assert listed.status_code == 200, listed.text
        assert [b["id"] for b in listed.json()["items"]] == [trt_id]
        assert listed.json()["items"][0]["state"] == "stale"

    # The GPU it was built for is back: ready again, servable again.
    node.gpu(GPU_A)
    m = node.start()
    assert m.reconciler.reconcile().restored == (trt_id,)
    restored = m.catalog.bundles.require(trt_id)
    assert (restored.state, restored.error) == ("ready", None)
    assert m.catalog.events.recent(kind="reconcile", bundle_id=trt_id)[0].reason == "ready"
    m.lease(trt_id).release()

    # Another GPU again: the stale bundle goes first, though the onnxruntime one is older.
    node.gpu(GPU_B)
    m = node.start()
    m.reconciler.reconcile()
    sizes = {b: m.catalog.bundles.require(b).size_bytes for b in built}
    assert m.catalog.bundles.require(ort_id).last_used_at < m.catalog.bundles.require(trt_id).last_used_at  # type: ignore[operator]
    cap = sum(sizes.values()) - 1  # one of the two has to go
    plan = _cli(node.cache, capsys, "prune", "--max-size-bytes", str(cap), "--dry-run")
    assert [(e["id"], e["reason"]) for e in plan["evict"]] == [(trt_id, "stale")]
    dry = m.evictor.prune(cap, dry_run=True)
    assert [(e.bundle_id, e.reason) for e in dry.plan.evict] == [(trt_id, "stale")]
    with TestClient(build_app(m)[0], base_url=LOOPBACK_URL) as client:
        body = client.post("/admin/cache/prune", json={"max_size_bytes": cap, "dry_run": True}).json()
        assert [(p["bundle_id"], p["reason"]) for p in body["planned"]] == [(trt_id, "stale")]
    done = m.evictor.prune(cap)
    assert done.evicted == (trt_id,) and not m.queries.bundle_dir(info).exists()
    evict = m.catalog.events.recent(kind="evict", bundle_id=trt_id)[0]
    assert (evict.reason, evict.bytes) == ("stale", sizes[trt_id]) and "9.0" in (evict.detail or "")
    assert m.catalog.bundles.require(ort_id).state == "ready"
    assert m.queries.stats().evictions_by_reason == {"stale": 1}


def test_a_pinned_stale_bundle_stays_but_is_listed_as_stale(
    node: Node, built: tuple[str, str], capsys: pytest.CaptureFixture[str]
) -> None:
    ort_id, trt_id = built
    assert node.manager is not None
    node.manager.catalog.bundles.set_pinned(trt_id, True)
    node.gpu(GPU_B)
    m = node.start()
    m.reconciler.reconcile()
    assert m.catalog.bundles.require(trt_id).state == "stale"
    result = m.evictor.prune(0)
    assert result.evicted == (ort_id,)
    assert [(s.bundle_id, s.reason, s.stale) for s in result.skipped] == [(trt_id, "pinned", True)]
    assert m.queries.bundle_dir(m.catalog.bundles.require(trt_id)).exists()
    plan = _cli(node.cache, capsys, "prune", "--max-size-bytes", "0", "--dry-run")
    assert plan["skipped"] == [
        {
            "id": trt_id,
            "size_bytes": m.catalog.bundles.require(trt_id).size_bytes,
            "reason": "pinned",
            "stale": True,
        }
    ]


def test_another_tensorrt_version_or_no_gpu_is_stale_too_and_verify_says_so(
    node: Node,
    built: tuple[str, str],
    fake_trt: ModuleType,
    trt_version: Callable[[str], None],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    _, trt_id = built
    original = str(fake_trt.__version__)
    trt_version("10.99.0.0")
    m = node.start()
    assert m.reconciler.reconcile().stale == (trt_id,)
    assert f"TensorRT {original}" in (m.catalog.bundles.require(trt_id).error or "")
    trt_version(original)
    assert m.reconciler.reconcile().restored == (trt_id,)
    monkeypatch.setenv("FAKE_CUDA_DEVICES", "0")
    m = node.start()
    assert m.reconciler.reconcile().stale == (trt_id,)
    assert "no CUDA device" in (m.catalog.bundles.require(trt_id).error or "")
    monkeypatch.delenv("FAKE_CUDA_DEVICES")
    verified = m.verifier.verify(trt_id)
    assert (verified.ok, verified.state) == (True, "ready")
    node.gpu(GPU_B)
    verified = m.verifier.verify(trt_id)
    assert (verified.ok, verified.state) == (True, "stale")
    assert "compute capability 9.0" in (m.catalog.bundles.require(trt_id).error or "")
    assert [e.reason for e in m.catalog.events.recent(kind="verify", bundle_id=trt_id)][:2] == ["stale", "ok"]


def test_a_gpu_with_another_name_but_the_same_compute_capability_is_not_stale(
    node: Node, built: tuple[str, str]
) -> None:
    _, trt_id = built
    node.gpu(("9.0", "Fake NVIDIA H200 (CPU emulation)"))
    m = node.start()
    assert m.reconciler.reconcile().stale == () and m.catalog.bundles.require(trt_id).state == "ready"


def test_a_bundle_served_on_this_node_right_now_is_not_flagged(node: Node, built: tuple[str, str]) -> None:
    _, trt_id = built
    m = node.manager
    assert m is not None
    with m.lease(trt_id):  # a process here has it loaded: it runs here, whatever the probe says
        node.gpu(GPU_B)
        assert m.reconciler.reconcile().stale == ()
        assert m.verifier.verify(trt_id).state == "ready"
    assert m.reconciler.reconcile().stale == (trt_id,)


def test_prepare_takes_a_stale_bundle_back_when_its_gpu_is_back(
    node: Node, built: tuple[str, str], hf_checkpoint: Callable[..., Path]
) -> None:
    _, trt_id = built
    node.gpu(GPU_B)
    node.start().reconciler.reconcile()
    node.gpu(GPU_A)  # back, and no reconcile has run since
    m = node.start()
    again = m.prepare(str(hf_checkpoint("llama")), ProfileRequest(backend="tensorrt", **SHAPES))
    assert (again.bundle_id, again.built) == (trt_id, False)
    assert m.catalog.bundles.require(trt_id).state == "ready"


def test_prepare_rebuilds_a_stale_bundle_that_still_cannot_run(
    node: Node, built: tuple[str, str], hf_checkpoint: Callable[..., Path]
) -> None:
    _, trt_id = built
    m = node.start()
    # The manifest says the plan came from another TensorRT (as a bundle copied from another
    # node would): same key, files intact, but it cannot run here.
    bundle_dir = m.queries.bundle_dir(m.catalog.bundles.require(trt_id))
    manifest = json.loads((bundle_dir / "manifest.json").read_text())
    manifest["engine"]["tensorrt_version"] = "10.0.0.0"
    (bundle_dir / "manifest.json").write_text(json.dumps(manifest))
    assert m.reconciler.reconcile().stale == (trt_id,)
    again = m.prepare(str(hf_checkpoint("llama")), ProfileRequest(backend="tensorrt", **SHAPES))
    assert (again.bundle_id, again.built) == (trt_id, True)
    assert m.catalog.bundles.require(trt_id).state == "ready"
    assert [e.reason for e in m.catalog.events.recent(kind="evict", bundle_id=trt_id)] == ["stale"]
    assert m.reconciler.reconcile().stale == ()


_NO_GPU_IMPORTS = """
import sys
from pathlib import Path
from cachesvc.cache.manager import CacheManager
from tests.support.cache import FileBuilder, make_checkpoint
root = Path(sys.argv[1])
m = CacheManager.open(root / "cache", max_size_bytes=10**9, builders={"onnxruntime": FileBuilder()})
bid = m.prepare(str(make_checkpoint(root / "ckpt", seed=1))).bundle_id
m.reconciler.reconcile(); m.verifier.verify(bid); m.evictor.prune(0, dry_run=True)
loaded = sorted(n for n in sys.modules if n.split(".")[0] in ("tensorrt", "pycuda"))
assert not loaded, loaded
"""


def test_checking_for_stale_bundles_imports_nothing_without_tensorrt_bundles(
    tmp_path: Path, catalog_db: str
) -> None:
    if catalog_db != "sqlite":
        pytest.skip("the imports do not depend on the catalog")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), str(FAKE_DIR)])}
    env.pop("CACHESVC_DISABLE_GPU", None)
    done = subprocess.run(
        [sys.executable, "-c", _NO_GPU_IMPORTS, str(tmp_path)],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
        cwd=REPO,
    )
    assert done.returncode == 0, done.stderr
