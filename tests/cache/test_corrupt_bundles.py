"""Item 3: a bundle whose bytes changed is never served.

Every hit checks sizes and a sampled hash; ``serve`` start re-hashes the whole manifest; a
loaded bundle that a verify finds corrupt is taken out of service (``/health/ready`` 503,
``/v1`` 503 with the reason) and unloaded.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from cachesvc.cache.manager import CacheManager
from cachesvc.cache.profiles import ProfileRequest
from cachesvc.cache.store.manifest import SAMPLE_BYTES
from cachesvc.errors import CorruptBundleError
from inference.demo import write_demo_checkpoint
from inference.openai import load_tokenizer
from tests.admin.conftest import open_manager
from tests.support.cache import FileBuilder, ServableFileBuilder, make_checkpoint
from tests.support.engines import TableEngine
from tests.support.whole_app import App, running_app

BIG = 4 * SAMPLE_BYTES  # larger than the three samples: its middle quarter is not sampled


def _flip(path: Path, offset: int) -> None:
    with path.open("r+b") as fh:
        fh.seek(offset)
        byte = fh.read(1)
        fh.seek(offset)
        fh.write(bytes([byte[0] ^ 0xFF]))


@pytest.fixture
def big_manager(tmp_path: Path) -> Iterator[CacheManager]:
    m = open_manager(tmp_path / "cache", FileBuilder(files=2, file_size=BIG))
    try:
        yield m
    finally:
        m.close()


def test_a_hit_with_flipped_sampled_bytes_is_rebuilt_not_served(
    big_manager: CacheManager, tmp_path: Path
) -> None:
    ckpt = str(make_checkpoint(tmp_path / "ckpt", seed=5))
    first = big_manager.prepare(ckpt)
    _flip(first.bundle_dir / "part-000.bin", 10)  # inside the first sample
    again = big_manager.prepare(ckpt)
    assert again.built, "a bundle with flipped bytes was served as a hit"
    assert big_manager.verifier.verify(again.bundle_id).ok
    kinds = [(e.kind, e.reason) for e in big_manager.catalog.events.recent(bundle_id=first.bundle_id)]
    assert ("verify", "corrupt") in kinds


def test_a_truncated_file_is_rebuilt(big_manager: CacheManager, tmp_path: Path) -> None:
    ckpt = str(make_checkpoint(tmp_path / "ckpt", seed=6))
    first = big_manager.prepare(ckpt)
    with (first.bundle_dir / "part-001.bin").open("r+b") as fh:
        fh.truncate(BIG - 1)
    assert big_manager.prepare(ckpt).built


def test_serve_start_rehashes_everything(big_manager: CacheManager, tmp_path: Path) -> None:
    ckpt = str(make_checkpoint(tmp_path / "ckpt", seed=7))
    first = big_manager.prepare(ckpt)
    _flip(first.bundle_dir / "part-000.bin", BIG // 2 - SAMPLE_BYTES)  # outside every sample
    # The quick check on a plain hit cannot see it (that is the price of sampling) ...
    assert not big_manager.prepare(ckpt).built
    # ... the full check at serve start does, and the bundle is rebuilt before it is loaded.
    result, lease = big_manager.prepare_and_lease(ckpt, ProfileRequest(), full_verify=True)
    try:
        assert result.built
        assert big_manager.verifier.verify(result.bundle_id).ok
    finally:
        lease.release()


@pytest.fixture
def doomed_app(tmp_path: Path) -> Iterator[App]:
    with running_app(tmp_path) as running:
        yield running


def _wait_for(predicate, timeout: float = 15.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.05)
    return False


def test_verify_failure_takes_the_loaded_model_out_of_service(doomed_app: App) -> None:
    app = doomed_app
    bid = app.runtime.prepared.bundle_id
    with app.http() as h:
        assert h.get("/health/ready").status_code == 200
        _flip(app.runtime.prepared.bundle_dir / "part-000.bin", 3)
        r = h.post(f"/admin/bundles/{bid}/verify")
        assert r.status_code == 200 and r.json()["ok"] is False, r.text
        assert _wait_for(lambda: h.get("/health/ready").status_code == 503)
        health = h.get("/health").json()
        assert health["status"] == "unavailable"
        assert bid in health["reason"]
        r = h.post("/v1/completions", json={"model": "tiny", "prompt": "hi", "max_tokens": 1})
        assert r.status_code == 503, r.text
        assert r.json()["error"]["code"] == "server_unavailable"
        assert "failed verification" in r.json()["error"]["message"]
        # Unloaded: the lease is released, so the bundle can be rebuilt.
        assert _wait_for(lambda: not app.runtime.lease.held)


def test_corruption_found_by_another_process_is_noticed(doomed_app: App) -> None:
    app = doomed_app
    bid = app.runtime.prepared.bundle_id
    other = CacheManager.open(
        app.manager.layout.root, max_size_bytes=10**12, builders=app.manager.builders, offline=True
    )
    try:
        _flip(app.runtime.prepared.bundle_dir / "part-001.bin", 0)
        assert not other.verifier.verify(bid).ok  # e.g. `cachesvc bundles verify` from a shell
    finally:
        other.close()
    with app.http() as h:
        assert _wait_for(lambda: h.get("/health/ready").status_code == 503, timeout=15)
        assert h.get("/v1/models").status_code == 503


def test_an_unloaded_model_with_a_flipped_byte_is_refused_at_load_and_rebuilt(tmp_path: Path) -> None:
    demo = write_demo_checkpoint(tmp_path / "demo", size="tiny")
    vocab = load_tokenizer(demo).vocab_size
    manager = open_manager(tmp_path / "cache", ServableFileBuilder(demo, file_size=BIG))
    intact = str(make_checkpoint(tmp_path / "models" / "intact", seed=21))
    flipped = str(make_checkpoint(tmp_path / "models" / "flipped", seed=22))

    def engines(bundle_dir: Path, *, max_slots: int) -> TableEngine:
        return TableEngine(vocab_size=vocab, capacity=256, max_slots=max_slots)

    with running_app(tmp_path, manager=manager, engine_factory=engines) as app:
        good = manager.prepare(intact)
        bad = manager.prepare(flipped)
        _flip(bad.bundle_dir / "part-000.bin", 10)  # a weights file, inside its first sample
        body = {"prompt": "hi", "max_tokens": 1}
        with app.http() as h:
            # The same path loads an intact bundle (the check is what refuses the other one).
            assert h.post("/v1/completions", json={**body, "model": intact}).status_code == 200
            r = h.post("/v1/completions", json={**body, "model": flipped})
            assert r.status_code == 503, r.text
            error = r.json()["error"]
            assert bad.bundle_id in error["message"] and "manifest" in error["message"], error
            assert error["code"] == "bundle_corrupt"
            assert bad.bundle_id not in {e["bundle_id"] for e in h.get("/admin/engines").json()["engines"]}
        assert manager.catalog.bundles.require(bad.bundle_id).state == "corrupt"
        assert not manager.store.locks.is_locked(bad.bundle_id), "the refused load kept its lease"
        again = manager.prepare(flipped)  # the next prepare rebuilds it
        assert again.built and again.bundle_id == bad.bundle_id
        assert manager.catalog.bundles.require(bad.bundle_id).state == "ready"
        with app.http() as h:
            assert h.post("/v1/completions", json={**body, "model": flipped}).status_code == 200
        assert good.bundle_id != bad.bundle_id


def test_the_row_state_alone_refuses_a_lease(big_manager: CacheManager, tmp_path: Path) -> None:
    """A bundle another process marked corrupt, or flagged stale, is not leased even though its
    files pass the load check: the row is the verdict until a verify or a prepare changes it."""
    result = big_manager.prepare(str(make_checkpoint(tmp_path / "ckpt", seed=9)))
    bid = result.bundle_id
    big_manager.catalog.bundles.set_verified(bid, ok=False, detail="found corrupt elsewhere")
    with pytest.raises(CorruptBundleError):
        big_manager.lease(bid)
    big_manager.catalog.bundles.set_verified(bid, ok=True, detail=None, stale="built for another GPU")
    assert big_manager.catalog.bundles.require(bid).state == "stale"
    with pytest.raises(CorruptBundleError):
        big_manager.lease(bid)
    assert not big_manager.store.locks.is_locked(bid)
