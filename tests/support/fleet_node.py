"""A fleet node process for e2e tests: the real app (``create_app``) under uvicorn.

usage: python -m tests.support.fleet_node CACHE_DIR CATALOG_URL NODE_NAME PORT [CAP_BYTES]

Uses the small file-writing test builder so convergence takes seconds, heartbeats every 0.3 s.
"""

from __future__ import annotations

import sys
from pathlib import Path

import uvicorn

from cachesvc.cache.manager import CacheManager
from cachesvc.serving.app import create_app
from cachesvc.settings.config import ServeConfig
from tests.support.cache import FileBuilder

HEARTBEAT_SECONDS = 0.3


def main() -> None:
    cache_dir, url, node, port = Path(sys.argv[1]), sys.argv[2], sys.argv[3], int(sys.argv[4])
    manager = CacheManager.open(
        cache_dir,
        catalog_url=url,
        node=node,
        max_size_bytes=int(sys.argv[5]) if len(sys.argv) > 5 else 10**9,
        builders={"onnxruntime": FileBuilder(files=3, file_size=2000)},
        offline=True,
    )
    manager.reconciler.reconcile()
    config = ServeConfig(
        cache_dir=cache_dir,
        catalog_url=url,
        node_name=node,
        heartbeat_seconds=HEARTBEAT_SECONDS,
        port=port,  # the Host header a client sends names it
        allowed_model_roots=str(cache_dir.parent),  # the test's models lie next to the caches
    )
    app = create_app(config, manager, close_manager=True)
    uvicorn.run(app, host="127.0.0.1", port=port, log_level="warning")


if __name__ == "__main__":
    main()
