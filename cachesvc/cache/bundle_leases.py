"""The lease a serving process holds on a bundle (from ``CacheManager.lease``): the shared
lock that keeps eviction away, and the display row in the catalog's ``leases`` table."""

from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import Protocol

from cachesvc.cache.catalog import Catalog
from cachesvc.cache.records import BundleInfo
from cachesvc.cache.store import Lease
from cachesvc.errors import CatalogUnavailableError

log = logging.getLogger("cachesvc.manager")


class BundleLease:
    """A shared lease on a bundle held by this process; release it when the engine unloads."""

    def __init__(self, catalog: Catalog, info: BundleInfo, bundle_dir: Path, lease: Lease) -> None:
        self._catalog = catalog
        self._lease = lease
        self.bundle = info
        self.bundle_id = info.id
        self.bundle_dir = bundle_dir

    @property
    def held(self) -> bool:
        """True until released."""
        return self._lease.held

    def release(self) -> None:
        """Release the shared lock and drop the display row (idempotent)."""
        if not self._lease.held:
            return
        self._lease.release()
        try:
            self._catalog.leases.remove(self.bundle_id, os.getpid())
        except CatalogUnavailableError:
            pass  # the catalog's health logs the outage; reconcile drops the stale row later
        except Exception:  # the lock is the truth; a stale row is cleaned by reconcile
            log.warning("could not remove the lease row of %s", self.bundle_id, exc_info=True)

    def __enter__(self) -> BundleLease:
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()


class Releasable(Protocol):
    """Anything held until released: a bundle's or a LoRA adapter's lease."""

    def release(self) -> None: ...


class CombinedLease(BundleLease):
    """A bundle's lease together with the leases of what is loaded with it (a speculative
    draft's bundle, LoRA adapters): one ``release`` lets go of all of them."""

    def __init__(self, primary: BundleLease, *others: Releasable) -> None:
        super().__init__(primary._catalog, primary.bundle, primary.bundle_dir, primary._lease)
        self._others = others

    def release(self) -> None:
        """Release every lease (idempotent)."""
        try:
            super().release()
        finally:
            for other in self._others:
                other.release()
