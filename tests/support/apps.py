"""The service's real app (``cachesvc.serving.app.create_app``) for in-process tests, and the model
pool of a serving-only app.

Tests build the app the way ``cachesvc serve`` does, so a wiring mistake in ``create_app``
(a key not passed to the admin guard, metrics not mounted) fails them. Litestar's TestClient
reports every client as ``testclient``; :func:`set_peer` puts the address a real server would
take from the socket into the scope, so the loopback rule of the admin guard can be tested.

The serving tests need no catalog: :func:`one_model_pool` puts one handle (over a scripted
engine from :mod:`tests.support.engines`) in a real :class:`~inference.serving.model_pool.ModelPool`,
the only model source the routes take.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

from litestar import Litestar
from litestar.types import ASGIApp, Receive, Scope, Send

from cachesvc.cache.manager import CacheManager
from cachesvc.http.metrics import MetricsState
from cachesvc.serving.app import create_app
from cachesvc.settings.config import ServeConfig
from inference.openai.handle import ModelHandle
from inference.serving.model_pool import ModelPool, ModelRef, PoolLimits, not_found

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


class OneModel:
    """A :class:`~inference.serving.model_pool.ModelSource` of one model, already loaded: its served name
    resolves (every other name is 404 ``model_not_found``), nothing is leased or recorded."""

    def __init__(self, handle: ModelHandle) -> None:
        name = handle.options.served_model_name
        self.ref = ModelRef(
            name=name,
            bundle_id=name,
            bundle_dir=Path("."),
            max_model_len=handle.options.max_model_len,
            names=(name,),
        )

    def resolve(self, name: str) -> ModelRef:
        if name != self.ref.name:
            raise not_found(name, [self.ref.name])
        return self.ref

    def servable(self) -> list[ModelRef]:
        return [self.ref]

    def lease(self, bundle_id: str) -> _NoLease:
        return _NoLease()

    def record(self, kind: str, bundle_id: str, detail: Mapping[str, Any]) -> None:
        return None

    def public_name(self, name: str) -> str:
        return name


class _NoLease:
    """The lease of a model with no bundle on disk: nothing to release."""

    def release(self) -> None:
        return None


def _no_loads(ref: ModelRef) -> ModelHandle:
    raise AssertionError(f"a one-model pool never loads a model (asked for {ref.name!r})")


def one_model_pool(handle: ModelHandle) -> ModelPool:
    """A pool serving ``handle`` alone (kept loaded; it is the default model of ``/tokenize``);
    ``await pool.start()`` starts it."""
    source = OneModel(handle)
    pool = ModelPool(source, _no_loads, PoolLimits(keep_alive=-1))
    pool.adopt(source.ref, handle, _NoLease(), keep_alive=-1)
    pool.primary = source.ref.name
    return pool
