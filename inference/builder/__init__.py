"""Checkpoint directory -> engine bundle directory (the ``onnxruntime`` CPU backend).

The backend's names load on first use: importing ``inference.builder.<module>`` for a light
part (``kernel_plan``'s vocabulary, ``errors``, ``spec``) must not import onnxruntime, which the
service and the admin API never need (tests/serving/test_pool_seams.py).
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from inference.builder.errors import BuildInputError
from inference.builder.spec import EngineBuildSpec

if TYPE_CHECKING:
    from inference.builder.ort_backend import (
        BUILDER_VERSION,
        ENGINE_FILE,
        ENGINE_FORMAT_VERSION,
        build_bundle,
    )

_LAZY = frozenset({"BUILDER_VERSION", "ENGINE_FILE", "ENGINE_FORMAT_VERSION", "build_bundle"})

__all__ = [
    "BUILDER_VERSION",
    "ENGINE_FILE",
    "ENGINE_FORMAT_VERSION",
    "BuildInputError",
    "EngineBuildSpec",
    "build_bundle",
]


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        return getattr(importlib.import_module("inference.builder.ort_backend"), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
