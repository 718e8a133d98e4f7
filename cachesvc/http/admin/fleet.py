"""Fleet admin routes: ``/admin/nodes``, per-node and fleet-wide desired state.

Thin wrappers: reads from ``manager.fleet`` (the catalog's nodes and desired-state rows),
writes through the manager (``set_desired``, ``clear_desired``). Desired state is only stored
here; each node's own agent (:mod:`cachesvc.fleet`) acts on it.
"""

from __future__ import annotations

from datetime import datetime
from pathlib import Path
from typing import Annotated, Any, Literal, get_args

from litestar import Controller, delete, get, put
from litestar.di import NamedDependency
from litestar.params import Body, PathParameter
from msgspec import Meta, Struct

from cachesvc.cache.checkpoints import check_local_path, check_model_name
from cachesvc.cache.fleet_records import (
    CONVERGENCE_STATES,
    FLEET_DEFAULT,
    ITEM_SOURCES,
    ITEM_STATES,
    NODE_STATES,
    DesiredBundle,
    DesiredSpec,
    DesiredState,
)
from cachesvc.cache.manager import CacheManager
from cachesvc.cache.profiles import ProfileRequest
from cachesvc.cache.registry import parse_ref
from cachesvc.errors import NotFoundError
from cachesvc.http.errors import problem_responses
from cachesvc.http.schemas import BuildRequest, Model, to_body

Manager = NamedDependency[CacheManager]
#: ``--allowed-model-roots`` (provided by the admin router); None: anywhere.
ModelRoots = NamedDependency[tuple[Path, ...] | None]

NodeState = Literal["up", "down"]
ConvergenceState = Literal["none", "converged", "converging", "failed"]
ItemState = Literal["pending", "building", "ready", "pinned", "loaded", "failed"]
ItemSource = Literal["pulled", "built", "cached"]
assert get_args(NodeState) == NODE_STATES
assert get_args(ConvergenceState) == CONVERGENCE_STATES
assert get_args(ItemState) == ITEM_STATES
assert get_args(ItemSource) == ITEM_SOURCES

NodeName = Annotated[
    str,
    PathParameter(
        min_length=1, max_length=255, pattern=r"^[^*/\s][^/\s]*$", description="Node name (--node-name)"
    ),
]
StrictBody = Body(schema_extra={"additionalProperties": False})


class ItemOut(Struct, frozen=True):
    """Progress of one desired item on one node."""

    item: str
    state: ItemState
    bundle_id: str | None
    error: str | None
    #: Where a done bundle came from on the node: pulled (the OCI registry), built or cached.
    source: ItemSource | None = None


class NodeOut(Struct, frozen=True):
    """One node: heartbeat, its cache size and cap, bundles, loaded models, convergence."""

    name: str
    state: NodeState
    started_at: datetime | None
    heartbeat_at: datetime | None
    heartbeat_age_seconds: float | None
    heartbeat_seconds: float | None
    pid: int
    size_bytes: int
    max_size_bytes: int
    bundles: int
    bundles_by_state: dict[str, int]
    loaded_models: list[str]
    leases: int
    convergence: ConvergenceState
    desired_generation: int | None
    items: list[ItemOut]
    #: Bundles this node pulled from the OCI registry, and bundles it built.
    pulled: int = 0
    built: int = 0


class NodeListOut(Struct, frozen=True):
    """Every node of the catalog; ``this_node`` is the one answering."""

    this_node: str
    items: list[NodeOut]


class DesiredBundleIn(BuildRequest, frozen=True, forbid_unknown_fields=True):
    """A model and profile that must be present (``pin``: protect it; ``load``: serve it)."""

    pin: bool = False
    load: bool = False
    #: ``oci://host[:port]/namespace``: each node pulls the bundle from it before building.
    registry: Annotated[str, Meta(min_length=1, max_length=1024)] | None = None


BundleIdText = Annotated[str, Meta(pattern=r"^[0-9a-f]{16}-[0-9a-f]{12}$")]


class DesiredIn(Struct, frozen=True, forbid_unknown_fields=True):
    """Desired state of a node (or of the fleet): bundles present, bundles pinned, a size cap."""

    bundles: Annotated[list[DesiredBundleIn], Meta(max_length=256)] = []
    pin: Annotated[list[BundleIdText], Meta(max_length=1024)] = []
    max_size_bytes: Annotated[int, Meta(ge=0, le=2**62)] | None = None


class DesiredBundleOut(Struct, frozen=True):
    model: Model
    profile: dict[str, Any]
    pin: bool
    load: bool
    registry: str | None = None


class DesiredOut(Struct, frozen=True):
    """A stored desired state; ``node`` is ``*`` for the fleet default."""

    node: str
    generation: int
    updated_at: datetime
    bundles: list[DesiredBundleOut]
    pin: list[str]
    max_size_bytes: int | None


def _spec(manager: CacheManager, data: DesiredIn, roots: tuple[Path, ...] | None) -> DesiredSpec:
    bundles = []
    for b in data.bundles:
        # A hub id is checked for its form; a local path must lie under the allowed roots (it
        # need not exist here: it is a path on each node, and each node checks it before it builds).
        for field, model in (("model", b.model), ("draft_model", b.draft_model)):
            if model is not None and not model.startswith(("/", ".", "~")):
                check_model_name(field, model, roots)
            elif model is not None and roots is not None:
                check_local_path(field, model, roots, what="checkpoint")
        request = ProfileRequest(  # validates like POST /admin/builds
            backend=b.backend,
            precision=b.precision,
            max_input_len=b.max_input_len,
            max_batch_size=b.max_batch_size,
            max_kv_cache_capacity=b.max_kv_cache_capacity,
            speculative_method=b.speculative_method,
            draft_model=b.draft_model,
            task=b.task,
            pooling=b.pooling,
            lora=b.lora,
            kernels=b.kernels,
            kv_cache_dtype=b.kv_cache_dtype,
            max_image_tokens=b.max_image_tokens,
            max_image_tokens_per_image=b.max_image_tokens_per_image,
        )
        profile = {k: getattr(request, k) for k in ProfileRequest.__dataclass_fields__}
        registry = None if b.registry is None else str(parse_ref(b.registry, allow_tag=False))
        bundles.append(
            DesiredBundle(model=b.model, profile=profile, pin=b.pin, load=b.load, registry=registry)
        )
    return DesiredSpec(bundles=tuple(bundles), pin=tuple(data.pin), max_size_bytes=data.max_size_bytes)


def _desired_body(state: DesiredState) -> DesiredOut:
    return to_body(
        {
            "node": state.node,
            "generation": state.generation,
            "updated_at": state.updated_at,
            **state.spec.to_dict(),
        },
        DesiredOut,
    )


class NodeController(Controller):
    """``/admin/nodes``: the fleet's nodes and their desired state."""

    path = "/nodes"
    tags = ["fleet"]

    @get("/", sync_to_thread=True, operation_id="listNodes", responses=problem_responses())
    def list_nodes(self, manager: Manager) -> NodeListOut:
        """Nodes with heartbeat, cache size and cap, bundles, leases, loaded models, convergence."""
        return to_body({"this_node": manager.node, "items": manager.fleet.nodes()}, NodeListOut)

    @get(
        "/{node:str}/desired",
        sync_to_thread=True,
        operation_id="getNodeDesired",
        responses=problem_responses(400, 404),
    )
    def get_desired(self, manager: Manager, node: NodeName) -> DesiredOut:
        """The desired state that applies to ``node`` (its own, else the fleet default)."""
        state = manager.fleet.desired(node)
        if state is None:
            raise NotFoundError(f"no desired state for {node!r} and no fleet default")
        return _desired_body(state)

    @put(
        "/{node:str}/desired",
        sync_to_thread=True,
        operation_id="putNodeDesired",
        responses=problem_responses(400),
    )
    def put_desired(
        self,
        manager: Manager,
        model_roots: ModelRoots,
        node: NodeName,
        data: Annotated[DesiredIn, StrictBody],
    ) -> DesiredOut:
        """Set the desired state of one node; its agent converges on it."""
        return _desired_body(manager.set_desired(node, _spec(manager, data, model_roots)))

    @delete(
        "/{node:str}/desired",
        sync_to_thread=True,
        operation_id="deleteNodeDesired",
        responses=problem_responses(400, 404),
    )
    def delete_desired(self, manager: Manager, node: NodeName) -> None:
        """Forget a node's own desired state (it follows the fleet default again)."""
        manager.clear_desired(node)


class FleetController(Controller):
    """``/admin/fleet/desired``: the default desired state of every node without its own."""

    path = "/fleet"
    tags = ["fleet"]

    @get("/desired", sync_to_thread=True, operation_id="getFleetDesired", responses=problem_responses(404))
    def get_fleet_desired(self, manager: Manager) -> DesiredOut:
        """The fleet-wide default desired state."""
        state = manager.fleet.desired(FLEET_DEFAULT)
        if state is None:
            raise NotFoundError("no fleet-wide desired state is set")
        return _desired_body(state)

    @put("/desired", sync_to_thread=True, operation_id="putFleetDesired", responses=problem_responses(400))
    def put_fleet_desired(
        self, manager: Manager, model_roots: ModelRoots, data: Annotated[DesiredIn, StrictBody]
    ) -> DesiredOut:
        """Set the fleet-wide default desired state."""
        return _desired_body(manager.set_desired(FLEET_DEFAULT, _spec(manager, data, model_roots)))


FLEET_HANDLERS = [NodeController, FleetController]
