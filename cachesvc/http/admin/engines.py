"""``/admin/engines``: the engines loaded in this server.

As ``ollama ps`` / ``ollama run --keepalive`` / ``ollama stop``: list the loaded engines with
their names, bundle, memory and expiry; preload one with a keep-alive; unload one (after its
requests finish, up to a grace; ``force=true`` cuts them with an error chunk). Pool errors (404
unknown model, 429, 503) keep their status (``router.serving_router``).
"""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Annotated

from litestar import Controller, delete, get, post
from litestar.params import PathParameter, QueryParameter
from msgspec import Meta, Struct

from cachesvc.errors import ConflictError, NotFoundError
from cachesvc.http.admin.params import Pool, StrictBody
from cachesvc.http.errors import problem_responses
from inference.serving.model_pool import EngineStatus

KeepAlive = Annotated[float, Meta(ge=-1)]
BundleId = Annotated[str, PathParameter(min_length=1, max_length=64, description="Bundle id")]


class EngineOut(Struct, frozen=True):
    """One loaded engine."""

    bundle_id: str
    names: list[str]
    backend: str
    precision: str
    device: str
    memory_bytes: int
    loaded_at: str
    last_used_at: str
    expires_at: str | None
    keep_alive: float
    active_requests: int
    queued_requests: int


class EngineList(Struct, frozen=True):
    """``GET /admin/engines``."""

    engines: list[EngineOut]
    loaded: int
    max_loaded_models: int
    memory_budget_bytes: int
    memory_bytes: int


class PreloadRequest(Struct, frozen=True, forbid_unknown_fields=True):
    """Load ``model`` now; it stays ``keep_alive`` seconds after its last request (-1 forever)."""

    model: Annotated[str, Meta(min_length=1, max_length=1024)]
    keep_alive: KeepAlive | None = None


class UnloadOut(Struct, frozen=True):
    """``DELETE /admin/engines/{bundle_id}``."""

    bundle_id: str
    unloaded: bool


def _iso(ts: float | None) -> str | None:
    return None if ts is None else datetime.fromtimestamp(ts, UTC).isoformat()


def _engine(s: EngineStatus) -> EngineOut:
    return EngineOut(
        bundle_id=s.bundle_id,
        names=list(s.names),
        backend=s.backend,
        precision=s.precision,
        device=s.device,
        memory_bytes=s.memory_bytes,
        loaded_at=str(_iso(s.loaded_at)),
        last_used_at=str(_iso(s.last_used)),
        expires_at=_iso(s.expires_at),
        keep_alive=s.keep_alive,
        active_requests=s.active_requests,
        queued_requests=s.queued_requests,
    )


class EngineController(Controller):
    """``/admin/engines``: loaded engines of this server."""

    path = "/engines"
    tags = ["engines"]

    @get("/", sync_to_thread=False, operation_id="listEngines")
    def list_engines(self, pool: Pool) -> EngineList:
        """Loaded engines, most recently used first."""
        engines = pool.engines()
        return EngineList(
            engines=[_engine(e) for e in engines],
            loaded=len(engines),
            max_loaded_models=pool.limits.max_loaded,
            memory_budget_bytes=pool.limits.memory_budget,
            memory_bytes=sum(e.memory_bytes for e in engines),
        )

    @post(
        "/",
        status_code=200,
        operation_id="preloadEngine",
        responses=problem_responses(400, 404, 415, 429, 503),
    )
    async def preload(self, pool: Pool, data: Annotated[PreloadRequest, StrictBody]) -> EngineOut:
        """Load a model now (no-op when loaded) and set its keep-alive."""
        return _engine(await pool.preload(data.model, keep_alive=data.keep_alive))

    @delete(
        "/{bundle_id:str}",
        status_code=200,
        operation_id="unloadEngine",
        responses=problem_responses(400, 404, 409),
    )
    async def unload(
        self,
        pool: Pool,
        bundle_id: BundleId,
        force: Annotated[
            bool, QueryParameter(description="cancel in-flight requests after the grace")
        ] = False,
        grace: Annotated[
            float | None, QueryParameter(ge=0, le=3600, description="seconds to wait for in-flight requests")
        ] = None,
    ) -> UnloadOut:
        """Unload an engine once its requests finish (up to ``grace``); ``force`` then cancels them."""
        if pool.find(bundle_id) is None:
            raise NotFoundError(f"no engine of bundle {bundle_id} is loaded in this server")
        ok = await pool.unload(bundle_id, reason="admin", grace=grace, force=force)
        if not ok:
            raise ConflictError(
                f"the engine of {bundle_id} still has requests in flight after the grace period; "
                "retry, or add ?force=true to cancel them",
                reason="busy",
            )
        return UnloadOut(bundle_id=bundle_id, unloaded=True)
