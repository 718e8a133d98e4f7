"""Errors raised while turning a checkpoint into a bundle (defined in :mod:`inference.errors`,
which the family registry imports without loading the builder)."""

from __future__ import annotations

from inference.errors import BuildInputError

__all__ = ["BuildInputError"]
