"""Child process for lock and crash tests: prepare (or lease) a bundle with the test builder.

usage: python -m tests.support.prepare_child CACHE_DIR CHECKPOINT {prepare|lease|crash-publish|crash-ready}
Prints one JSON line with the result; for ``lease`` prints it and then sleeps until killed.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import time
from pathlib import Path

from cachesvc.manager import CacheManager
from tests.support.cache import FileBuilder


def main() -> None:
    run(sys.argv[1], sys.argv[2], sys.argv[3])


def run(cache_dir: str, checkpoint: str, mode: str) -> None:
    """What the command line does; also the target of forked children (reliability tests)."""
    delay = float(os.environ.get("CACHESVC_TEST_DELAY", "0"))
    manager = CacheManager.open(
        Path(cache_dir), max_size_bytes=10**12, builders={"onnxruntime": FileBuilder(delay=delay)}
    )
    if mode == "crash-publish":
        import cachesvc.store.bundles as bundles

        real_replace = os.replace

        def dying_replace(src: object, dst: object) -> None:
            if str(src).find(".staging") >= 0 and "manifest" not in str(src):
                os.kill(os.getpid(), signal.SIGKILL)
            real_replace(src, dst)  # type: ignore[arg-type]

        bundles.os.replace = dying_replace  # type: ignore[attr-defined]
    if mode == "crash-ready":

        def dying_finish(*args: object, **kwargs: object) -> None:
            os.kill(os.getpid(), signal.SIGKILL)

        manager.catalog.finish_build = dying_finish  # type: ignore[method-assign]
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
