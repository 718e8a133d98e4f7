"""Value objects of the fleet: nodes, desired state and the reconciler's report.

The vocabulary lives here (``NODE_STATES``, ``CONVERGENCE_STATES``, ``ITEM_STATES``); the HTTP
schema ``Literal``s and the CLI derive from it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

#: A node is ``up`` while its heartbeat is fresher than the staleness limit, else ``down``.
NODE_STATES = ("up", "down")
#: Per node: nothing desired, every item done, still working, or some item failed.
CONVERGENCE_STATES = ("none", "converged", "converging", "failed")
#: Per desired item.
ITEM_STATES = ("pending", "building", "ready", "pinned", "loaded", "failed")
#: Item states that count as done (converged).
DONE_ITEM_STATES = ("ready", "pinned", "loaded")
#: Where a desired bundle came from on a node.
ITEM_SOURCES = ("pulled", "built", "cached")
#: The desired-state row that applies to every node without one of its own.
FLEET_DEFAULT = "*"
#: A node whose heartbeat is older than this many heartbeat intervals is down.
STALE_INTERVALS = 3


@dataclass(frozen=True)
class DesiredBundle:
    """A model and build profile that must be present on a node (optionally loaded, pinned)."""

    model: str
    profile: dict[str, Any] = field(default_factory=dict)
    pin: bool = False
    load: bool = False
    #: ``oci://host[:port]/namespace``: pull the bundle from this registry before building it.
    registry: str | None = None


@dataclass(frozen=True)
class DesiredSpec:
    """What a node should hold: bundles to build, bundle ids to pin, and a size cap."""

    bundles: tuple[DesiredBundle, ...] = ()
    pin: tuple[str, ...] = ()
    max_size_bytes: int | None = None

    def to_dict(self) -> dict[str, Any]:
        """JSON form stored in the catalog."""
        return {
            "bundles": [
                {"model": b.model, "profile": dict(b.profile), "pin": b.pin, "load": b.load,
                 "registry": b.registry}
                for b in self.bundles
            ],
            "pin": list(self.pin),
            "max_size_bytes": self.max_size_bytes,
        }

    @classmethod
    def from_dict(cls, raw: dict[str, Any]) -> DesiredSpec:
        """Inverse of :meth:`to_dict`."""
        return cls(
            bundles=tuple(
                DesiredBundle(
                    model=str(b["model"]),
                    profile=dict(b.get("profile") or {}),
                    pin=bool(b.get("pin", False)),
                    load=bool(b.get("load", False)),
                    registry=b.get("registry"),
                )
                for b in raw.get("bundles", ())
            ),
            pin=tuple(str(p) for p in raw.get("pin", ())),
            max_size_bytes=raw.get("max_size_bytes"),
        )


@dataclass(frozen=True)
class DesiredState:
    """A stored desired state: for ``node`` (or ``*``), its generation and when it was set."""

    node: str
    spec: DesiredSpec
    generation: int
    updated_at: datetime


@dataclass(frozen=True)
class ItemStatus:
    """Progress of one desired item on one node."""

    item: str
    state: str
    bundle_id: str | None = None
    error: str | None = None
    #: Where a done bundle came from: ``pulled`` (the OCI registry), ``built`` or ``cached``.
    source: str | None = None


@dataclass(frozen=True)
class NodeInfo:
    """One node of the fleet as the catalog knows it."""

    name: str
    state: str
    started_at: datetime | None
    heartbeat_at: datetime | None
    heartbeat_age_seconds: float | None
    heartbeat_seconds: float | None
    pid: int
    size_bytes: int
    max_size_bytes: int
    bundles: int
    bundles_by_state: dict[str, int]
    loaded_models: tuple[str, ...]
    leases: int
    convergence: str
    desired_generation: int | None
    items: tuple[ItemStatus, ...]
    #: Bundles this node pulled from the OCI registry, and bundles it built (catalog events).
    pulled: int = 0
    built: int = 0
