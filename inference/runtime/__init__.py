"""Bundle directory -> token stream."""

from __future__ import annotations

from inference.runtime.errors import EngineLoadError
from inference.runtime.generate import generate
from inference.runtime.loader import load_engine, load_portable_engine, read_engine_meta
from inference.runtime.protocol import Engine, EngineInfo, KVEngine, VerifyingEngine

__all__ = [
    "Engine",
    "EngineInfo",
    "EngineLoadError",
    "KVEngine",
    "VerifyingEngine",
    "generate",
    "load_engine",
    "load_portable_engine",
    "read_engine_meta",
]
