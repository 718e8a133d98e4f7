"""Bundle checks against their manifests: the full verify (on demand and at ``serve`` start),
the quick check of every cache hit and every engine load (sizes and sampled hashes), and
whether a bundle was built for this node's GPU, TensorRT version and CPU class (``stale``).

A bundle that fails a check is marked corrupt in the catalog (never served; the next prepare
rebuilds it) and every corrupt-listener (the serving side unloads it) is told.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from pathlib import Path

from cachesvc.cache.builders import stale_reason
from cachesvc.cache.catalog import Catalog
from cachesvc.cache.records import BundleInfo, VerifyResult
from cachesvc.cache.store import BundleStore, quick_verify_bundle, read_manifest, verify_bundle
from cachesvc.errors import CorruptBundleError, LeasedError, NotFoundError

log = logging.getLogger("cachesvc.manager")


class BundleVerifier:
    """Verify, load-check and stale-check one node's bundles."""

    def __init__(self, catalog: Catalog, store: BundleStore, *, gpu_disabled: bool = False) -> None:
        self.catalog = catalog
        self.store = store
        self._gpu_disabled = gpu_disabled
        self._corrupt_listeners: list[Callable[[str, str], None]] = []

    def add_corrupt_listener(self, listener: Callable[[str, str], None]) -> None:
        """Call ``listener(bundle_id, detail)`` whenever this process marks a bundle corrupt."""
        self._corrupt_listeners.append(listener)

    def mark_corrupt(self, bid: str, detail: str) -> None:
        """Mark ``bid`` corrupt (never served; the next prepare rebuilds it) and tell the listeners."""
        try:
            self.catalog.bundles.set_verified(bid, ok=False, detail=detail)
        except NotFoundError:
            return
        for listener in list(self._corrupt_listeners):
            try:
                listener(bid, detail)
            except Exception:
                log.exception("corrupt-bundle listener failed")

    def stale_reason(self, info: BundleInfo) -> str | None:
        """Why ``info``'s engine cannot run on this node now (see ``builders.stale_reason``)."""
        if info.backend != "tensorrt" and info.profile.get("cpu_class") is None:
            return None  # fp32 CPU bundles run anywhere: no manifest read on the hit path
        try:
            manifest = read_manifest(self.store.layout.root / info.path)
        except CorruptBundleError as exc:
            return str(exc)
        return stale_reason(info.backend, manifest.engine, gpu_disabled=self._gpu_disabled)

    def verify(self, bid: str) -> VerifyResult:
        """Re-hash a bundle against its manifest; a mismatch marks it corrupt (never served).

        Files that match but were built for another GPU or TensorRT version than this node has
        mark it ``stale``; a clean verify makes a corrupt or stale bundle ready again."""
        info = self.catalog.bundles.require(bid)
        if info.state == "building":
            raise LeasedError(f"bundle {bid} is being built; verify it when the build finishes")
        bundle_dir = self.store.layout.root / info.path
        mismatches: tuple[dict[str, str], ...]
        try:
            report = verify_bundle(bundle_dir)
            files_checked, bytes_checked = report.files_checked, report.bytes_checked
            mismatches = tuple({"path": m.path, "reason": m.reason} for m in report.mismatches)
        except CorruptBundleError as exc:
            files_checked, bytes_checked = 0, 0
            mismatches = ({"path": "manifest.json", "reason": str(exc)},)
        ok = not mismatches
        detail = None if ok else "; ".join(f"{m['path']}: {m['reason']}" for m in mismatches[:10])
        if ok:
            stale = self.stale_reason(info)
            if stale is not None and self.store.locks.is_locked(bid):
                # Leased: a process on this node runs it, so it runs here (as reconcile holds).
                stale = None
            if stale is not None:
                log.warning("bundle %s is stale and will not be loaded: %s", bid, stale)
            updated = self.catalog.bundles.set_verified(bid, ok=True, detail=None, stale=stale)
        else:
            log.error("bundle %s is corrupt: %s", bid, detail)
            self.mark_corrupt(bid, detail or "corrupt")
            updated = self.catalog.bundles.require(bid)
        return VerifyResult(bid, ok, files_checked, bytes_checked, mismatches, updated.state)

    def load_check(self, bid: str, final: Path) -> str | None:
        """The quick check of a hit and of every engine load: every file's size and a sampled
        hash against the manifest. A mismatch marks the bundle corrupt (rebuilt by the next
        prepare, never served) and is returned; None when the bundle passes."""
        try:
            report = quick_verify_bundle(final, read_manifest(final))
            detail = "; ".join(f"{m.path}: {m.reason}" for m in report.mismatches[:10]) or None
        except CorruptBundleError as exc:
            detail = str(exc)
        if detail is not None:
            log.error("bundle %s failed the load check and will be rebuilt: %s", bid, detail)
            self.mark_corrupt(bid, detail)
        return detail
