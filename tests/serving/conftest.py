"""Fixtures for the serving tests: the demo tokenizer, serving options and a live server.

The engines (the only fakes) live in :mod:`tests.support.engines`.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import uvicorn
from litestar import Litestar

from inference.demo import write_demo_checkpoint
from inference.openai import ModelHandle, ServingOptions, openai_router
from inference.serving.model_pool import ModelPool
from inference.serving.tokenizer import Tokenizer, load_tokenizer
from tests.support.apps import one_model_pool
from tests.support.engines import TableEngine, TokenScriptEngine
from tests.support.net import free_port

__all__ = ["MODEL", "LiveServer", "TableEngine", "TokenScriptEngine", "make_app", "make_options", "pool_app"]

MODEL = "demo-tiny"


@pytest.fixture(scope="session")
def demo_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_demo_checkpoint(tmp_path_factory.mktemp("demo") / "ckpt", size="tiny")


@pytest.fixture(scope="session")
def tokenizer(demo_dir: Path) -> Tokenizer:
    return load_tokenizer(demo_dir)


def make_options(**overrides: Any) -> ServingOptions:
    base: dict[str, Any] = {
        "served_model_name": MODEL,
        "max_model_len": 256,
        "max_input_len": 128,
        "max_batch_size": 4,
        "max_queued_requests": 4,
        "queue_timeout": 30.0,
    }
    base.update(overrides)
    return ServingOptions(**base)


def make_app(handle: ModelHandle, *, api_key: str | None = None) -> Litestar:
    """The ``/v1`` routes over a pool of ``handle`` alone."""
    return pool_app(one_model_pool(handle), api_key=api_key)


def pool_app(pool: ModelPool, *, api_key: str | None = None) -> Litestar:
    """The ``/v1`` routes over ``pool``, started and stopped with the app."""
    return Litestar(
        route_handlers=[openai_router(pool, api_key=api_key)],
        on_startup=[pool.start],
        on_shutdown=[pool.stop],
    )


class LiveServer:
    """uvicorn serving the app on a loopback port from a background thread."""

    def __init__(self, app: Litestar, *, port: int | None = None) -> None:
        self.port = port or free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        config = uvicorn.Config(app, host="127.0.0.1", port=self.port, log_level="warning", lifespan="on")
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(target=lambda: asyncio.run(self.server.serve()), daemon=True)

    def __enter__(self) -> LiveServer:
        self.thread.start()
        deadline = time.monotonic() + 10
        while not self.server.started:
            if time.monotonic() > deadline or not self.thread.is_alive():
                raise RuntimeError("uvicorn did not start")
            time.sleep(0.02)
        return self

    def __exit__(self, *exc: object) -> None:
        self.server.should_exit = True
        self.thread.join(10)


@pytest.fixture
def live_server() -> Iterator[type[LiveServer]]:
    yield LiveServer


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"
