"""The build spec: every option of the onnxruntime backend that changes the bundle.

Defaults, limits and the precisions this backend builds come from
:mod:`inference.build_profile`, the one home of the profile vocabulary.
"""

from __future__ import annotations

from dataclasses import dataclass

from inference.build_profile import (
    BACKEND_PRECISIONS,
    DEFAULT_MAX_BATCH_SIZE,
    DEFAULT_MAX_INPUT_LEN,
    DEFAULT_MAX_KV_CACHE_CAPACITY,
    ProfileError,
    check_backend_precision,
    check_shapes,
)
from inference.builder.errors import BuildInputError

SUPPORTED_PRECISIONS = BACKEND_PRECISIONS["onnxruntime"]


@dataclass(frozen=True)
class EngineBuildSpec:
    """What to build: weight precision and the shape limits the engine is built for."""

    precision: str = "fp32"
    max_input_len: int = DEFAULT_MAX_INPUT_LEN
    max_batch_size: int = DEFAULT_MAX_BATCH_SIZE
    max_kv_cache_capacity: int = DEFAULT_MAX_KV_CACHE_CAPACITY

    def __post_init__(self) -> None:
        try:
            check_backend_precision("onnxruntime", self.precision)
            check_shapes(self.max_input_len, self.max_batch_size, self.max_kv_cache_capacity)
        except ProfileError as exc:
            raise BuildInputError(str(exc)) from None
