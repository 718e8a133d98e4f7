"""What the model pool (:mod:`inference.serving.model_pool`) knows of its models and its owner: a name
resolved to a bundle (:class:`ModelRef`), the :class:`ModelSource` its owner implements (names,
leases, events), the observer of loads and unloads, what it needs of a loaded model's handle and
the server-wide limits it keeps."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

from inference.serving.engine_client import EngineClient


@dataclass(frozen=True)
class ModelRef:
    """A servable name resolved to one built bundle."""

    name: str
    bundle_id: str
    bundle_dir: Path
    backend: str = ""
    precision: str = ""
    max_model_len: int = 0
    #: Estimated bytes once loaded (weights + KV capacity x slots + the context-reuse record
    #: pool's limit).
    memory_bytes: int = 0
    #: Of ``memory_bytes``: the context-reuse record pool's limit (0 without context reuse).
    context_bytes: int = 0
    #: Every name this bundle answers to (display only).
    names: tuple[str, ...] = ()
    #: The draft bundle a ``draft_model`` speculative bundle loads next to it.
    draft_bundle_dir: Path | None = None
    #: For a LoRA adapter's name: the served name of the base model it runs on.
    parent: str | None = None
    #: The bundle takes images (a vision-language bundle: engine.json ``vision``).
    images: bool = False


class Releasable(Protocol):
    """A held resource (the bundle's cross-process lease)."""

    def release(self) -> None:
        """Give it back (idempotent)."""
        ...


class ModelSource(Protocol):
    """What the pool needs from the cache; implemented on the service side."""

    def resolve(self, name: str) -> ModelRef:
        """The bundle ``name`` means; :class:`ModelNotFoundError` (404) when none."""
        ...

    def servable(self) -> list[ModelRef]:
        """Every name that resolves to a ready bundle."""
        ...

    def lease(self, bundle_id: str) -> Releasable:
        """Take the bundle's lease (blocks its eviction by any process)."""
        ...

    def record(self, kind: str, bundle_id: str, detail: Mapping[str, Any]) -> None:
        """Write a ``load``/``unload`` event to the audit log."""
        ...

    def public_name(self, name: str) -> str:
        """How ``name`` (a spelling that resolved) is shown where no key is asked (``/health``):
        as ``servable`` lists it, never as a server path. No catalog access."""
        ...


class PoolObserver(Protocol):
    """Metrics hooks, called on the event loop."""

    def model_loaded(self, model: str, seconds: float, loaded: int) -> None: ...

    def model_unloaded(self, model: str, reason: str, loaded: int) -> None: ...


class PooledModel(Protocol):
    """What the pool needs of a loaded model's handle."""

    @property
    def client(self) -> EngineClient:
        """The model's engine client: the pool starts, drains, stops and closes it."""
        ...

    def health(self) -> dict[str, Any]:
        """The model's ``/health`` view (``status``, ``active_requests``, ``queued_requests``, ...)."""
        ...


@dataclass(frozen=True)
class PoolLimits:
    """Server-wide limits (``--max-loaded-models``, ``--memory-budget-gb``, ``--keep-alive``,
    ``--queue-timeout``)."""

    max_loaded: int = 3
    memory_budget: int = 0  # bytes; 0 = no budget
    keep_alive: float = 300.0
    queue_timeout: float = 600.0
    unload_grace: float = 30.0
    #: Requests waiting for a slot over all loaded models (``--max-queued-requests``); None: only
    #: each model's own scheduler limits its queue.
    max_queued: int | None = None
