"""Bundle directory -> token stream.

Names are imported on first use (PEP 562): ``inference.runtime.protocol`` and the loader
registry are light, the ONNX Runtime engine is imported only when a bundle is loaded.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from inference.runtime.errors import EngineLoadError
    from inference.runtime.generate import generate
    from inference.runtime.loader import load_portable_engine, read_engine_meta
    from inference.runtime.protocol import Engine, EngineInfo, KVEngine
    from inference.runtime.registry import load_engine

_LAZY = {
    "Engine": "inference.runtime.protocol",
    "EngineInfo": "inference.runtime.protocol",
    "KVEngine": "inference.runtime.protocol",
    "EngineLoadError": "inference.runtime.errors",
    "generate": "inference.runtime.generate",
    "load_engine": "inference.runtime.registry",
    "load_portable_engine": "inference.runtime.loader",
    "read_engine_meta": "inference.runtime.loader",
}


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'inference.runtime' has no attribute {name!r}")
    return getattr(importlib.import_module(module), name)


__all__ = [
    "Engine",
    "EngineInfo",
    "EngineLoadError",
    "KVEngine",
    "generate",
    "load_engine",
    "load_portable_engine",
    "read_engine_meta",
]
