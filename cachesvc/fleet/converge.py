"""Converge one node's own disk on its desired state.

Builds missing bundles, pins what the state asks to pin, loads what it asks to load (through
the serving process's model pool, a ``load_model`` callable) and evicts down to the desired cap,
through this node's :class:`CacheManager` only: every operation it uses is scoped to this
node's catalog rows and cache directory, so it never touches another node's files. Progress
and failures are reported per item; a failed item is retried when the desired state changes
(a new generation), not on every pass, so a broken model does not rebuild in a loop.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

from cachesvc.cache.checkpoints import check_model_name
from cachesvc.cache.fleet_records import DONE_ITEM_STATES, DesiredBundle, DesiredState, ItemStatus
from cachesvc.cache.manager import CacheManager
from cachesvc.cache.profiles import ProfileRequest
from cachesvc.errors import CacheError, NotFoundError, RegistryError

log = logging.getLogger("cachesvc.fleet")


def item_name(bundle: DesiredBundle) -> str:
    """A stable, readable name of a desired bundle: the model and its non-default options."""
    options = ",".join(f"{k}={v}" for k, v in sorted(bundle.profile.items()) if v is not None)
    return f"{bundle.model}[{options}]" if options else bundle.model


class Converger:
    """One pass at a time: read the desired state, act on this node, publish a status dict."""

    def __init__(
        self,
        manager: CacheManager,
        *,
        on_status: Callable[[dict[str, Any] | None], None],
        allowed_roots: tuple[Path, ...] | None = None,
        load_model: Callable[[str], None] | None = None,
    ) -> None:
        self.manager = manager
        #: Loads a bundle id into this node's model pool and keeps it loaded (None: this process
        #: serves no models, so ``load: true`` items fail with that reason).
        self.load_model = load_model
        self.allowed_roots = allowed_roots
        self._on_status = on_status
        self._failed: dict[str, tuple[int, str]] = {}  # item -> (generation, error)
        self._last: tuple[int, dict[str, ItemStatus]] = (0, {})  # the last pass's result
        self._lock = threading.Lock()

    def run_once(self) -> dict[str, Any] | None:
        """Converge on the current desired state; the status reported (None: nothing desired)."""
        with self._lock:
            desired = self.manager.fleet.desired(self.manager.node)
            if desired is None:
                self._on_status(None)
                return None
            return self._converge(desired)

    def _converge(self, desired: DesiredState) -> dict[str, Any]:
        spec, generation = desired.spec, desired.generation
        # A periodic pass over a converged node must not flap to "converging": items keep the
        # state of the last pass of the same generation until this pass changes them.
        last = self._last[1] if self._last[0] == generation else {}
        names = [item_name(b) for b in spec.bundles] + [f"pin:{bid}" for bid in spec.pin]
        items: list[ItemStatus] = [last.get(n) or ItemStatus(n, "pending") for n in names]

        def report() -> dict[str, Any]:
            status = _status(generation, items)
            self._on_status(status)
            return status

        keep: set[str] = set()
        for index, bundle in enumerate(spec.bundles):
            name = item_name(bundle)
            failed = self._failed.get(name)
            if failed is not None and failed[0] == generation:
                items[index] = ItemStatus(name, "failed", error=failed[1])
                continue
            if items[index].state not in DONE_ITEM_STATES:
                items[index] = ItemStatus(name, "building")
                report()
            try:
                # This node's --allowed-model-roots, as POST /admin/builds on this node would.
                for field in ("model", "draft_model"):
                    value = bundle.model if field == "model" else bundle.profile.get("draft_model")
                    if value is not None:
                        check_model_name(field, str(value), self.allowed_roots)
                bundle_id, source = self._obtain(bundle)
                if bundle.pin:
                    self.manager.set_pinned(bundle_id, True)
            except (CacheError, ValueError, TypeError) as exc:
                error = str(exc) or type(exc).__name__
                log.warning("desired %s failed on %s: %s", name, self.manager.node, error)
                self._failed[name] = (generation, error)
                items[index] = ItemStatus(name, "failed", error=error)
                continue
            keep.add(bundle_id)
            items[index] = ItemStatus(
                name, "pinned" if bundle.pin else "ready", bundle_id=bundle_id, source=source
            )
            if bundle.load:
                items[index] = replace(self._load(name, bundle_id), source=source)
        offset = len(spec.bundles)
        for index, bid in enumerate(spec.pin):
            try:
                self.manager.set_pinned(bid, True)
            except NotFoundError:
                items[offset + index] = ItemStatus(
                    f"pin:{bid}", "failed", bundle_id=bid, error="no such bundle on this node"
                )
                continue
            keep.add(bid)
            items[offset + index] = ItemStatus(f"pin:{bid}", "pinned", bundle_id=bid)
        if spec.max_size_bytes is not None:
            # This node's rows and this node's disk only (the evictor is scoped to its node).
            result_prune = self.manager.evictor.prune(spec.max_size_bytes, exclude=frozenset(keep))
            if result_prune.total_after > spec.max_size_bytes:
                items.append(
                    ItemStatus(
                        "max_size_bytes",
                        "failed",
                        error=f"{result_prune.total_after} bytes remain above the cap of "
                        f"{spec.max_size_bytes} (pinned, leased or desired bundles)",
                    )
                )
            else:
                items.append(ItemStatus("max_size_bytes", "ready"))
        self._last = (generation, {i.item: i for i in items})
        return report()

    def _obtain(self, bundle: DesiredBundle) -> tuple[str, str]:
        """The bundle id of a desired bundle, present on this node, and where it came from
        (``pulled``, ``built``, or ``cached`` when the event log no longer says): pulled from
        the item's registry when it names one (a registry that has none, is down or sends
        something refused: one log line, then the node's own prepare), else prepared (a hit, a
        pull from ``--registry``, or a build)."""
        request = ProfileRequest(**bundle.profile)
        if bundle.registry is not None:
            try:
                bid = self.manager.pull(bundle.model, request, ref=bundle.registry).bundle_id
                return bid, self.manager.queries.bundle_source(bid) or "cached"
            except RegistryError as exc:
                log.warning(
                    "desired %s: not pulled from %s (%s); preparing it here",
                    item_name(bundle),
                    bundle.registry,
                    exc,
                )
        bid = self.manager.prepare(bundle.model, request).bundle_id
        # A later pass finds it in the cache: it still says how it got here (the event log).
        return bid, self.manager.queries.bundle_source(bid) or "cached"

    def _load(self, name: str, bundle_id: str) -> ItemStatus:
        """Make the model pool hold ``bundle_id``. A failure (memory budget, a model that cannot
        load) is reported but not remembered: the next pass tries again, as memory may free up."""
        if self.load_model is None:
            return ItemStatus(name, "failed", bundle_id=bundle_id, error="this process serves no models")
        try:
            self.load_model(bundle_id)
        except Exception as exc:  # the pool's errors (HTTP-shaped, engine load) have no common base
            error = f"built but not loaded: {exc or type(exc).__name__}"
            log.warning("desired %s on %s: %s", name, self.manager.node, error)
            return ItemStatus(name, "failed", bundle_id=bundle_id, error=error)
        return ItemStatus(name, "loaded", bundle_id=bundle_id)


def _status(generation: int, items: list[ItemStatus]) -> dict[str, Any]:
    states = {i.state for i in items}
    if "failed" in states:
        state = "failed"
    elif states <= set(DONE_ITEM_STATES):
        state = "converged"
    else:
        state = "converging"
    return {
        "generation": generation,
        "state": state,
        "items": [
            {"item": i.item, "state": i.state, "bundle_id": i.bundle_id, "error": i.error, "source": i.source}
            for i in items
        ],
    }
