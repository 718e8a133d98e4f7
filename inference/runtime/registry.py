"""Engine loaders by the ``backend`` recorded in a bundle's ``engine.json``.

Each backend names the module and callable that loads it; the module is imported only when a
bundle of that backend is loaded, so importing the service (or its admin API) never imports a
runtime such as onnxruntime. A new backend adds one line to :data:`LOADERS` (or calls
:func:`register_loader`), nothing else.
"""

from __future__ import annotations

import importlib
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

from inference.runtime.embedding_batches import working_bytes
from inference.runtime.errors import EngineLoadError
from inference.runtime.protocol import Engine

ENGINE_FILE = "engine.json"

#: backend -> "module:callable"; the callable takes ``(bundle_dir, *, max_slots, threads)``.
LOADERS: dict[str, str] = {
    "onnxruntime": "inference.runtime.onnxruntime_loader:load_ort_engine",
    "tensorrt": "inference.runtime.trt_engine:load_trt_engine",
}

EngineLoader = Callable[..., Engine]


def register_loader(backend: str, target: str) -> None:
    """Make ``load_engine`` load bundles of ``backend`` with ``target`` (``module:callable``)."""
    if ":" not in target:
        raise ValueError(f"a loader is 'module:callable', got {target!r}")
    LOADERS[backend] = target


def bundle_backend(bundle_dir: Path) -> str:
    """The ``backend`` field of a bundle's ``engine.json`` (EngineLoadError when unreadable)."""
    return str(read_meta(bundle_dir).get("backend", ""))


def loader_for(backend: str) -> EngineLoader:
    """Import and return the loader of ``backend`` (EngineLoadError for an unknown backend)."""
    target = LOADERS.get(backend)
    if target is None:
        raise EngineLoadError(
            f"bundle backend {backend!r} has no engine loader in this process "
            f"(known: {', '.join(sorted(LOADERS))})"
        )
    module_name, _, attr = target.partition(":")
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise EngineLoadError(f"the {backend} runtime is not installed here ({exc})") from exc
    loader: EngineLoader = getattr(module, attr)
    return loader


def read_meta(bundle_dir: Path) -> dict[str, Any]:
    """A bundle's ``engine.json`` as a dict, unchecked (EngineLoadError when unreadable)."""
    path = Path(bundle_dir) / ENGINE_FILE
    try:
        meta: dict[str, Any] = json.loads(path.read_text())
    except FileNotFoundError:
        raise EngineLoadError(f"{bundle_dir} is not an engine bundle: {ENGINE_FILE} is missing") from None
    except (OSError, ValueError) as exc:
        raise EngineLoadError(f"{path} is not readable JSON ({exc}); rebuild the bundle") from exc
    return meta


def weight_bytes(bundle_dir: Path, meta: dict[str, Any]) -> int:
    """Bytes of the weights the serving engine loads: ``engine.json``'s ``weight_bytes`` (the
    builder counts the serving graph and every data file it references); for bundles of older
    builders, every ``model.*`` / ``engine.*`` file but the portable graph's own proto (an
    overestimate at worst, never an underestimate: a shared data file counts in full)."""
    recorded = meta.get("weight_bytes")
    if isinstance(recorded, int) and recorded > 0:
        return recorded
    portable = str(meta.get("portable_model") or "")
    kv = meta.get("kv_cache")
    serving = str(kv.get("model", "")) if isinstance(kv, dict) else ""
    return sum(
        f.stat().st_size
        for f in Path(bundle_dir).iterdir()
        if f.is_file()
        and f.name.startswith(("model.", "engine."))
        and f.name != ENGINE_FILE
        and (f.name != portable or f.name == serving)
    )


def kv_bytes_per_token(meta: dict[str, Any]) -> int:
    """KV bytes one position takes over all layers, as the builder recorded it (0 if unknown)."""
    recorded = meta.get("kv_bytes_per_token")
    if isinstance(recorded, int):
        return recorded
    kv = meta.get("kv_cache")
    return int(kv.get("bytes_per_token", 0)) if isinstance(kv, dict) else 0


def is_embedding(meta: dict[str, Any]) -> bool:
    """Whether ``engine.json`` describes an embedding bundle (``task`` ``embed``): no KV cache,
    so no context-reuse record pool either."""
    return meta.get("task") == "embed"


def memory_estimate(bundle_dir: Path, *, max_slots: int | None = None) -> int:
    """What loading the bundle takes in memory: weight bytes + KV bytes per token x capacity x
    slots; for an embedding bundle, weight bytes + the working memory of its largest run
    (:func:`~inference.runtime.embedding_batches.working_bytes`)."""
    meta = read_meta(bundle_dir)
    if is_embedding(meta):
        return weight_bytes(bundle_dir, meta) + working_bytes(meta)
    slots = int(meta.get("max_batch_size", 1)) if max_slots is None else max_slots
    capacity = int(meta.get("max_kv_cache_capacity", 0))
    return weight_bytes(bundle_dir, meta) + kv_bytes_per_token(meta) * capacity * slots


def load_engine(bundle_dir: Path, *, max_slots: int | None = None, threads: int | None = None) -> Engine:
    """Load a bundle as an Engine with the loader of the backend its ``engine.json`` names."""
    loader = loader_for(bundle_backend(bundle_dir))
    return loader(Path(bundle_dir), max_slots=max_slots, threads=threads)


__all__ = [
    "LOADERS",
    "EngineLoader",
    "bundle_backend",
    "is_embedding",
    "kv_bytes_per_token",
    "load_engine",
    "loader_for",
    "memory_estimate",
    "read_meta",
    "register_loader",
    "weight_bytes",
]
