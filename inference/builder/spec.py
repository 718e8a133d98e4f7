"""The build spec: every option of the onnxruntime backend that changes the bundle."""

from __future__ import annotations

from dataclasses import dataclass

from inference.builder.errors import BuildInputError

SUPPORTED_PRECISIONS = ("fp32", "int8", "int4")


@dataclass(frozen=True)
class EngineBuildSpec:
    """What to build: weight precision and the shape limits the engine is built for."""

    precision: str = "fp32"
    max_input_len: int = 4096
    max_batch_size: int = 1
    max_kv_cache_capacity: int = 8192

    def __post_init__(self) -> None:
        if self.precision == "fp16":
            raise BuildInputError(
                "precision 'fp16' is for the tensorrt backend; the onnxruntime (CPU) backend "
                f"supports {', '.join(SUPPORTED_PRECISIONS)}"
            )
        if self.precision not in SUPPORTED_PRECISIONS:
            raise BuildInputError(
                f"unknown precision {self.precision!r}; use one of {', '.join(SUPPORTED_PRECISIONS)}"
            )
        for name in ("max_input_len", "max_batch_size", "max_kv_cache_capacity"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise BuildInputError(f"{name} must be a positive integer, got {value!r}")
        if self.max_input_len > self.max_kv_cache_capacity:
            raise BuildInputError(
                f"max_input_len ({self.max_input_len}) cannot exceed max_kv_cache_capacity "
                f"({self.max_kv_cache_capacity}); raise the capacity or lower the input length"
            )
