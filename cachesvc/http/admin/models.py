"""``/admin/models``: the served names (aliases) in the catalog.

Aliases are the catalog's (``PUT``/``DELETE``/``GET /admin/models``), so every server on the
catalog sees them.
"""

from __future__ import annotations

from typing import Annotated, Any

import anyio
from litestar import Controller, delete, get, put
from litestar.params import PathParameter
from msgspec import Meta, Struct

from cachesvc.cache.profiles import PROFILE_FIELDS, ProfileRequest
from cachesvc.errors import ConfigError, NotFoundError
from cachesvc.http.admin.params import Manager, Pool, StrictBody
from cachesvc.http.errors import problem_responses
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

ModelName = Annotated[str, PathParameter(min_length=1, max_length=255, description="A served model name")]


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
