"""Errors raised while loading or running an engine bundle."""

from __future__ import annotations


class EngineLoadError(RuntimeError):
    """A bundle cannot be loaded by this runtime; the message says why and what to do."""
