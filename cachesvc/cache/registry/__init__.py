"""Engine bundles in an OCI registry: references, the artifact mapping, the protocol client,
and push/pull/list for the cache (``manager.registry``). See docs/registry.md."""

from __future__ import annotations

from cachesvc.cache.registry.reference import RegistryRef, parse_ref
from cachesvc.cache.registry.transfer import (
    BundleRegistry,
    PullResult,
    PushResult,
    RegistrySettings,
    RemoteEntry,
)

__all__ = [
    "BundleRegistry",
    "PullResult",
    "PushResult",
    "RegistryRef",
    "RegistrySettings",
    "RemoteEntry",
    "parse_ref",
]
