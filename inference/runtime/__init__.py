"""Bundle directory -> token stream.

The protocol, the generation loop and the loader registry are light and imported here (the
function ``generate`` must be bound after its submodule ``generate`` is imported, or the package
attribute would be the module). The ONNX Runtime loader's names are imported on first use
(PEP 562), so onnxruntime is imported only when a bundle is loaded.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from inference.runtime.errors import EngineLoadError
from inference.runtime.generate import generate
from inference.runtime.protocol import Engine, EngineInfo, KVEngine, VerifyingEngine
from inference.runtime.registry import load_engine

if TYPE_CHECKING:
    from inference.runtime.onnxruntime_loader import read_engine_meta

_LAZY = {
    "read_engine_meta": "inference.runtime.onnxruntime_loader",
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
    "VerifyingEngine",
    "generate",
    "load_engine",
    "read_engine_meta",
]
