"""Bundle directory -> loaded Engine, refusing bundles this runtime cannot run faithfully."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import onnxruntime as ort

from inference.cpu_class import cpu_class_mismatch
from inference.runtime.embedding_engine import EMBEDDING_MODEL, EmbeddingEngine
from inference.runtime.errors import EngineLoadError
from inference.runtime.onnxruntime_engine import KV_LAYOUT, GqaEngine, kv_dtype_of
from inference.runtime.ort_session import available_cores
from inference.runtime.registry import ENGINE_FILE, is_embedding, load_engine, memory_estimate, read_meta
from inference.runtime.vision_encoder import load_vision

# Format 1 (two weight copies, no in-place KV graph) is refused: rebuilding is cheap and the
# cache rebuilds it anyway (the builder version is part of the bundle profile).
KNOWN_FORMAT_VERSIONS = (2,)


def _major_minor(version: str) -> str:
    return ".".join(version.split(".")[:2])


def read_engine_meta(bundle_dir: Path) -> dict[str, Any]:
    """Read and check ``engine.json`` of a bundle (format version, backend, runtime version)."""
    path = Path(bundle_dir) / ENGINE_FILE
    meta = read_meta(bundle_dir)
    version = meta.get("format_version")
    if version not in KNOWN_FORMAT_VERSIONS:
        raise EngineLoadError(
            f"{path} has format_version {version!r}; this runtime reads {list(KNOWN_FORMAT_VERSIONS)}. "
            "Rebuild the bundle with this version of the builder"
        )
    backend = meta.get("backend")
    if backend != "onnxruntime":
        raise EngineLoadError(f"bundle backend {backend!r} is not loadable by the onnxruntime runtime")
    built_with = str(meta.get("onnxruntime_version", "?"))
    if _major_minor(built_with) != _major_minor(ort.__version__):
        raise EngineLoadError(
            f"bundle was built with onnxruntime {built_with} but this process runs {ort.__version__}; "
            "the optimised graph is tied to the minor version: rebuild the bundle"
        )
    mismatch = cpu_class_mismatch(meta)
    if mismatch is not None:
        raise EngineLoadError(f"bundle {bundle_dir} is {mismatch}")
    if is_embedding(meta):
        return meta  # no KV cache: the embedding graph runs each input from its first token
    kv = meta.get("kv_cache")
    if not isinstance(kv, dict) or kv.get("layout") != KV_LAYOUT:
        layout = kv.get("layout") if isinstance(kv, dict) else None
        raise EngineLoadError(
            f"{path} has KV layout {layout!r}; this runtime runs {KV_LAYOUT!r}. Rebuild the bundle"
        )
    try:
        kv_dtype_of(kv)
    except ValueError as exc:
        raise EngineLoadError(f"{path}: {exc}. Rebuild the bundle") from None
    return meta


def _load_embedding(bundle_dir: Path, meta: dict[str, Any], threads: int) -> EmbeddingEngine:
    model = bundle_dir / EMBEDDING_MODEL
    if not model.is_file():
        raise EngineLoadError(f"bundle {bundle_dir} has no model file ({model.name}); rebuild it")
    try:
        engine = EmbeddingEngine(model, meta, threads=threads)
    except (KeyError, TypeError) as exc:
        raise EngineLoadError(f"{bundle_dir}/{ENGINE_FILE} lacks a field: {exc}; rebuild the bundle") from exc
    except Exception as exc:  # onnxruntime's load errors have no common public base class
        raise EngineLoadError(
            f"onnxruntime cannot load {model}: {exc}; verify or rebuild the bundle") from exc
    engine.set_memory_bytes(memory_estimate(bundle_dir, max_slots=1))
    return engine


def load_ort_engine(
    bundle_dir: Path, *, max_slots: int | None = None, threads: int | None = None
) -> GqaEngine | EmbeddingEngine:
    """Load an ``onnxruntime`` bundle as an Engine (the registry's loader for that backend): a
    :class:`GqaEngine`, or an :class:`EmbeddingEngine` for an embedding bundle.

    ``max_slots`` defaults to the bundle's max_batch_size; ``threads`` (intra-op) defaults to
    the number of cores this process may use.
    """
    bundle_dir = Path(bundle_dir)
    meta = read_engine_meta(bundle_dir)
    slots = int(meta.get("max_batch_size", 1)) if max_slots is None else max_slots
    if slots < 1:
        raise ValueError(f"max_slots must be at least 1, got {slots}")
    n_threads = available_cores() if threads is None else threads
    if n_threads < 1:
        raise ValueError(f"threads must be at least 1, got {n_threads}")
    if is_embedding(meta):
        return _load_embedding(bundle_dir, meta, n_threads)
    model = bundle_dir / str(meta["kv_cache"].get("model", ""))
    if not model.is_file():
        raise EngineLoadError(f"bundle {bundle_dir} has no model file ({model.name}); rebuild it")
    try:
        engine = GqaEngine(model, meta, max_slots=slots, threads=n_threads)
    except (KeyError, TypeError) as exc:
        raise EngineLoadError(f"{bundle_dir}/{ENGINE_FILE} lacks a field: {exc}; rebuild the bundle") from exc
    except Exception as exc:  # onnxruntime's load errors have no common public base class
        raise EngineLoadError(
            f"onnxruntime cannot load {model}: {exc}; verify or rebuild the bundle"
        ) from exc
    vision = meta.get("vision")
    if isinstance(vision, dict):
        engine.attach_vision(load_vision(bundle_dir, vision, threads=n_threads))
    engine.set_memory_bytes(memory_estimate(bundle_dir, max_slots=slots))
    return engine


__all__ = ["ENGINE_FILE", "load_engine", "load_ort_engine", "read_engine_meta"]
