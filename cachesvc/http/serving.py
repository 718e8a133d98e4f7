"""What this server serves: ``/admin/engines`` (the engines loaded in it) and ``/admin/models``
(the served names they answer to).

As ``ollama ps`` / ``ollama run --keepalive`` / ``ollama stop``: list the loaded engines with
their names, bundle, memory and expiry; preload one with a keep-alive; unload one (after its
requests finish, up to a grace; ``force=true`` cuts them with an error chunk). Aliases are the
catalog's (``PUT``/``DELETE``/``GET /admin/models``), so every server on the catalog sees them.
Errors go through the admin problem-JSON mapper; pool errors (404 unknown model, 429, 503)
keep their status.
"""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Annotated, Any, Protocol, runtime_checkable

import anyio
from litestar import Controller, Response, Router, delete, get, post, put
from litestar.di import NamedDependency
from litestar.params import Body, PathParameter, QueryParameter
from msgspec import Meta, Struct

from cachesvc.errors import ConfigError, ConflictError, NotFoundError
from cachesvc.http.admin import drop_stale_options_handlers
from cachesvc.http.auth import admin_guard
from cachesvc.http.errors import admin_exception_handlers, problem_responses
from cachesvc.http.schemas import (
    BackendChoice,
    BatchSize,
    KernelsChoice,
    KvCacheDtype,
    Pooling,
    PositiveDim,
    PrecisionChoice,
    SpeculativeMethod,
    Task,
)
from cachesvc.manager import CacheManager
from cachesvc.profiles import PROFILE_FIELDS, ProfileRequest
from cachesvc.records import AdapterInfo
from inference.model_pool import EngineStatus, ModelPool
from inference.serving_errors import ServingError

Manager = NamedDependency[CacheManager]
Pool = NamedDependency[ModelPool]


@runtime_checkable
class LoraLoader(Protocol):
    """What the app provides as ``loras``: the startup model's LoRA adapters (blocking calls)."""

    @property
    def parent(self) -> str: ...

    def load(self, name: str, source: str) -> AdapterInfo: ...

    def unload(self, name: str) -> None: ...


Loras = NamedDependency[LoraLoader | None]


def _loras(loras: LoraLoader | None) -> LoraLoader:
    if loras is None:
        raise ConflictError("this server serves no startup model to load LoRA adapters into",
                            reason="no_lora")
    return loras
ModelName = Annotated[str, PathParameter(min_length=1, max_length=255, description="A served model name")]
KeepAlive = Annotated[float, Meta(ge=-1)]
BundleId = Annotated[str, PathParameter(min_length=1, max_length=64, description="Bundle id")]
StrictBody = Body(schema_extra={"additionalProperties": False})


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


class AliasRequest(Struct, frozen=True, forbid_unknown_fields=True):
    """Point a served name at a bundle id; at a checkpoint (its most recently used ready bundle);
    or at a checkpoint built with a profile (any build-profile field given: that bundle, which
    must be in the catalog; unset fields take the build defaults, as ``POST /admin/builds``)."""

    bundle_id: str | None = None
    model: str | None = None
    backend: BackendChoice | None = None
    precision: PrecisionChoice | None = None
    max_input_len: PositiveDim | None = None
    max_batch_size: BatchSize | None = None
    max_kv_cache_capacity: PositiveDim | None = None
    speculative_method: SpeculativeMethod | None = None
    draft_model: Annotated[str, Meta(min_length=1, max_length=1024)] | None = None
    task: Task | None = None
    pooling: Pooling | None = None
    lora: bool | None = None
    kernels: KernelsChoice | None = None
    kv_cache_dtype: KvCacheDtype | None = None
    max_image_tokens: PositiveDim | None = None
    max_image_tokens_per_image: PositiveDim | None = None

    def profile(self) -> dict[str, Any]:
        """The build-profile fields given (empty: no profile)."""
        return {f: getattr(self, f) for f in PROFILE_FIELDS if getattr(self, f) is not None}


class AliasOut(Struct, frozen=True):
    """One operator-given served name."""

    name: str
    bundle_id: str | None
    model: str | None
    created_at: str


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


def _serving_problem(_: Any, exc: ServingError) -> Response[dict[str, Any]]:
    headers = dict(exc.headers or {})
    return Response(
        {
            "type": "about:blank",
            "title": exc.code or exc.type,
            "status": exc.status_code,
            "detail": exc.message,
        },
        status_code=exc.status_code,
        headers=headers,
        media_type="application/problem+json",
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


class ModelController(Controller):
    """``/admin/models``: served names (aliases in the catalog)."""

    path = "/models"
    tags = ["models"]

    @get("/", sync_to_thread=True, operation_id="listModelAliases")
    def list_aliases(self, manager: Manager) -> list[AliasOut]:
        """Every alias."""
        return [
            AliasOut(name=a.name, bundle_id=a.bundle_id, model=a.model, created_at=a.created_at.isoformat())
            for a in manager.catalog.aliases.all()
        ]

    @put(
        "/{name:str}",
        sync_to_thread=True,
        operation_id="setModelAlias",
        responses=problem_responses(400, 404),
    )
    def set_alias(
        self, manager: Manager, name: ModelName, data: Annotated[AliasRequest, StrictBody]
    ) -> AliasOut:
        """Create or replace an alias (``bundle_id`` or ``model``, exactly one; with ``model``,
        build-profile fields pick one bundle of it)."""
        if (data.bundle_id is None) == (data.model is None):
            raise ConfigError("bundle_id", "give exactly one of bundle_id and model")
        profile = data.profile()
        bundle_id, model = data.bundle_id, data.model
        if profile and model is None:
            raise ConfigError(next(iter(profile)), "build-profile fields go with model, not bundle_id")
        if profile and model is not None:
            bundle_id = manager.catalog_bundle_id(model, ProfileRequest(**profile))
            try:
                manager.catalog.bundles.require(bundle_id)
            except NotFoundError:
                raise NotFoundError(
                    f"{model!r} has no bundle with this profile ({bundle_id}) on this node; build it "
                    "first: POST /admin/builds with the same model and profile fields"
                ) from None
            model = None
        a = manager.set_alias(name, bundle_id=bundle_id, model=model)
        return AliasOut(
            name=a.name, bundle_id=a.bundle_id, model=a.model, created_at=a.created_at.isoformat()
        )

    @delete(
        "/{name:str}", status_code=204, operation_id="removeModelAlias", responses=problem_responses(400, 404)
    )
    async def remove_alias(self, manager: Manager, pool: Pool, name: ModelName) -> None:
        """Delete an alias (loaded engines stop answering it)."""
        await anyio.to_thread.run_sync(manager.remove_alias, name)
        pool.forget_name(name)


_LORA_NAME = r"^[A-Za-z0-9][A-Za-z0-9._:/-]*$"


class LoadLoraRequest(Struct, frozen=True, forbid_unknown_fields=True):
    """vLLM's ``POST /v1/load_lora_adapter``: serve adapter ``lora_path`` (a PEFT directory or hub
    id) as the model name ``lora_name``, on the startup model."""

    lora_name: Annotated[str, Meta(min_length=1, max_length=128, pattern=_LORA_NAME)]
    lora_path: Annotated[str, Meta(min_length=1, max_length=1024)]


class UnloadLoraRequest(Struct, frozen=True, forbid_unknown_fields=True):
    """vLLM's ``POST /v1/unload_lora_adapter``: stop serving ``lora_name``."""

    lora_name: Annotated[str, Meta(min_length=1, max_length=128)]
    lora_int_id: int | None = None  # vLLM's; ignored (names identify adapters here)


class LoraLoadedOut(Struct, frozen=True):
    """An adapter now served: its name, its id in the cache (digest prefix) and rank."""

    lora_name: str
    adapter_id: str
    rank: int
    parent: str


@post("/load_lora_adapter", status_code=200, operation_id="loadLoraAdapter",
      responses=problem_responses(400, 401, 403, 404, 409))
async def load_lora_adapter(loras: Loras, data: Annotated[LoadLoraRequest, StrictBody]) -> LoraLoadedOut:
    """Load a LoRA adapter into the startup model (built with ``--enable-lora``) under a name of
    its own; the adapter is kept in the cache (``/admin/lora-adapters``)."""
    loader = _loras(loras)
    info = await anyio.to_thread.run_sync(loader.load, data.lora_name, data.lora_path)
    return LoraLoadedOut(lora_name=data.lora_name, adapter_id=info.id, rank=info.rank, parent=loader.parent)


@post("/unload_lora_adapter", status_code=200, operation_id="unloadLoraAdapter",
      responses=problem_responses(400, 401, 403, 404, 409))
async def unload_lora_adapter(loras: Loras, pool: Pool,
                              data: Annotated[UnloadLoraRequest, StrictBody]) -> dict[str, str]:
    """Stop serving a LoRA adapter's name (409 while a running request uses it)."""
    loader = _loras(loras)
    pool.forget_name(data.lora_name)  # a loaded model stops answering it at once
    await anyio.to_thread.run_sync(loader.unload, data.lora_name)
    return {"lora_name": data.lora_name, "status": "unloaded"}


def lora_router(*, admin_api_key: str | None) -> Router:
    """vLLM's runtime LoRA routes under ``/v1``, behind the admin key (they change what is served)."""
    router = Router(
        path="/v1",
        route_handlers=[load_lora_adapter, unload_lora_adapter],
        guards=[admin_guard(admin_api_key)],
        exception_handlers=admin_exception_handlers(),
        tags=["admin"],
    )
    drop_stale_options_handlers(router)
    return router


def serving_router(*, admin_api_key: str | None) -> Router:
    """``/admin/engines`` and ``/admin/models`` with the admin guard and error mapping.

    The app provides the ``manager`` and ``pool`` dependencies."""
    handlers = admin_exception_handlers()
    handlers[ServingError] = _serving_problem
    router = Router(
        path="/admin",
        route_handlers=[EngineController, ModelController],
        guards=[admin_guard(admin_api_key)],
        exception_handlers=handlers,
        signature_namespace={"CacheManager": CacheManager, "ModelPool": ModelPool},
    )
    drop_stale_options_handlers(router)
    return router


__all__ = ["lora_router", "serving_router"]
