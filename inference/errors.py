"""Errors of the inference library that its light modules (the family registry) raise too."""

from __future__ import annotations


class BuildInputError(ValueError):
    """The checkpoint or the build spec cannot be built; the message says what to fix."""
