"""``/admin/checkpoints``: the resolved checkpoints; remove one."""

from __future__ import annotations

from typing import Annotated

from litestar import delete, get
from litestar.params import PathParameter, QueryParameter

from cachesvc.http.admin.params import Manager
from cachesvc.http.errors import problem_responses
from cachesvc.http.schemas import CheckpointListOut, CheckpointRemovalOut, to_body


@get(
    "/checkpoints",
    sync_to_thread=True,
    operation_id="listCheckpoints",
    tags=["checkpoints"],
    responses=problem_responses(),
)
def list_checkpoints(manager: Manager) -> CheckpointListOut:
    """Resolved checkpoints with digest, size and the bundles built from them."""
    return to_body({"items": manager.catalog.checkpoints.all()}, CheckpointListOut)


CheckpointId = Annotated[
    str,
    PathParameter(
        min_length=1, max_length=128, description="Checkpoint digest, or its first 8 or more characters"
    ),
]


@delete(
    "/checkpoints/{checkpoint_id:str}",
    status_code=200,
    sync_to_thread=True,
    operation_id="removeCheckpoint",
    tags=["checkpoints"],
    responses=problem_responses(400, 404, 409),
)
def remove_checkpoint(
    manager: Manager,
    checkpoint_id: CheckpointId,
    with_bundles: Annotated[
        bool, QueryParameter(description="also remove this node's idle bundles built from it")
    ] = False,
) -> CheckpointRemovalOut:
    """Remove a checkpoint: its catalog row, and its files when the cache downloaded or converted
    them (a local directory outside the cache is only forgotten). 409 while a bundle of it is
    leased or pinned, when it has bundles and ``with_bundles`` is not true, or when other nodes
    hold bundles of it; 404 for an unknown id."""
    done = manager.remove_checkpoint(checkpoint_id, with_bundles=with_bundles, by_path=False)
    return to_body(done, CheckpointRemovalOut)
