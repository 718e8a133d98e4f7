"""The admin REST API (mounted at ``/admin``): one module per resource, thin wrappers over
``CacheManager``.

Every handler that calls the manager runs in a worker thread (``sync_to_thread=True``): manager
calls block on SQLite, hashing, file locks and deletes. Validation lives in the Structs and
parameter constraints, domain rules in the manager, and the HTTP mapping of errors in
``cachesvc.http.errors``.

``router`` (the routers the app mounts) -> the resources: ``bundles``, ``builds`` (builds and
pulls), ``cache`` (prune, clear, reconcile), ``stats`` (stats, events), ``checkpoints``,
``adapters`` (LoRA adapters in the cache), ``fleet`` (nodes, desired state), ``engines`` (this
server's loaded engines), ``models`` (served names), ``loras`` (vLLM's runtime LoRA routes) ->
``params`` (what they share).
"""
