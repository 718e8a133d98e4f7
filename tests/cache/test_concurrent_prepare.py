"""8 processes preparing one profile at the same moment: exactly one build, one bundle, 8 answers."""

from __future__ import annotations

import multiprocessing
import os
from pathlib import Path

from tests.admin.conftest import open_manager
from tests.cache.conftest import assert_consistent
from tests.support.cache import make_checkpoint
from tests.support.prepare_child import run

PROCESSES = 8
FORK = multiprocessing.get_context("fork")


def _child(cache: str, ckpt: str, log: str, go: object) -> None:
    os.environ["CACHESVC_TEST_DELAY"] = "0.02"  # a build of ~0.4 s: the others surely wait
    os.environ["CACHESVC_TEST_BUILD_LOG"] = log
    go.wait()  # type: ignore[attr-defined]
    run(cache, ckpt, "prepare")


def test_8_processes_prepare_one_profile_and_build_it_once(tmp_path: Path) -> None:
    cache = tmp_path / "cache"
    open_manager(cache).close()
    ckpt = make_checkpoint(tmp_path / "ckpt", seed=4)
    log = tmp_path / "builds.log"
    go = FORK.Event()
    procs = [
        FORK.Process(target=_child, args=(str(cache), str(ckpt), str(log), go)) for _ in range(PROCESSES)
    ]
    for p in procs:
        p.start()
    go.set()
    for p in procs:
        p.join(120)
    assert [p.exitcode for p in procs] == [0] * PROCESSES
    assert len(log.read_text().splitlines()) == 1, "more than one process built the bundle"
    m = open_manager(cache)
    try:
        assert_consistent(m)
        assert m.queries.list_bundles().total == 1
        stats = m.queries.stats()
        assert (stats.builds_ok, stats.misses, stats.hits) == (1, 1, PROCESSES - 1)
    finally:
        m.close()
