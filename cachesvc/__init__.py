"""cachesvc: engine-bundle cache manager with a REST admin API and OpenAI-style serving."""

from __future__ import annotations

__version__ = "0.1.0"
