"""Bundle directory -> token stream."""

from __future__ import annotations

from inference.runtime.protocol import Engine, EngineInfo

__all__ = ["Engine", "EngineInfo"]
