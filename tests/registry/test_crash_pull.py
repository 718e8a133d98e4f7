"""kill -9 in the middle of a pull (a real child process, stopped at the ``pull:layer`` crash
point: one layer is in staging): nothing is published; a rerun resumes (keeps the checked
layer) and completes; or reconcile removes the staging directory and a rerun pulls it whole."""

from __future__ import annotations

import multiprocessing
import os
import signal
from pathlib import Path

import pytest

from cachesvc.cache.crashpoints import ENV_VAR
from cachesvc.cache.profiles import ProfileRequest
from tests.cache.conftest import assert_consistent
from tests.registry.conftest import Registry, open_node

FORK = multiprocessing.get_context("fork")
INT4 = ProfileRequest(precision="int4")


def _pull_child(cache: str, registry: Registry, checkpoint: str) -> None:
    os.environ[ENV_VAR] = "pull:layer"
    node = open_node(Path(cache), registry)
    node.pull(checkpoint, INT4)
    os._exit(0)  # not reached: the crash point kills the process first


@pytest.mark.parametrize("resume", [True, False], ids=["resumed", "after-reconcile"])
def test_kill_9_mid_pull_publishes_nothing_and_a_rerun_completes(
    tmp_path: Path, registry: Registry, checkpoint: Path, resume: bool
) -> None:
    a = open_node(tmp_path / "node-a", registry)
    bid = a.prepare(str(checkpoint), INT4).bundle_id
    a.registry.push(bid)

    cache_b = tmp_path / "node-b"
    open_node(cache_b, registry).close()
    proc = FORK.Process(target=_pull_child, args=(str(cache_b), registry, str(checkpoint)))
    proc.start()
    proc.join(60)
    assert proc.exitcode == -signal.SIGKILL

    b = open_node(cache_b, registry)
    assert b.catalog.bundles.all() == []
    assert list((cache_b / "engines").glob("*/*")) == []
    (leftover,) = list(b.layout.staging.iterdir())
    # At least the first layer is whole (the crash point); the others may be cut short.
    assert leftover.name.startswith(f"{bid}.") and len(list(leftover.iterdir())) >= 1
    if resume:
        # Whole layers are kept; a stray file goes, a file cut short is downloaded again.
        whole = {p.name for p in leftover.iterdir() if p.stat().st_size == 4096}
        assert whole
        (leftover / "stray.bin").write_bytes(b"x")
        for name in {"part-000.bin", "part-001.bin", "part-002.bin"} - whole:
            (leftover / name).write_bytes(b"half")
        again = b.pull(str(checkpoint), INT4)
        assert again.reused == len(whole)
    else:
        report = b.reconciler.reconcile()
        assert report.staging_removed == (leftover.name,)
        again = b.pull(str(checkpoint), INT4)
        assert again.reused == 0
    assert not again.already and again.bundle_id == bid
    assert b.verifier.verify(bid).ok
    assert_consistent(b)
    a.close()
    b.close()
