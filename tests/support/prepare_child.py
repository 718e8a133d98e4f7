"""Child process for lock and crash tests: prepare (or lease) a bundle with the test builder.

usage: python -m tests.support.prepare_child CACHE_DIR CHECKPOINT {prepare|lease|first-move}

Prints one JSON line with the result; ``lease`` prints it, takes the lease, prints a second
line and then sleeps until killed. Crash tests kill the child at a named point with
``CACHESVC_CRASH_AT`` (see :mod:`cachesvc.cache.crashpoints`) or, with the test builder, after its
n-th file (``CACHESVC_TEST_KILL_AT``). ``CACHESVC_TEST_REAL_BUILDER=1`` builds with the real
ONNX Runtime builder instead of the test builder. ``first-move`` kills the child right after the first
rename whose target lies under the cache's ``engines/``: with an atomic publish that rename is
the whole bundle; a publish that moved files one by one would leave half a bundle behind.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import time
from pathlib import Path
from typing import Any

from cachesvc.cache.manager import CacheManager
from tests.support.cache import FileBuilder
from tests.support.databases import catalog_url_for


def _kill_after_first_move_into(engines: Path) -> None:
    real = {"replace": os.replace, "rename": os.rename}

    def wrap(name: str) -> Any:
        def move(src: Any, dst: Any, *args: Any, **kwargs: Any) -> None:
            real[name](src, dst, *args, **kwargs)
            if Path(os.fsdecode(dst)).absolute().is_relative_to(engines):
                os.kill(os.getpid(), signal.SIGKILL)

        return move

    # Patched on the os module itself, so shutil.move and any other caller are covered too.
    os.replace = wrap("replace")
    os.rename = wrap("rename")


#: Older mode names for two named crash points (see :mod:`cachesvc.cache.crashpoints`).
CRASH_MODES = {"crash-publish": "publish:staged", "crash-ready": "build:published"}


def main() -> None:
    run(sys.argv[1], sys.argv[2], sys.argv[3])


def run(cache_dir_arg: str | Path, checkpoint: str, mode: str) -> None:
    """What the command line does; also the target of forked children (reliability tests)."""
    cache_dir = Path(cache_dir_arg)
    if mode in CRASH_MODES:
        os.environ["CACHESVC_CRASH_AT"] = CRASH_MODES[mode]
    delay = float(os.environ.get("CACHESVC_TEST_DELAY", "0"))
    # CACHESVC_TEST_REAL_BUILDER=1: the real ONNX Runtime builder instead of the file writer.
    real = os.environ.get("CACHESVC_TEST_REAL_BUILDER") == "1"
    manager = CacheManager.open(
        cache_dir,
        catalog_url=catalog_url_for(cache_dir),
        max_size_bytes=10**12,
        builders=None if real else {"onnxruntime": FileBuilder(delay=delay)},
    )
    if mode == "first-move":
        _kill_after_first_move_into((cache_dir / "engines").absolute())
    result = manager.prepare(checkpoint)
    print(
        json.dumps(
            {"bundle_id": result.bundle_id, "bundle_dir": str(result.bundle_dir), "built": result.built}
        )
    )
    sys.stdout.flush()
    if mode == "lease":
        lease = manager.lease(result.bundle_id)
        print(json.dumps({"leased": lease.bundle_id}))
        sys.stdout.flush()
        while True:
            time.sleep(1)


if __name__ == "__main__":
    main()
