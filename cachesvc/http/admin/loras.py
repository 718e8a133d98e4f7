"""vLLM's runtime LoRA routes (``POST /v1/load_lora_adapter``, ``/v1/unload_lora_adapter``): serve
an adapter on the startup model under a name of its own, or stop serving it."""

from __future__ import annotations

from typing import Annotated, Protocol, runtime_checkable

import anyio
from litestar import post
from litestar.di import NamedDependency
from msgspec import Meta, Struct

from cachesvc.cache.records import AdapterInfo
from cachesvc.errors import ConflictError
from cachesvc.http.admin.params import Pool, StrictBody
from cachesvc.http.errors import problem_responses


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
