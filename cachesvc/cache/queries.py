"""CacheQueries: the read-only views of the cache (``manager.queries``) that the admin API, the
CLI, serving and the fleet agent show, where a view is more than one catalog read: bundle
listings (checked filters), details, draft bundles, checkpoint lookup, stats, lease holders.
Plain records come from the catalog's tables through the manager (``manager.catalog.bundles
.require(id)``, ``.aliases.all()``, ``.checkpoints.all()``, ``.events.recent(...)``,
``.events.version()``); ``node`` and ``catalog_state`` stay here as the metrics'
``StatsSource``.

Nothing here writes the catalog or the disk; every write goes through
:class:`cachesvc.cache.manager.CacheManager` and its sections.
"""

from __future__ import annotations

import os
import re
import socket
import threading
from dataclasses import replace
from pathlib import Path
from typing import Any

from cachesvc.cache.catalog import Catalog
from cachesvc.cache.catalog.fleet import FleetCatalog
from cachesvc.cache.model_names import model_labels
from cachesvc.cache.profiles import BuildOptions, BundleKey
from cachesvc.cache.records import (
    BUNDLE_STATES,
    BundleDetail,
    BundleInfo,
    BundlePage,
    CacheStats,
    CatalogState,
    CheckpointInfo,
    LeaseHolder,
)
from cachesvc.cache.store import BundleStore, dir_size, read_manifest
from cachesvc.errors import ConfigError, CorruptBundleError, NotFoundError
from inference.build_profile import METHODS_WITH_DRAFT_BUNDLE


class CacheQueries:
    """Read-only queries over one catalog and one store (one node's cache)."""

    def __init__(
        self, catalog: Catalog, store: BundleStore, fleet: FleetCatalog, *, max_size_bytes: int
    ) -> None:
        self.catalog = catalog
        self.store = store
        self.layout = store.layout
        self.fleet = fleet
        self.max_size_bytes = max_size_bytes
        self._stats_lock = threading.Lock()
        self._stats_cache: tuple[tuple[int, int, int, str], CacheStats] | None = None

    @property
    def node(self) -> str:
        """This process's node name."""
        return self.catalog.node

    def holders(self, bid: str) -> list[LeaseHolder]:
        """Live lease holders of a bundle: this host's from the lock files, other nodes' from the catalog."""
        local = [
            LeaseHolder(pid=int(h["pid"]), host=str(h["host"]), since=str(h["since"]))
            for h in self.store.locks.holders(bid)
        ]
        here = {self.catalog.node, socket.gethostname()}
        remote = [h for h in self.catalog.leases.holders(bid) if h.host not in here]
        return local + remote

    def draft_bundle(self, info: BundleInfo) -> BundleInfo | None:
        """The draft checkpoint's own bundle that ``info`` speculates with (``draft_model``), when
        it is ready on this node; None for bundles without one or when it is missing."""
        profile = dict(info.profile)
        if profile.get("speculative_method") not in METHODS_WITH_DRAFT_BUNDLE or not info.draft_digest:
            return None
        options = BuildOptions(**{**profile, "speculative_method": None, "draft_digest": None})
        draft = self.catalog.bundles.get(BundleKey.of(info.draft_digest, options).id)
        return draft if draft is not None and draft.state == "ready" else None

    def bundle_dir(self, info: BundleInfo) -> Path:
        """Absolute directory of a bundle."""
        return self.layout.root / info.path

    def bundle_detail(self, bid: str, *, events: int = 20) -> BundleDetail:
        """A bundle with its manifest summary, files, lease holders and recent events."""
        info = self.catalog.bundles.require(bid)
        manifest: dict[str, Any] | None = None
        files: tuple[dict[str, Any], ...] = ()
        try:
            m = read_manifest(self.bundle_dir(info))
        except CorruptBundleError:
            m = None
        if m is not None:
            manifest = {
                "layout_version": m.layout_version,
                "bundle_id": m.bundle_id,
                "checkpoint_digest": m.checkpoint_digest,
                "draft_digest": m.draft_digest,
                "backend": m.backend,
                "versions": dict(m.versions),
                "engine": dict(m.engine),
                "created_at": m.created_at,
                "size_bytes": m.size_bytes,
                "file_count": m.file_count,
            }
            files = tuple({"path": f.path, "size": f.size, "sha256": f.sha256} for f in m.files)
        return BundleDetail(
            bundle=info,
            manifest=manifest,
            files=files,
            holders=tuple(self.holders(bid)),
            events=tuple(self.catalog.events.recent(bundle_id=bid, limit=events)),
        )

    def list_bundles(self, **filters: Any) -> BundlePage:
        """Filter, sort and page bundles (see ``BundleTable.page``); an unknown state is a ConfigError."""
        state = filters.get("state")
        if state is not None and state not in BUNDLE_STATES:
            raise ConfigError("state", f"must be one of {', '.join(BUNDLE_STATES)}, got {state!r}")
        return self.catalog.bundles.page(**filters)

    def bundle_source(self, bid: str) -> str | None:
        """``pulled`` or ``built``: how this node's bundle ``bid`` last came to be (its newest
        ``pull`` or ``build_ok`` event); None when the log no longer says (retention)."""
        for event in self.catalog.events.recent(bundle_id=bid, node=self.node, limit=50):
            if event.kind in ("pull", "build_ok"):
                return "pulled" if event.kind == "pull" else "built"
        return None

    def find_checkpoint(self, ref: str, *, by_path: bool = True) -> CheckpointInfo:
        """The catalog's checkpoint named by ``ref``: its digest or a unique prefix of it (at least
        8 hex characters) or, with ``by_path``, its path or the model string it was resolved
        from. NotFoundError when none matches; ConfigError (field ``checkpoint``) when a prefix
        matches several."""
        wanted = ref.strip()
        known = self.catalog.checkpoints.all()
        if re.fullmatch(r"[0-9a-f]{8,64}", wanted):
            matches = [c for c in known if c.digest.startswith(wanted)]
            if len(matches) == 1:
                return matches[0]
            if len(matches) > 1:
                raise ConfigError(
                    "checkpoint",
                    f"{wanted!r} is the start of {len(matches)} checkpoint digests; give more characters",
                )
        if by_path and wanted:
            as_path = os.path.abspath(os.path.expanduser(wanted))
            for c in known:
                if wanted.rstrip("/") == c.source.rstrip("/") or as_path == os.path.abspath(c.path):
                    return c
        raise NotFoundError(
            f"no checkpoint {ref!r} in the catalog (`cachesvc checkpoints ls` / GET /admin/checkpoints "
            "list them by digest)"
        )

    def catalog_state(self) -> CatalogState:
        """Whether the catalog database answers (``/health``)."""
        return self.catalog.state()

    def model_labels(self, models: set[str]) -> dict[str, str]:
        """The served names of ``models`` (:func:`cachesvc.cache.model_names.model_labels`), by the
        catalog's aliases."""
        aliases = self.catalog.aliases.all()
        bundle_models = {}
        for a in aliases:
            info = self.catalog.bundles.get(a.bundle_id) if a.bundle_id else None
            if info is not None:
                bundle_models[info.id] = info.model
        return model_labels(models, aliases, bundle_models)

    def stats(self, node: str | None = None) -> CacheStats:
        """Cache statistics from the catalog (they survive restarts, agree across processes).

        Every change stats can show is an event or a new checkpoint, so the result is reused
        until the catalog version or the checkpoint count moves (dashboards and /metrics poll).
        """
        node = node or self.node
        if node != self.node and not self.fleet.knows(node):
            raise NotFoundError(f"no node named {node!r} in the catalog (GET /admin/nodes lists them)")
        cap = self.max_size_bytes if node == self.node else (self.fleet.node_cap(node) or 0)
        key = (self.catalog.events.version(), self.catalog.checkpoints.count(), cap, node)
        with self._stats_lock:
            stats = None
            if self._stats_cache is not None and self._stats_cache[0] == key:
                stats = self._stats_cache[1]
        if stats is None:
            stats = self.catalog.events.stats(max_size_bytes=cap, node=node)
            labels = self.model_labels({m.model for m in stats.per_model})
            named = tuple(replace(m, model_name=labels[m.model]) for m in stats.per_model)
            stats = replace(stats, per_model=named)
            with self._stats_lock:
                self._stats_cache = (key, stats)
        if node != self.node:
            return stats
        # On disk, not in the catalog: a conversion's leftovers have no row (reconcile removes them);
        # the bundles' context records (context/<bundle_id>/) and the converted LoRA adapters
        # count in the cache's size.
        return replace(stats, checkpoint_bytes=dir_size(self.layout.checkpoints),
                       size_bytes=stats.size_bytes + self.layout.context_bytes()
                       + self.catalog.adapters.total_size())

