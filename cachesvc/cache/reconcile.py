"""Reconcile: make the catalog and the disk agree again (at every start and on demand).

Disk holds the bytes, the catalog the index. Reconcile empties the trash, removes staging
directories whose build or GGUF conversion died (their lock is free), adopts published bundles whose manifest
verifies, finishes builds that died between publishing and marking the row ready, forgets rows
whose directory vanished and marks interrupted builds failed. A directory that is being built
or served (its lock is held) is never touched.

It also flags ready TensorRT bundles built for another GPU (compute capability) or TensorRT
version than this node has now (or whose GPU is gone) ``stale``, and makes stale ones whose
environment is back ``ready`` again (:func:`cachesvc.cache.builders.stale_reason`).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from datetime import datetime
from pathlib import Path

from cachesvc.cache.builders import stale_reason
from cachesvc.cache.catalog import Catalog, utcnow
from cachesvc.cache.gguf_checkpoints import remove_orphaned_conversions
from cachesvc.cache.profiles import BundleKey
from cachesvc.cache.records import LeaseHolder, ReconcileReport
from cachesvc.cache.store import (
    ADAPTER_FILE_NAME,
    BundleStore,
    Manifest,
    adapter_lock_key,
    is_adapter_id,
    remove_tree,
    verify_bundle,
)

log = logging.getLogger("cachesvc.reconcile")


class Reconciler:
    """Re-syncs one catalog with one store."""

    def __init__(
        self,
        catalog: Catalog,
        store: BundleStore,
        *,
        holders: Callable[[str], list[LeaseHolder]],
        gpu_disabled: bool = False,
    ) -> None:
        self.catalog = catalog
        self.store = store
        self._holders = holders
        self._gpu_disabled = gpu_disabled

    def reconcile(self) -> ReconcileReport:
        """Re-sync catalog and disk (startup and on demand)."""
        self.store.empty_trash()
        staging_removed: list[str] = []
        for bid, path in self.store.staging_dirs():
            with self.store.locks.try_exclusive(bid) as got:
                if got:  # no build holds it: a crashed build's leftovers
                    self.store.remove_staging(path)
                    staging_removed.append(path.name)
        # A GGUF conversion killed half way leaves its staging directory under checkpoints/:
        # the first stage of a build that died, recorded as a bundle build's death is below.
        for orphan in remove_orphaned_conversions(self.store.layout.checkpoints):
            staging_removed.append(f"checkpoints/{orphan.path}")
            self.catalog.events.add(
                "build_failed", model=orphan.source, seconds=0.0,
                detail="GGUF conversion interrupted (the converting process died)",
            )
        adopted: list[str] = []
        corrupt: list[str] = []
        known = {b.id: b for b in self.catalog.bundles.all()}
        on_disk: set[str] = set()
        manifests: dict[str, Manifest] = {}
        for scanned in self.store.scan():
            m = scanned.manifest
            if m is not None and m.bundle_id in known:
                on_disk.add(m.bundle_id)
                manifests[m.bundle_id] = m
                if known[m.bundle_id].state == "building":
                    self._finish_orphaned_build(scanned.path, m, adopted)
                continue
            with self.store.locks.try_exclusive(m.bundle_id if m else scanned.path.name) as got:
                if not got:
                    continue
                if m is not None and verify_bundle(scanned.path, m).ok:
                    self.adopt(scanned.relpath, m, str(m.engine.get("source_model", "")))
                    adopted.append(m.bundle_id)
                    on_disk.add(m.bundle_id)
                    manifests[m.bundle_id] = m
                elif m is not None:
                    # Our manifest, but the files do not match it: never served, so remove it.
                    self.store.remove(scanned.relpath)
                    corrupt.append(str(scanned.relpath))
                else:
                    # No manifest we can read: we cannot tell whose it is, so keep it aside.
                    moved = self.store.quarantine(scanned.relpath)
                    log.warning(
                        "reconcile: %s is not a bundle (%s); moved to %s",
                        scanned.relpath,
                        scanned.error,
                        moved,
                    )
                    corrupt.append(str(scanned.relpath))
        forgotten: list[str] = []
        for bid, info in known.items():
            if bid in on_disk:
                continue
            if info.state == "failed":
                # Left by an older version: the failure is an event already; a row without a
                # directory only misleads listings and stats.
                self.catalog.bundles.forget(bid)
                forgotten.append(bid)
                continue
            with self.store.locks.try_exclusive(bid) as got:
                if not got:  # being built or served right now
                    continue
                if info.state == "building":
                    self.catalog.bundles.fail_build(
                        bid, error="build interrupted (the building process died)", seconds=0.0
                    )
                    forgotten.append(bid)
                    continue
                if not ((self.store.layout.root / info.path) / "manifest.json").exists():
                    self.catalog.bundles.delete(
                        bid, reason="stale", nbytes=info.size_bytes, detail="directory vanished"
                    )
                    forgotten.append(bid)
        for info in self.catalog.bundles.all():
            live = {h.pid for h in self._holders(info.id) if h.host == self.catalog.node}
            self.catalog.leases.drop_stale(info.id, live)
        self._drop_orphaned_context()
        stale, restored = self._recheck_environment(manifests)
        adapters_forgotten, adapter_files_removed = self._reconcile_adapters()
        report = ReconcileReport(
            tuple(adopted),
            tuple(forgotten),
            tuple(staging_removed),
            tuple(corrupt),
            tuple(stale),
            tuple(restored),
            tuple(adapters_forgotten),
            tuple(adapter_files_removed),
        )
        if (adopted or forgotten or staging_removed or corrupt or stale or restored or adapters_forgotten
                or adapter_files_removed):
            log.info("reconcile: %s", report)
        return report

    def _reconcile_adapters(self) -> tuple[list[str], list[str]]:
        """Forget adapter rows whose converted file vanished; remove folders under ``adapters/``
        that hold no converted file (a conversion that died before its rename) and leftover temp
        files of a conversion that died. An adapter whose lock is held (being converted, or
        leased by a serving process) is left alone.

        A complete converted file without a row is kept, never deleted: its row may have been
        lost with the catalog (a deleted or repaired catalog file), and preparing the adapter
        again adopts the file without converting it (``AdapterStore.prepare``)."""
        layout = self.store.layout
        forgotten: list[str] = []
        removed: list[str] = []
        unknown: list[str] = []
        rows = {a.id: a for a in self.catalog.adapters.all()}
        for aid, info in rows.items():
            if (layout.root / info.path).is_file():
                continue
            with self.store.locks.try_exclusive(adapter_lock_key(aid)) as got:
                if got and not (layout.root / info.path).is_file():
                    self.catalog.adapters.delete(aid, reason="stale", nbytes=info.size_bytes,
                                                detail="file vanished")
                    forgotten.append(aid)
        try:
            entries = sorted(layout.check_subfolder(layout.adapters).iterdir())
        except FileNotFoundError:
            return forgotten, removed
        for entry in entries:
            name = entry.name
            if entry.is_symlink() or not entry.is_dir():
                continue
            if not is_adapter_id(name):
                continue  # not a name the cache gives an adapter folder: not ours to delete
            with self.store.locks.try_exclusive(adapter_lock_key(name)) as got:
                if not got:
                    continue
                if (name not in rows or name in forgotten) and not (entry / ADAPTER_FILE_NAME).is_file():
                    if remove_tree(layout, entry, f"adapter-{name}"):
                        removed.append(name)
                    continue
                if name not in rows:
                    unknown.append(name)
                for leftover in entry.iterdir():
                    if leftover.name != ADAPTER_FILE_NAME and leftover.name.endswith(".tmp"):
                        leftover.unlink(missing_ok=True)
        if forgotten or removed:
            log.info("reconcile: adapters forgotten %s, adapter folders removed %s", forgotten, removed)
        if unknown:
            log.warning(
                "reconcile: %d converted LoRA adapter(s) on disk are not in the catalog (%s); kept: "
                "preparing an adapter again (--lora-modules, POST /admin/lora-adapters) adopts its file",
                len(unknown), ", ".join(unknown),
            )
        return forgotten, removed

    def _drop_orphaned_context(self) -> None:
        """Remove context records (``context/<bundle_id>/``) whose bundle is gone."""
        layout = self.store.layout
        kept = {b.id for b in self.catalog.bundles.all()}
        for bid in layout.context_bundle_ids():
            if bid not in kept and layout.remove_context(bid):
                log.info("reconcile: removed the context records of bundle %s (bundle gone)", bid)

    def _recheck_environment(self, manifests: dict[str, Manifest]) -> tuple[list[str], list[str]]:
        """Flag ready bundles that cannot run here ``stale`` and stale ones that can ``ready``.

        TensorRT bundles (GPU and TensorRT version) and quantized CPU bundles (CPU class) are
        checked; nothing GPU-related is imported without a TensorRT bundle. A bundle whose lease
        lock is held is being served on this node right now, so it runs here: it is not flagged."""
        stale: list[str] = []
        restored: list[str] = []
        for info in self.catalog.bundles.all(states=("ready", "stale")):
            manifest = manifests.get(info.id)
            if manifest is None:
                continue
            why = stale_reason(info.backend, manifest.engine, gpu_disabled=self._gpu_disabled)
            if why is not None and info.state == "ready":
                if self.store.locks.is_locked(info.id):
                    continue
                self.catalog.bundles.set_stale(info.id, why)
                log.warning("bundle %s is stale and will not be loaded: %s", info.id, why)
                stale.append(info.id)
            elif why is None and info.state == "stale":
                self.catalog.bundles.set_stale(info.id, None)
                log.info("bundle %s runs here again: ready", info.id)
                restored.append(info.id)
        return stale, restored

    def _finish_orphaned_build(self, path: Path, manifest: Manifest, adopted: list[str]) -> None:
        """A process died after publishing but before marking the row ready: finish its work."""
        with self.store.locks.try_exclusive(manifest.bundle_id) as got:
            if got and verify_bundle(path, manifest).ok:
                self.catalog.bundles.finish_build(
                    manifest.bundle_id,
                    size_bytes=manifest.size_bytes,
                    file_count=manifest.file_count,
                    seconds=0.0,
                )
                adopted.append(manifest.bundle_id)

    def adopt(self, rel: Path, manifest: Manifest, model: str) -> None:
        """Insert a ready row for a published, verified directory the catalog did not know."""
        self.catalog.bundles.adopt(
            BundleKey.from_manifest(manifest, rel),
            model=model or manifest.checkpoint_digest[:16],
            size_bytes=manifest.size_bytes,
            file_count=manifest.file_count,
            built_at=_parse_time(manifest.created_at),
        )


def _parse_time(text: str) -> datetime:
    try:
        value = datetime.fromisoformat(text)
    except ValueError:
        return utcnow()
    return value if value.tzinfo else value.replace(tzinfo=utcnow().tzinfo)
