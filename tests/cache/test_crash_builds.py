"""kill -9 at random points of 30 builds: after reconcile the catalog and the disk agree.

Each build runs in its own child process, forked from the test so that it starts at once (the
real manager, opened in the child, with the file-writing test builder: 20 files with a short
pause after each), and is killed with SIGKILL at a point drawn from a seeded RNG: inside the
builder after file n (``CACHESVC_TEST_KILL_AT``), just before the publishing rename, just after
it (before the row is marked ready), or by the parent after a random delay (anywhere: resolve,
catalog writes, hashing, publish). Some children finish before the parent's kill lands; they
must leave a complete bundle.
"""

from __future__ import annotations

import multiprocessing
import os
import random
import signal
import time
from pathlib import Path

from tests.admin.conftest import open_manager
from tests.cache.conftest import assert_consistent, checkpoints
from tests.support.prepare_child import run

BUILDS = 30
SEED = 9
PARALLEL = 4
FORK = multiprocessing.get_context("fork")


def _child(cache: str, ckpt: str, mode: str, kill_at: str | None) -> None:
    os.environ["CACHESVC_TEST_DELAY"] = "0.02"
    if kill_at is not None:
        os.environ["CACHESVC_TEST_KILL_AT"] = kill_at
    run(cache, ckpt, mode)


def _points(rng: random.Random) -> list[tuple[str, str | float]]:
    kinds = ["builder", "crash-publish", "crash-ready", "parent"]
    out: list[tuple[str, str | float]] = []
    for i in range(BUILDS):
        kind = kinds[i % len(kinds)]
        if kind == "builder":
            out.append((kind, str(rng.randrange(20))))
        elif kind == "parent":
            out.append((kind, rng.uniform(0.0, 0.8)))
        else:
            out.append((kind, ""))
    rng.shuffle(out)
    return out


def test_kill_9_at_random_points_of_30_builds(tmp_path: Path) -> None:
    cache = tmp_path / "cache"
    open_manager(cache).close()
    ckpts = checkpoints(tmp_path / "models", BUILDS)
    points = _points(random.Random(SEED))
    outcomes: dict[str, int] = {}
    pending = list(zip(ckpts, points, strict=True))
    while pending:
        batch, pending = pending[:PARALLEL], pending[PARALLEL:]
        procs = []
        for ckpt, (kind, arg) in batch:
            mode = kind if kind in ("crash-publish", "crash-ready") else "prepare"
            kill_at = str(arg) if kind == "builder" else None
            proc = FORK.Process(target=_child, args=(str(cache), str(ckpt), mode, kill_at))
            proc.start()
            procs.append((proc, kind, arg, time.monotonic()))
        for proc, kind, arg, started in procs:
            if kind == "parent":
                assert isinstance(arg, float)
                time.sleep(max(0.0, started + arg - time.monotonic()))
                if proc.pid is not None:
                    os.kill(proc.pid, signal.SIGKILL)
            proc.join(120)
            code = proc.exitcode
            assert code in (0, -signal.SIGKILL), (kind, arg, code)
            key = "finished" if code == 0 else f"killed ({kind})"
            outcomes[key] = outcomes.get(key, 0) + 1
    m = open_manager(cache)
    try:
        m.reconciler.reconcile()
        assert_consistent(m)
        # And every checkpoint can still be prepared, from the cache or by a fresh build.
        for ckpt in ckpts:
            m.prepare(str(ckpt))
        assert_consistent(m)
        assert m.queries.list_bundles().total == BUILDS
    finally:
        m.close()
    print(f"\n30 builds killed at random points: {outcomes}")
    assert sum(outcomes.values()) == BUILDS
