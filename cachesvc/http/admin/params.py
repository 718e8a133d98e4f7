"""What the admin routes share: the dependencies they name, their path and query parameters, the
strict request body."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

from litestar.di import NamedDependency
from litestar.params import Body, PathParameter, QueryParameter

from cachesvc.cache.manager import CacheManager
from inference.serving.model_pool import ModelPool

Manager = NamedDependency[CacheManager]
#: This server's model pool (engines loaded here); ``unload_idle`` unloads through it.
Pool = NamedDependency[ModelPool]
#: Where local checkpoints named over HTTP may lie (``--allowed-model-roots``); None: anywhere.
ModelRoots = NamedDependency[tuple[Path, ...] | None]

BUNDLE_ID_PATTERN = r"^[0-9a-f]{16}-[0-9a-f]{12}$"
BundleId = Annotated[
    str,
    PathParameter(
        pattern=BUNDLE_ID_PATTERN,
        description="Bundle id: <model-digest16>-<profile-digest12> (lowercase hex)",
    ),
]
Limit = Annotated[int, QueryParameter(ge=1, le=1000, description="Page size (1-1000)")]
NodeFilter = Annotated[
    str | None, QueryParameter(min_length=1, max_length=255, description="Only this node's rows (fleet)")
]
#: The request Structs forbid unknown fields (a typo such as ``dryrun`` must not turn a dry run
#: into a real clear); say so in the schema, which Litestar does not derive from the Struct.
StrictBody = Body(schema_extra={"additionalProperties": False})
