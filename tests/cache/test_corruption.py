"""Corrupted bundles and catalogs are never served.

Seeded random damage to a built bundle (bit flips anywhere, truncated or missing files, a
truncated, emptied or missing manifest, a stray file), then what ``serve`` does before loading
(prepare, lease, full re-hash): the bundle it hands over always verifies against its manifest.
A real ``cachesvc serve`` starts on a bit-flipped bundle by rebuilding it, and refuses a
garbage catalog with one line and a non-zero exit instead of serving anything.
"""

from __future__ import annotations

import os
import random
import subprocess
from collections.abc import Callable
from pathlib import Path

import pytest

from cachesvc.cache.manager import CacheManager
from cachesvc.cache.profiles import ProfileRequest
from cachesvc.cache.store import verify_bundle
from inference.demo import write_demo_checkpoint
from tests.admin.conftest import open_manager
from tests.cache.conftest import assert_consistent
from tests.service.conftest import cachesvc_command, running_server, serve_args
from tests.support.cache import FileBuilder, child_env, make_checkpoint
from tests.support.engines import EngineScript, Reply

CASES = 24
SEED = 17


def _flip(rng: random.Random, d: Path) -> str:
    f = rng.choice(sorted(p for p in d.iterdir() if p.name != "manifest.json"))
    offset = rng.randrange(f.stat().st_size)
    data = bytearray(f.read_bytes())
    data[offset] ^= 1 << rng.randrange(8)
    f.write_bytes(bytes(data))
    return f"bit flip {f.name}@{offset}"


def _truncate_file(rng: random.Random, d: Path) -> str:
    f = rng.choice(sorted(p for p in d.iterdir() if p.name != "manifest.json"))
    os.truncate(f, rng.randrange(f.stat().st_size))
    return f"truncated {f.name}"


def _delete_file(rng: random.Random, d: Path) -> str:
    f = rng.choice(sorted(p for p in d.iterdir() if p.name != "manifest.json"))
    f.unlink()
    return f"deleted {f.name}"


def _truncate_manifest(rng: random.Random, d: Path) -> str:
    m = d / "manifest.json"
    os.truncate(m, rng.randrange(m.stat().st_size))
    return "truncated manifest"


def _delete_manifest(rng: random.Random, d: Path) -> str:
    (d / "manifest.json").unlink()
    return "deleted manifest"


def _stray_file(rng: random.Random, d: Path) -> str:
    (d / "stray.bin").write_bytes(rng.randbytes(100))
    return "stray file"


DAMAGE: list[Callable[[random.Random, Path], str]] = [
    _flip,
    _flip,
    _flip,
    _truncate_file,
    _delete_file,
    _truncate_manifest,
    _delete_manifest,
    _stray_file,
]


def test_damaged_bundles_are_never_handed_to_the_engine(tmp_path: Path) -> None:
    rng = random.Random(SEED)
    m = open_manager(tmp_path / "cache", FileBuilder(files=4, file_size=300 * 1024))
    ckpt = str(make_checkpoint(tmp_path / "ckpt", seed=31))
    request = ProfileRequest()
    done: list[str] = []
    try:
        for _ in range(CASES):
            bundle = m.prepare(ckpt, request).bundle_dir
            what = rng.choice(DAMAGE)(rng, bundle)
            result, lease = m.prepare_and_lease(ckpt, request, full_verify=True)
            try:
                report = verify_bundle(result.bundle_dir)
                assert report.ok, f"{what}: served a bundle with {report.mismatches}"
            finally:
                lease.release()
            done.append(what)
        m.reconciler.reconcile()
        assert_consistent(m)
    finally:
        m.close()
    kinds = sorted({" ".join(d.split(" ")[:2]) for d in done})
    print(f"\n{CASES} corruptions, none served: {kinds}")


@pytest.fixture(scope="module")
def demo_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_demo_checkpoint(tmp_path_factory.mktemp("demo") / "tiny", size="tiny")


SCRIPT = EngineScript(replies=(Reply("ok "),))


def test_serve_rebuilds_a_bit_flipped_bundle_before_loading_it(demo_dir: Path, tmp_path: Path) -> None:
    cache = tmp_path / "cache"
    args = serve_args(max_input_len=256, max_kv_cache_capacity=512)
    with running_server(demo_dir, cache, tmp_path, *args, env=SCRIPT.to_env()) as server:
        bid = server.bundle_id()
    m = CacheManager.open(cache, max_size_bytes=10**12)
    try:
        bundle = m.queries.bundle_dir(m.catalog.bundles.require(bid))
        weights = max((p for p in bundle.rglob("*") if p.is_file()), key=lambda p: p.stat().st_size)
        data = bytearray(weights.read_bytes())
        data[len(data) // 4] ^= 0x10  # outside the sampled hash of a hit: only the full check sees it
        weights.write_bytes(bytes(data))
    finally:
        m.close()
    with running_server(demo_dir, cache, tmp_path, *args, env=SCRIPT.to_env()) as server:
        assert server.bundle_id() == bid
        log = server.log_tail(20000)
    assert f"bundle {bid} is corrupt" in log, log
    m = CacheManager.open(cache, max_size_bytes=10**12)
    try:
        assert m.verifier.verify(bid).ok
        assert "corrupt" in [e.reason for e in m.catalog.events.recent(kind="verify", bundle_id=bid)]
    finally:
        m.close()


def test_serve_refuses_a_garbage_catalog_with_one_line(demo_dir: Path, tmp_path: Path) -> None:
    cache = tmp_path / "cache"
    open_manager(cache).close()
    (cache / "catalog.sqlite3").write_bytes(random.Random(1).randbytes(16384))
    r = subprocess.run(
        [*cachesvc_command(), "serve", str(demo_dir), "--cache-dir", str(cache), "--port", "1"],
        env=child_env(**SCRIPT.to_env()),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert r.returncode == 1, r.stderr
    errors = [line for line in r.stderr.splitlines() if " ERROR " in line]
    assert len(errors) == 1 and "cachesvc db repair" in errors[0], r.stderr
    assert "Traceback" not in r.stderr
