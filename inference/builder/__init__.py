"""Checkpoint directory -> engine bundle directory (the ``onnxruntime`` CPU backend)."""

from __future__ import annotations

from inference.builder.errors import BuildInputError
from inference.builder.ort_backend import BUILDER_VERSION, ENGINE_FILE, ENGINE_FORMAT_VERSION, build_bundle
from inference.builder.spec import EngineBuildSpec

__all__ = [
    "BUILDER_VERSION",
    "ENGINE_FILE",
    "ENGINE_FORMAT_VERSION",
    "BuildInputError",
    "EngineBuildSpec",
    "build_bundle",
]
