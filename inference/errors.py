"""Errors of the inference library that its light modules (the family registry) raise too."""

from __future__ import annotations


class BuildInputError(ValueError):
    """The checkpoint or the build spec cannot be built; the message says what to fix."""


class UnsupportedFeatureError(BuildInputError):
    """A checkpoint of a known family uses a variant no engine builds (an encoder's bidirectional
    attention, a rope type or activation of no family, ...): bad input that the service refuses
    up front, before anything is recorded (``cachesvc.cache.checkpoints.check_family``)."""
