"""CacheManager on a real catalog (SQLite and PostgreSQL), real filesystem, real child processes."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from datetime import timedelta
from pathlib import Path

import pytest

from cachesvc.cache.catalog import utcnow
from cachesvc.cache.manager import CacheManager
from cachesvc.cache.profiles import ProfileRequest
from cachesvc.cache.store import verify_bundle
from cachesvc.errors import BuildError, CheckpointError, LeasedError, NotFoundError, PinnedError
from tests.support.cache import FileBuilder, child_env, make_checkpoint
from tests.support.databases import catalog_url_for

pytestmark = pytest.mark.usefixtures("catalog_db")

CHILD = [sys.executable, "-m", "tests.support.prepare_child"]


def open_manager(cache: Path, builder: FileBuilder | None = None, cap: int = 10**12) -> CacheManager:
    return CacheManager.open(
        cache,
        catalog_url=catalog_url_for(cache),
        max_size_bytes=cap,
        builders={"onnxruntime": builder or FileBuilder()},
    )


@pytest.fixture
def cache(tmp_path: Path) -> Path:
    return tmp_path / "cache"


def profiles(n: int) -> list[ProfileRequest]:
    return [ProfileRequest(max_input_len=64 + i, max_kv_cache_capacity=4096) for i in range(n)]


def test_prepare_miss_then_hit_records_events(cache: Path, tmp_path: Path) -> None:
    ckpt = make_checkpoint(tmp_path / "ckpt")
    builder = FileBuilder(files=5)
    m = open_manager(cache, builder)
    first = m.prepare(str(ckpt))
    assert first.built and first.bundle_dir.is_dir() and first.model_dir == ckpt.resolve()
    assert (first.bundle_dir / "manifest.json").exists()
    second = m.prepare(str(ckpt))
    assert not second.built and second.bundle_id == first.bundle_id and builder.calls == 1
    info = m.catalog.bundles.require(first.bundle_id)
    assert info.state == "ready" and info.hit_count == 1 and info.file_count == 5
    assert info.size_bytes == 5 * 1024
    kinds = [e.kind for e in m.catalog.events.recent()][::-1]
    assert kinds == ["miss", "build_ok", "hit"]
    stats = m.queries.stats()
    assert (stats.hits, stats.misses, stats.builds_ok, stats.bundles) == (1, 1, 1, 1)
    assert stats.hit_rate == 0.5
    # The bundle dir takes the cache root's permissions, not the staging dir's 0700.
    assert (first.bundle_dir.stat().st_mode & 0o777) == (cache.stat().st_mode & 0o777)


def test_different_profiles_are_different_bundles(cache: Path, tmp_path: Path) -> None:
    ckpt = make_checkpoint(tmp_path / "ckpt")
    m = open_manager(cache)
    a = m.prepare(str(ckpt), ProfileRequest(max_input_len=128))
    b = m.prepare(str(ckpt), ProfileRequest(max_input_len=256))
    assert a.bundle_id != b.bundle_id and a.bundle_dir != b.bundle_dir
    assert a.bundle_dir.parent == b.bundle_dir.parent  # engines/<model-digest16>/
    assert "i128-b4-kv8192-none-onnxruntime-fp32-" in a.bundle_dir.name


def test_build_failure_publishes_nothing(cache: Path, tmp_path: Path) -> None:
    class Broken(FileBuilder):
        def build(self, *args, **kwargs):
            super().build(*args, **kwargs)
            raise ValueError("weights are missing tensor 'lm_head.weight'")

    ckpt = make_checkpoint(tmp_path / "ckpt")
    m = open_manager(cache, Broken(files=3))
    with pytest.raises(BuildError, match=r"lm_head\.weight"):
        m.prepare(str(ckpt))
    assert list((cache / "engines").glob("*/*")) == []
    assert list((cache / ".staging").iterdir()) == []
    # No row for a bundle that does not exist; the failure stays in the event log.
    assert m.queries.list_bundles().total == 0
    failed = m.catalog.events.recent(kind="build_failed")
    assert len(failed) == 1 and "lm_head" in (failed[0].detail or "")
    assert m.queries.stats().builds_failed == 1
    # A working builder then builds the same profile cleanly.
    m.builders["onnxruntime"] = FileBuilder(files=3)
    assert m.prepare(str(ckpt)).built


def test_eight_processes_prepare_once(cache: Path, tmp_path: Path) -> None:
    ckpt = make_checkpoint(tmp_path / "ckpt")
    log = tmp_path / "builds.log"
    env = child_env(CACHESVC_TEST_BUILD_LOG=str(log), CACHESVC_TEST_DELAY="0.02")
    procs = [
        subprocess.Popen(
            [*CHILD, str(cache), str(ckpt), "prepare"], stdout=subprocess.PIPE, env=env, text=True
        )
        for _ in range(8)
    ]
    results = []
    for p in procs:
        out, _ = p.communicate(timeout=120)
        assert p.returncode == 0
        results.append(json.loads(out.strip().splitlines()[-1]))
    assert len(log.read_text().split()) == 1, "exactly one process must build"
    assert sum(r["built"] for r in results) == 1
    assert len({r["bundle_dir"] for r in results}) == 1
    m = open_manager(cache)
    assert m.queries.stats().misses == 1 and m.queries.stats().hits == 7


@pytest.mark.parametrize(
    "point", ["builder:0", "builder:10", "builder:19", "publish:staged", "first-move", "build:published"]
)
def test_sigkill_mid_build_leaves_nothing_half_written(cache: Path, tmp_path: Path, point: str) -> None:
    """Killed at each named step of a build, a cache holds no bundle or a whole one, and the next
    prepare (after reconcile) is clean."""
    ckpt = make_checkpoint(tmp_path / "ckpt")
    mode = "prepare"
    if point.startswith("builder:"):
        env = child_env(CACHESVC_TEST_KILL_AT=point.split(":")[1])
    elif point == "first-move":
        env, mode = child_env(), "first-move"
    else:
        env = child_env(CACHESVC_CRASH_AT=point)
    proc = subprocess.run([*CHILD, str(cache), str(ckpt), mode], env=env, capture_output=True, timeout=120)
    assert proc.returncode == -signal.SIGKILL, proc.stderr
    published = [p for p in (cache / "engines").glob("*/*") if p.is_dir()]
    whole = point in ("first-move", "build:published")
    if whole:
        # The one rename that publishes moves the whole verified bundle, never a part of it.
        assert len(published) == 1
        assert verify_bundle(published[0]).ok
    else:
        assert published == []
        assert len(list((cache / ".staging").iterdir())) == 1
    m = open_manager(cache)
    report = m.reconciler.reconcile()
    assert list((cache / ".staging").iterdir()) == []
    if whole:
        assert len(report.adopted) == 1
    else:
        assert len(report.staging_removed) == 1
    result = m.prepare(str(ckpt))
    assert result.built == (not whole)
    assert m.verifier.verify(result.bundle_id).ok
    assert m.catalog.bundles.require(result.bundle_id).state == "ready"


def _spawn_leaser(cache: Path, ckpt: Path) -> tuple[subprocess.Popen[str], str]:
    proc = subprocess.Popen(
        [*CHILD, str(cache), str(ckpt), "lease"], stdout=subprocess.PIPE, env=child_env(), text=True
    )
    assert proc.stdout is not None
    bid = json.loads(proc.stdout.readline())["bundle_id"]
    assert json.loads(proc.stdout.readline())["leased"] == bid
    return proc, bid


def test_leased_and_pinned_bundles_survive_prune(cache: Path, tmp_path: Path) -> None:
    m = open_manager(cache)
    leased_ckpt = make_checkpoint(tmp_path / "leased", seed=1)
    proc, leased_id = _spawn_leaser(cache, leased_ckpt)
    try:
        pinned_id = m.prepare(str(make_checkpoint(tmp_path / "pinned", seed=2))).bundle_id
        m.catalog.bundles.set_pinned(pinned_id, True)
        idle = [
            m.prepare(str(make_checkpoint(tmp_path / f"idle{i}", seed=10 + i))).bundle_id for i in range(3)
        ]
        # Make the protected ones the least recently used, so LRU would pick them first.
        base = utcnow() - timedelta(days=1)
        for i, bid in enumerate([leased_id, pinned_id, *idle]):
            m.catalog.bundles.touch(bid, base + timedelta(minutes=i))
        plan = m.evictor.plan(1)
        assert [e.bundle_id for e in plan.evict] == idle
        assert {(s.bundle_id, s.reason) for s in plan.skipped} == {
            (leased_id, "leased"),
            (pinned_id, "pinned"),
        }
        dry = m.evictor.prune(1, dry_run=True)
        assert dry.evicted == tuple(idle) and dry.dry_run
        assert all(m.catalog.bundles.require(b).state == "ready" for b in idle)  # dry run changed nothing
        result = m.evictor.prune(1)
        assert result.evicted == dry.evicted and result.freed_bytes == dry.freed_bytes
        assert {s.bundle_id for s in result.skipped} == {leased_id, pinned_id}
        assert (m.layout.root / m.catalog.bundles.require(leased_id).path / "manifest.json").exists()
        assert (m.layout.root / m.catalog.bundles.require(pinned_id).path / "manifest.json").exists()
        with pytest.raises(LeasedError) as exc:
            m.evictor.remove(leased_id)
        assert exc.value.holders and exc.value.holders[0]["pid"] == proc.pid
        with pytest.raises(PinnedError):
            m.evictor.remove(pinned_id)
        evictions = [e for e in m.catalog.events.recent(kind="evict")]
        assert {e.bundle_id for e in evictions} == set(idle) and all(e.reason == "lru" for e in evictions)
    finally:
        proc.kill()
        proc.wait()
    # Once the holder is gone the bundle can go.
    assert m.evictor.remove(leased_id) > 0
    with pytest.raises(NotFoundError):
        m.catalog.bundles.require(leased_id)


def test_prune_after_build_keeps_cache_under_cap(cache: Path, tmp_path: Path) -> None:
    m = open_manager(cache, FileBuilder(files=4, file_size=1000), cap=9000)
    ckpt = make_checkpoint(tmp_path / "ckpt")
    ids = [m.prepare(str(ckpt), req).bundle_id for req in profiles(3)]
    # Each bundle is 4000 bytes; the cap holds two, so the least recently used went.
    remaining = {b.id for b in m.queries.list_bundles().items}
    assert remaining == set(ids[1:])
    assert m.queries.stats().evictions_by_reason == {"lru": 1}
    assert m.queries.stats().evicted_bytes_by_reason == {"lru": 4000}


def test_clear_never_touches_checkpoints(cache: Path, tmp_path: Path) -> None:
    m = open_manager(cache)
    ckpt = make_checkpoint(tmp_path / "ckpt")
    for req in profiles(2):
        m.prepare(str(ckpt), req)
    hub_like = cache / "checkpoints" / "models--org--m"
    hub_like.mkdir(parents=True)
    (hub_like / "x").write_text("keep")
    dry = m.evictor.clear(dry_run=True)
    assert len(dry.evicted) == 2 and m.queries.list_bundles().total == 2
    result = m.evictor.clear()
    assert len(result.evicted) == 2 and m.queries.list_bundles().total == 0
    assert (hub_like / "x").read_text() == "keep" and ckpt.exists()
    assert m.queries.stats().evictions_by_reason == {"clear": 2}
    assert len(m.catalog.checkpoints.all()) == 1


def test_reconcile_forgets_vanished_and_adopts_unknown(cache: Path, tmp_path: Path) -> None:
    m = open_manager(cache)
    ckpt = make_checkpoint(tmp_path / "ckpt")
    gone, kept = (m.prepare(str(ckpt), req) for req in profiles(2))
    import shutil

    shutil.rmtree(gone.bundle_dir)
    # A second cache whose catalog is lost: its published dir must be adopted.
    other = tmp_path / "other"
    m2 = open_manager(other)
    built = m2.prepare(str(make_checkpoint(tmp_path / "ckpt2", seed=5)))
    m2.close()
    target = cache / built.bundle_dir.relative_to(other)
    target.parent.mkdir(parents=True, exist_ok=True)
    shutil.copytree(built.bundle_dir, target)
    report = m.reconciler.reconcile()
    assert report.forgotten == (gone.bundle_id,)
    assert report.adopted == (built.bundle_id,)
    assert m.catalog.bundles.require(built.bundle_id).state == "ready"
    assert m.queries.stats().evictions_by_reason == {"stale": 1}
    assert m.prepare(str(tmp_path / "ckpt2")).built is False  # the adopted bundle is a hit
    assert m.prepare(str(ckpt), profiles(2)[1]).bundle_id == kept.bundle_id
    # A second reconcile has nothing to do.
    again = m.reconciler.reconcile()
    assert (again.adopted, again.forgotten, again.staging_removed) == ((), (), ())


def test_reconcile_removes_unverifiable_dir(cache: Path, tmp_path: Path) -> None:
    m = open_manager(cache)
    bogus = cache / "engines" / ("ab" * 8) / "i1-b1-kv1-none-onnxruntime-fp32-000000000000"
    bogus.mkdir(parents=True)
    (bogus / "model.onnx").write_bytes(b"half")
    report = m.reconciler.reconcile()
    assert len(report.corrupt) == 1 and not bogus.exists()


def test_bit_flip_caught_by_verify_and_never_served(cache: Path, tmp_path: Path) -> None:
    builder = FileBuilder(files=4)
    m = open_manager(cache, builder)
    ckpt = make_checkpoint(tmp_path / "ckpt")
    first = m.prepare(str(ckpt))
    assert m.verifier.verify(first.bundle_id).ok
    victim = first.bundle_dir / "part-002.bin"
    data = bytearray(victim.read_bytes())
    data[100] ^= 0x01
    victim.write_bytes(bytes(data))
    result = m.verifier.verify(first.bundle_id)
    assert not result.ok and result.mismatches == ({"path": "part-002.bin", "reason": "sha256"},)
    assert m.catalog.bundles.require(first.bundle_id).state == "corrupt"
    with pytest.raises(Exception, match="corrupt"):
        m.lease(first.bundle_id)
    again = m.prepare(str(ckpt))
    assert again.built and builder.calls == 2  # rebuilt, never handed out corrupt
    assert m.verifier.verify(again.bundle_id).ok
    assert victim.read_bytes() != bytes(data)
    assert [e.reason for e in m.catalog.events.recent(kind="evict")] == ["corrupt"]


def test_background_build_joins_and_reports_progress(cache: Path, tmp_path: Path) -> None:
    m = open_manager(cache, FileBuilder(files=10, delay=0.05))
    ckpt = make_checkpoint(tmp_path / "ckpt")
    a = m.start_build(str(ckpt))
    b = m.start_build(str(ckpt))
    assert a.id == b.id
    done = m.builds.wait(a.id, timeout=60)
    assert done.state == "done" and done.built and done.bytes_written == 10 * 1024
    assert done.elapsed_seconds > 0.3
    with pytest.raises(CheckpointError, match="no such directory"):
        m.start_build(str(tmp_path / "missing"))  # refused up front, no build started
    (tmp_path / "empty").mkdir()
    with pytest.raises(CheckpointError, match=r"config\.json"):
        m.start_build(str(tmp_path / "empty"))  # no config.json: refused up front too
    (tmp_path / "empty" / "config.json").write_text("{}")
    with pytest.raises(CheckpointError, match="names no model family"):
        m.start_build(str(tmp_path / "empty"))  # of no model family: refused up front too
    (tmp_path / "empty" / "config.json").write_text('{"architectures": ["LlamaForCausalLM"]}')
    failed = m.start_build(str(tmp_path / "empty"))
    assert m.builds.wait(failed.id).state == "failed"
    assert "weight" in (m.builds.get(failed.id).error or "")
    assert [b.id for b in m.builds.all_builds()] == [failed.id, a.id]  # newest first
    with pytest.raises(NotFoundError):
        m.builds.get("build-nope")


def test_lease_blocks_eviction_in_process_and_releases(cache: Path, tmp_path: Path) -> None:
    m = open_manager(cache)
    res = m.prepare(str(make_checkpoint(tmp_path / "ckpt")))
    size = m.catalog.bundles.require(res.bundle_id).size_bytes
    lease = m.lease(res.bundle_id)
    assert [h.pid for h in m.queries.holders(res.bundle_id)] == [os.getpid()]
    with pytest.raises(LeasedError):
        m.evictor.remove(res.bundle_id)
    lease.release()
    assert m.queries.holders(res.bundle_id) == []
    assert m.evictor.remove(res.bundle_id) == size > 0
    assert not res.bundle_dir.exists()


def test_a_bundle_leased_after_planning_is_skipped_at_execution(cache: Path, tmp_path: Path) -> None:
    """The plan was made while the bundle was idle; another process leases it before the plan
    runs. Execution re-checks the lock at delete time, so the bundle stays."""
    m = open_manager(cache)
    ckpt = make_checkpoint(tmp_path / "late-lease", seed=5)
    bid = m.prepare(str(ckpt)).bundle_id
    plan = m.evictor.plan(0)
    assert [e.bundle_id for e in plan.evict] == [bid]
    proc, leased = _spawn_leaser(cache, ckpt)
    try:
        assert leased == bid
        result = m.evictor.execute(plan)
        assert result.evicted == ()
        assert [(s.bundle_id, s.reason) for s in result.skipped] == [(bid, "leased")]
        assert (m.queries.bundle_dir(m.catalog.bundles.require(bid)) / "manifest.json").exists()
    finally:
        proc.kill()
        proc.wait()


def test_a_bundle_pinned_after_planning_is_skipped_at_execution(cache: Path, tmp_path: Path) -> None:
    m = open_manager(cache)
    bid = m.prepare(str(make_checkpoint(tmp_path / "late-pin", seed=6))).bundle_id
    plan = m.evictor.plan(0)
    assert [e.bundle_id for e in plan.evict] == [bid]
    m.catalog.bundles.set_pinned(bid, True)
    result = m.evictor.execute(plan)
    assert result.evicted == ()
    assert [(s.bundle_id, s.reason) for s in result.skipped] == [(bid, "pinned")]
    assert (m.queries.bundle_dir(m.catalog.bundles.require(bid)) / "manifest.json").exists()


def test_reconcile_leaves_a_running_build_alone(cache: Path, tmp_path: Path) -> None:
    """A build in progress in another process holds its lock: reconcile must not take its staging
    directory away, and the build still publishes a bundle that verifies."""
    ckpt = make_checkpoint(tmp_path / "slow", seed=7)
    proc = subprocess.Popen(
        [*CHILD, str(cache), str(ckpt), "prepare"],
        stdout=subprocess.PIPE,
        env=child_env(CACHESVC_TEST_DELAY="0.05"),
        text=True,
    )
    try:
        staging = cache / ".staging"
        deadline = time.monotonic() + 60
        while not (staging.is_dir() and any(staging.iterdir())):
            assert proc.poll() is None and time.monotonic() < deadline, "the child never started building"
            time.sleep(0.02)
        report = open_manager(cache).reconciler.reconcile()
        assert report.staging_removed == ()
        out, _ = proc.communicate(timeout=120)
        assert proc.returncode == 0
        result = json.loads(out.strip().splitlines()[-1])
        assert result["built"] and verify_bundle(Path(result["bundle_dir"])).ok
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
