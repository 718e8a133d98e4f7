"""The service's real app (``cachesvc.app.create_app``) for in-process tests.

Tests build the app the way ``cachesvc serve`` does, so a wiring mistake in ``create_app``
(a key not passed to the admin guard, metrics not mounted) fails them. Litestar's TestClient
reports every client as ``testclient``; :func:`set_peer` puts the address a real server would
take from the socket into the scope, so the loopback rule of the admin guard can be tested.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from litestar import Litestar
from litestar.types import ASGIApp, Receive, Scope, Send

from cachesvc.app import create_app
from cachesvc.config import ServeConfig
from cachesvc.http.metrics import MetricsState
from cachesvc.manager import CacheManager

LOOPBACK = "127.0.0.1"
#: Base URL for TestClient: a Host the app allows by default (loopback names and the bind address).
LOOPBACK_URL = f"http://{LOOPBACK}"


def set_peer(app: Litestar, host: str) -> Litestar:
    """Make every HTTP request reach ``app`` from ``host`` (what uvicorn fills from the socket)."""
    inner: ASGIApp = app.asgi_handler

    async def with_peer(scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] in ("http", "websocket"):
            scope["client"] = (host, 50000)
        await inner(scope, receive, send)

    app.asgi_handler = with_peer
    return app


def service_app(
    manager: CacheManager, *, peer: str = LOOPBACK, **config: Any
) -> tuple[Litestar, MetricsState]:
    """``create_app`` over ``manager`` with launch options ``config`` (no engine loaded)."""
    options = {"cache_dir": Path(manager.layout.root), **config}
    metrics = MetricsState(manager.queries)
    app = create_app(ServeConfig.from_mapping(options), manager, metrics=metrics)
    return set_peer(app, peer), metrics
