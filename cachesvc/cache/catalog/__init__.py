"""The catalog: SQL index of bundles, checkpoints, leases and events."""

from __future__ import annotations

from cachesvc.cache.catalog.repository import Catalog, utcnow
from cachesvc.cache.catalog.session import default_catalog_url

__all__ = ["Catalog", "default_catalog_url", "utcnow"]
