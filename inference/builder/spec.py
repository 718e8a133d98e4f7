"""The build spec: every option of the onnxruntime backend that changes the bundle.

Defaults, limits and the precisions this backend builds come from
:mod:`inference.build_profile`, the one home of the profile vocabulary.
"""

from __future__ import annotations

from dataclasses import dataclass

from inference.build_profile import (
    BACKEND_PRECISIONS,
    DEFAULT_KV_CACHE_DTYPE,
    DEFAULT_MAX_BATCH_SIZE,
    DEFAULT_MAX_INPUT_LEN,
    DEFAULT_MAX_KV_CACHE_CAPACITY,
    DEFAULT_TASK,
    KERNEL_MODES,
    METHODS_WITH_DRAFT_BUNDLE,
    ProfileError,
    check_backend_precision,
    check_backend_speculative,
    check_image_limits,
    check_kv_cache_dtype,
    check_shapes,
    check_task,
)
from inference.builder.errors import BuildInputError
from inference.cpu_class import CPU_CLASSES

SUPPORTED_PRECISIONS = BACKEND_PRECISIONS["onnxruntime"]


@dataclass(frozen=True)
class EngineBuildSpec:
    """What to build: weight precision, the shape limits the engine is built for, and the
    speculative method (with the draft checkpoint's digest) that ``engine.json`` records for the
    runtime; the graph is the same with and without speculation."""

    precision: str = "fp32"
    max_input_len: int = DEFAULT_MAX_INPUT_LEN
    max_batch_size: int = DEFAULT_MAX_BATCH_SIZE
    max_kv_cache_capacity: int = DEFAULT_MAX_KV_CACHE_CAPACITY
    speculative_method: str | None = None
    draft_digest: str | None = None
    #: The CPU class a quantized graph is written for (None: this machine's); fp32 ignores it.
    cpu_class: str | None = None
    #: ``generate`` or ``embed`` (an embedding graph pooled by ``pooling``; fp32 only).
    task: str = DEFAULT_TASK
    pooling: str | None = None
    #: LoRA inputs on every projection (:mod:`inference.builder.lora`): adapters per request.
    lora: bool = False
    #: How a quantized graph's kernels are chosen (:data:`inference.build_profile.KERNEL_MODES`).
    kernels: str = "auto"
    #: The K/V buffers' element type (:data:`inference.build_profile.KV_CACHE_DTYPES`).
    kv_cache_dtype: str = DEFAULT_KV_CACHE_DTYPE
    #: A vision-language bundle's image tokens per request and per image (None: the model's
    #: bounds); refused for a text checkpoint, recorded in ``engine.json`` ``vision``.
    max_image_tokens: int | None = None
    max_image_tokens_per_image: int | None = None

    def __post_init__(self) -> None:
        try:
            check_backend_precision("onnxruntime", self.precision)
            check_task(self.task, self.pooling, "onnxruntime", self.precision)
            if self.task == "embed" and self.speculative_method is not None:
                raise ProfileError("speculative_method", "applies only to task 'generate'")
            if self.task == "embed" and self.lora:
                raise ProfileError("lora", "applies only to task 'generate'")
            check_shapes(self.max_input_len, self.max_batch_size, self.max_kv_cache_capacity)
            check_backend_speculative("onnxruntime", self.speculative_method)
            check_kv_cache_dtype(self.kv_cache_dtype, "onnxruntime", self.task)
            check_image_limits(self.max_image_tokens, self.max_image_tokens_per_image, self.max_input_len)
        except ProfileError as exc:
            raise BuildInputError(str(exc)) from None
        if self.kernels not in KERNEL_MODES:
            raise BuildInputError(f"kernels must be one of {', '.join(KERNEL_MODES)}, got {self.kernels!r}")
        if self.cpu_class is not None and self.cpu_class not in CPU_CLASSES:
            raise BuildInputError(
                f"cpu_class must be one of {', '.join(CPU_CLASSES)}, got {self.cpu_class!r}")
        if (self.speculative_method in METHODS_WITH_DRAFT_BUNDLE) != (self.draft_digest is not None):
            raise BuildInputError(
                f"draft_digest is required exactly for {', '.join(METHODS_WITH_DRAFT_BUNDLE)} "
                f"(speculative_method {self.speculative_method!r}, draft_digest {self.draft_digest!r})"
            )

    def speculative_record(self) -> dict[str, str] | None:
        """What ``engine.json`` records under ``speculative`` (None without speculation)."""
        if self.speculative_method is None:
            return None
        record = {"method": self.speculative_method}
        if self.draft_digest is not None:
            record["draft_digest"] = self.draft_digest
        return record
