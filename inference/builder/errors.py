"""Errors raised while turning a checkpoint into a bundle."""

from __future__ import annotations


class BuildInputError(ValueError):
    """The checkpoint or the build spec cannot be built; the message says what to fix."""
