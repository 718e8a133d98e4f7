"""The per-layer K/V shapes an ``engine.json`` records (numpy-free, import-light: the memory
estimates read them too)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any


def kv_layer_shapes(meta: Mapping[str, Any]) -> list[tuple[int, int, int]]:
    """Per layer of the bundle whose ``engine.json`` is ``meta``: (K/V heads, head size, the layer
    whose K/V it attends over): ``kv_layers`` where layers differ (Gemma 4), else every layer's
    own of ``num_kv_heads`` x ``head_dim``."""
    layers = meta.get("kv_layers")
    if layers:
        return [(int(x["kv_heads"]), int(x["head_dim"]), int(x["source"])) for x in layers]
    return [(int(meta["num_kv_heads"]), int(meta["head_dim"]), i) for i in range(int(meta["num_layers"]))]
