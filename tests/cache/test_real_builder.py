"""Crash and lease safety with the real ONNX Runtime builder (not the file-writing test builder).

The tiny demo checkpoint builds in a second or two, so the real graph, optimisation, tokenizer
copies and ``engine.json`` go through staging, publish, reconcile and leases in child processes.
"""

from __future__ import annotations

import json
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from cachesvc.cache.manager import CacheManager
from cachesvc.cache.store import verify_bundle
from inference.demo import write_demo_checkpoint
from inference.runtime import load_engine
from tests.support.cache import child_env

CHILD = [sys.executable, "-m", "tests.support.prepare_child"]
REAL = {"CACHESVC_TEST_REAL_BUILDER": "1"}


@pytest.fixture(scope="module")
def demo(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_demo_checkpoint(tmp_path_factory.mktemp("real") / "demo", arch="llama", size="tiny")


def test_real_build_killed_before_publish_then_clean_rebuild_and_lease(demo: Path, tmp_path: Path) -> None:
    cache = tmp_path / "cache"
    killed = subprocess.run(
        [*CHILD, str(cache), str(demo), "prepare"],
        env=child_env(**REAL, CACHESVC_CRASH_AT="publish:staged"),
        capture_output=True,
        timeout=300,
    )
    assert killed.returncode == -signal.SIGKILL, killed.stderr
    assert [p for p in (cache / "engines").glob("*/*")] == []
    staged = list((cache / ".staging").iterdir())
    assert len(staged) == 1 and (staged[0] / "engine.json").is_file()  # the real build had finished

    manager = CacheManager.open(cache, max_size_bytes=10**12)
    try:
        report = manager.reconciler.reconcile()
        assert len(report.staging_removed) == 1 and list((cache / ".staging").iterdir()) == []
        leaser = subprocess.Popen(
            [*CHILD, str(cache), str(demo), "lease"], stdout=subprocess.PIPE, env=child_env(**REAL), text=True
        )
        try:
            assert leaser.stdout is not None
            built = json.loads(leaser.stdout.readline())
            assert built["built"] is True
            assert json.loads(leaser.stdout.readline())["leased"] == built["bundle_id"]
            bundle = Path(built["bundle_dir"])
            assert verify_bundle(bundle).ok
            # A serving process's lease keeps the real bundle through a prune to zero.
            result = manager.evictor.prune(0)
            assert result.evicted == () and [s.reason for s in result.skipped] == ["leased"]
            engine = load_engine(bundle, threads=1)
            assert engine.prefill(0, [1, 2, 3]).shape == (engine.info.vocab_size,)
            engine.close()
        finally:
            leaser.kill()
            leaser.wait()
        # The holder is gone: now the bundle can go.
        assert manager.evictor.prune(0).evicted == (built["bundle_id"],)
    finally:
        manager.close()
