"""What the entry points (``cachesvc`` commands and ``serve``) share: opening the cache that a
launch configuration names.

The domain (``CacheManager`` and below) takes plain values and never imports the
argparse-facing :mod:`cachesvc.settings.config`; this module is the one place that turns a
:class:`~cachesvc.settings.config.ServeConfig` into those values.
"""

from __future__ import annotations

from cachesvc.cache.manager import CacheManager
from cachesvc.settings.config import ServeConfig


def open_cache(config: ServeConfig, *, serving: bool = False) -> CacheManager:
    """Open (creating if needed) the cache ``config`` names: dir, catalog URL and size cap.

    ``serving`` (``cachesvc serve``): the directory is claimed for ``--node-name`` (default: the
    host name) and refused when another node owns it; commands act as the node that owns it.
    ``CACHESVC_DISABLE_GPU`` reaches the cache here, as ``config.build.gpu_disabled`` (no tensorrt
    builder, TensorRT bundles stale on this node). ``--registry`` (with ``--registry-insecure``,
    ``--registry-push``) gives the cache its fleet registry."""
    return CacheManager.open(
        config.cache.cache_dir,
        catalog_url=config.cache.catalog_url_resolved,
        max_size_bytes=config.cache.engine_cache_max_size_bytes,
        node=config.fleet.node_name_resolved if serving else config.fleet.node_name,
        claim_node=serving,
        gpu_disabled=config.build.gpu_disabled,
        registry=config.fleet.registry_settings,
    )
