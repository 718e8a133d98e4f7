"""The cache core: bundles built once per checkpoint and profile, kept on disk under a size cap.

``manager`` (``CacheManager``: prepare, leases, every write) -> its sections (``queries``,
``verification``, ``eviction``, ``reconcile``, ``build_jobs``, ``adapters``, ``bundle_leases``,
``registry/``: the OCI registry of bundles) -> ``builders``, ``catalog/`` (the SQL catalog, one
repository per table), ``checkpoints`` and ``model_names`` -> ``gguf_checkpoints`` -> ``store/``
(the filesystem only) -> the vocabularies (``profiles``, ``records``, ``fleet_records``,
``hub_errors``) -> ``crashpoints``. Each floor imports only the floors below it (an
import-linter contract); nothing here reads the launch config (``cachesvc.settings``).
"""
