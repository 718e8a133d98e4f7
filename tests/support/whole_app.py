"""The whole app (``create_app``) on a real loopback server: the ``app`` fixture (re-exported by
``tests/service/conftest.py``) and ``running_app`` for tests that start their own.

The app is wired as ``cachesvc serve`` wires it (admin, metrics, health, ``/v1``) over a real
cache (SQLite catalog, files, locks) and the table engine (the hardware seam) with the demo
tokenizer; uvicorn serves it on 127.0.0.1 and the tests talk HTTP to it.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest

from cachesvc.cache.manager import CacheManager
from cachesvc.cache.profiles import ProfileRequest
from cachesvc.serving.app import create_app
from cachesvc.serving.model_loading import EngineFactory, Runtime
from cachesvc.settings.config import ServeConfig
from inference.demo import write_demo_checkpoint
from inference.openai import ModelHandle, ServingOptions, load_tokenizer
from tests.admin.conftest import open_manager
from tests.serving.conftest import LiveServer, TableEngine
from tests.support.cache import make_checkpoint
from tests.support.net import free_port

MODEL = "tiny"


@dataclass
class App:
    """A running whole app and its parts."""

    url: str
    port: int
    manager: CacheManager
    serving: ModelHandle
    runtime: Runtime
    checkpoint: Path

    def http(self, **kwargs: Any) -> httpx.Client:
        """A plain HTTP client on the server."""
        return httpx.Client(base_url=self.url, timeout=30, **kwargs)


def start_app(
    root: Path,
    *,
    manager: CacheManager | None = None,
    engine_factory: EngineFactory | None = None,
    **config: Any,
) -> tuple[App, LiveServer]:
    """Build the cache (or use ``manager``'s), a runtime over the table engine and the app;
    serve it on loopback. ``engine_factory`` loads the models the pool loads on demand."""
    manager = manager or open_manager(root / "cache")
    checkpoint = make_checkpoint(root / "models" / "tiny", seed=3)
    tokenizer = load_tokenizer(write_demo_checkpoint(root / "demo", size="tiny"))
    prepared = manager.prepare(str(checkpoint), ProfileRequest(max_input_len=256, max_kv_cache_capacity=256))
    engine = TableEngine(vocab_size=tokenizer.vocab_size, capacity=256)
    serving = ModelHandle(
        engine,
        tokenizer,
        ServingOptions(served_model_name=MODEL, max_model_len=256, max_input_len=256, max_batch_size=4),
    )
    runtime = Runtime(prepared, manager.lease(prepared.bundle_id), engine, serving)
    port = free_port()
    cfg = ServeConfig.from_mapping(
        {
            "cache_dir": root / "cache",
            "max_input_len": 256,
            "max_kv_cache_capacity": 256,
            "host": "127.0.0.1",
            "port": port,
            **config,
        }
    )
    app = create_app(cfg, manager, runtime=runtime, engine_factory=engine_factory)
    server = LiveServer(app, port=port).__enter__()
    return App(server.url, port, manager, serving, runtime, checkpoint), server


@contextmanager
def running_app(
    root: Path,
    *,
    manager: CacheManager | None = None,
    engine_factory: EngineFactory | None = None,
    **config: Any,
) -> Iterator[App]:
    """:func:`start_app` for a ``with`` block; the server, runtime and cache close after it."""
    running, server = start_app(root, manager=manager, engine_factory=engine_factory, **config)
    try:
        yield running
    finally:
        server.__exit__(None, None, None)
        running.runtime.close()
        running.manager.close()


@pytest.fixture(scope="module")
def app(tmp_path_factory: pytest.TempPathFactory) -> Iterator[App]:
    """The whole app with default flags."""
    with running_app(tmp_path_factory.mktemp("hardening")) as running:
        yield running
