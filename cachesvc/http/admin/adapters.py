"""``/admin/lora-adapters``: LoRA adapters converted into the cache (rows, pins, removal)."""

from __future__ import annotations

from typing import Annotated

from litestar import Controller, delete, get, post
from litestar.params import PathParameter

from cachesvc.http.admin.params import Manager, ModelRoots, StrictBody
from cachesvc.http.errors import problem_responses
from cachesvc.http.schemas import AdapterListOut, AdapterOut, AdapterRemovalOut, AdapterRequest, to_body

AdapterId = Annotated[
    str,
    PathParameter(pattern=r"^[0-9a-f]{16}$", description="Adapter id: the first 16 hex digits of its digest"),
]


class AdapterController(Controller):
    """``/admin/lora-adapters``: LoRA adapters converted into the cache (rows, pins, removal)."""

    path = "/lora-adapters"
    tags = ["lora-adapters"]

    @get("/", sync_to_thread=True, operation_id="listLoraAdapters", responses=problem_responses())
    def list_adapters(self, manager: Manager) -> AdapterListOut:
        """This node's converted adapters, most recently used first."""
        return to_body({"items": manager.adapters.list()}, AdapterListOut)

    @post(
        "/",
        status_code=201,
        sync_to_thread=True,
        operation_id="addLoraAdapter",
        responses=problem_responses(400, 404, 409, 415, 502),
    )
    def add_adapter(
        self, manager: Manager, model_roots: ModelRoots, data: Annotated[AdapterRequest, StrictBody]
    ) -> AdapterOut:
        """Convert a PEFT adapter (directory or hub id) for the ``base`` model, once per adapter
        digest (an adapter already converted is returned as it is); 400 for what is not a PEFT
        LoRA adapter or does not fit the base model; 404 when ``base`` is not a checkpoint in the
        catalog (build it first: POST /admin/builds)."""
        info = manager.add_adapter(data.source, data.base, allowed_roots=model_roots, known_base=True)
        return to_body(info, AdapterOut)

    @delete(
        "/{adapter_id:str}",
        status_code=200,
        sync_to_thread=True,
        operation_id="removeLoraAdapter",
        responses=problem_responses(400, 404, 409),
    )
    def remove_adapter(self, manager: Manager, adapter_id: AdapterId) -> AdapterRemovalOut:
        """Remove an adapter (row and converted file); 409 while it is pinned or in use."""
        return AdapterRemovalOut(id=adapter_id, freed_bytes=manager.adapters.remove(adapter_id))

    @post(
        "/{adapter_id:str}/pin",
        status_code=200,
        sync_to_thread=True,
        operation_id="pinLoraAdapter",
        responses=problem_responses(400, 404),
    )
    def pin_adapter(self, manager: Manager, adapter_id: AdapterId) -> AdapterOut:
        """Protect an adapter from eviction."""
        return to_body(manager.adapters.set_pinned(adapter_id, True), AdapterOut)

    @post(
        "/{adapter_id:str}/unpin",
        status_code=200,
        sync_to_thread=True,
        operation_id="unpinLoraAdapter",
        responses=problem_responses(400, 404),
    )
    def unpin_adapter(self, manager: Manager, adapter_id: AdapterId) -> AdapterOut:
        """Let an adapter be evicted again."""
        return to_body(manager.adapters.set_pinned(adapter_id, False), AdapterOut)
