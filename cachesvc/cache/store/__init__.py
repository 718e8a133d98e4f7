"""The disk store: cache layout, per-bundle locks, manifests, and atomic bundle publishing.

Filesystem only: the store knows nothing of the catalog or the builder.
"""

from __future__ import annotations

from cachesvc.cache.store.bundles import BundleStore, ScannedBundle, dir_size
from cachesvc.cache.store.layout import (
    ADAPTER_FILE_NAME,
    CACHEDIR_TAG_CONTENT,
    CACHEDIR_TAG_SIGNATURE,
    CacheLayout,
    adapter_lock_key,
    check_bundle_id,
    is_adapter_id,
    remove_tree,
)
from cachesvc.cache.store.locks import BundleLocks, Lease
from cachesvc.cache.store.manifest import (
    MANIFEST_NAME,
    MISMATCH_REASONS,
    FileEntry,
    Manifest,
    Mismatch,
    VerifyReport,
    hash_files,
    quick_verify_bundle,
    read_manifest,
    verify_bundle,
)

__all__ = [
    "ADAPTER_FILE_NAME",
    "CACHEDIR_TAG_CONTENT",
    "CACHEDIR_TAG_SIGNATURE",
    "MANIFEST_NAME",
    "MISMATCH_REASONS",
    "BundleLocks",
    "BundleStore",
    "CacheLayout",
    "FileEntry",
    "Lease",
    "Manifest",
    "Mismatch",
    "ScannedBundle",
    "VerifyReport",
    "adapter_lock_key",
    "check_bundle_id",
    "dir_size",
    "hash_files",
    "is_adapter_id",
    "quick_verify_bundle",
    "read_manifest",
    "remove_tree",
    "verify_bundle",
]
