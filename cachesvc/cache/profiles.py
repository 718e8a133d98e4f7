"""Build profiles: every build option that changes the artefact, and the keys derived from it.

A bundle is one checkpoint (plus an optional draft checkpoint) built with one profile. The
profile digest covers every field below, so two builds share a bundle exactly when they would
produce the same files. The cache layout version is part of the digest: bumping it moves every
bundle to a new key instead of serving files written by an older layout.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import re
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from cachesvc.errors import ConfigError
from inference.build_profile import (
    BACKEND_CHOICES,
    BACKENDS,
    DEFAULT_KV_CACHE_DTYPE,
    DEFAULT_MAX_BATCH_SIZE,
    DEFAULT_MAX_INPUT_LEN,
    DEFAULT_MAX_KV_CACHE_CAPACITY,
    DEFAULT_TASK,
    KERNEL_MODES,
    PRECISION_CHOICES,
    PRECISIONS,
    QUANTIZED_PRECISIONS,
    SPECULATIVE_METHODS,
    TASKS,
    ProfileError,
    check_choice,
    check_draft_model,
    check_image_limits,
    check_kv_cache_dtype,
    check_shapes,
    check_task,
)
from inference.cpu_class import CPU_CLASSES

#: Version of the on-disk bundle layout (manifest format, directory shape).
LAYOUT_VERSION = 1

__all__ = [
    "BACKENDS",
    "LAYOUT_VERSION",
    "PRECISIONS",
    "SPECULATIVE_METHODS",
    "BuildOptions",
    "BundleKey",
    "ProfileRequest",
    "bundle_id",
    "bundle_relpath",
    "is_bundle_id",
]

_DIGEST_RE = re.compile(r"^[0-9a-f]{64}$")
_BUNDLE_ID_RE = re.compile(r"^[0-9a-f]{16}-[0-9a-f]{12}$")


@dataclass(frozen=True)
class BuildOptions:
    """A build profile. ``backend`` and ``precision`` are resolved values (never ``auto``)."""

    backend: str = "onnxruntime"
    precision: str = "fp32"
    max_input_len: int = DEFAULT_MAX_INPUT_LEN
    max_batch_size: int = DEFAULT_MAX_BATCH_SIZE
    max_kv_cache_capacity: int = DEFAULT_MAX_KV_CACHE_CAPACITY
    speculative_method: str | None = None
    draft_digest: str | None = None
    builder_version: str = ""
    device_arch: str | None = None
    #: The CPU class a quantized CPU graph is written for (its int8 kernels' numerics depend on
    #: it); None for every other profile.
    cpu_class: str | None = None
    #: What the bundle is for (``generate``, or ``embed`` pooled by ``pooling``) and whether its
    #: graph takes LoRA adapters. Left out of :meth:`to_dict` (and so of the digest) at their
    #: defaults, so the bundles of profiles that never name them keep their ids.
    task: str = DEFAULT_TASK
    pooling: str | None = None
    lora: bool = False
    #: How a quantized CPU graph's kernels are chosen (``auto``, ``exact``, ``fast``: see
    #: docs/quantization.md); ``auto`` for every other profile.
    kernels: str = "auto"
    #: The K/V buffers' element type of an onnxruntime generate bundle (``fp32``/``fp16``).
    kv_cache_dtype: str = DEFAULT_KV_CACHE_DTYPE
    #: A vision-language bundle's image tokens per request and per image (None: the model's
    #: own bounds; ``inference.build_profile.image_limits``).
    max_image_tokens: int | None = None
    max_image_tokens_per_image: int | None = None

    def __post_init__(self) -> None:
        with _as_config_error():
            check_choice("kernels", self.kernels, KERNEL_MODES)
            check_kv_cache_dtype(self.kv_cache_dtype, self.backend, self.task)
            check_choice("backend", self.backend, BACKENDS)
            check_choice("precision", self.precision, PRECISIONS)
            check_task(self.task, self.pooling, self.backend, self.precision)
            if self.lora and (self.backend != "onnxruntime" or self.task != "generate"):
                raise ProfileError("lora", "LoRA adapters need a generate bundle of the onnxruntime backend")
            check_shapes(self.max_input_len, self.max_batch_size, self.max_kv_cache_capacity)
            check_image_limits(self.max_image_tokens, self.max_image_tokens_per_image, self.max_input_len)
            check_choice("speculative_method", self.speculative_method, SPECULATIVE_METHODS, optional=True)
        if self.draft_digest is not None and not _DIGEST_RE.match(self.draft_digest):
            raise ConfigError("draft_digest", "must be a 64-character lowercase hex SHA-256")
        if self.backend == "tensorrt" and not self.device_arch:
            raise ConfigError("device_arch", "is required for the tensorrt backend (e.g. 'sm90')")
        if self.backend != "tensorrt" and self.device_arch is not None:
            raise ConfigError("device_arch", "applies only to the tensorrt backend")
        keyed = self.backend == "onnxruntime" and self.precision in QUANTIZED_PRECISIONS
        if keyed and self.cpu_class not in CPU_CLASSES:
            raise ConfigError("cpu_class", f"is required for {self.precision} on the CPU; one of "
                              f"{', '.join(CPU_CLASSES)}, got {self.cpu_class!r}")
        if not keyed and self.cpu_class is not None:
            raise ConfigError("cpu_class", "applies only to int8/int4 bundles of the onnxruntime backend")
        if not keyed and self.kernels != "auto":
            raise ConfigError("kernels", f"applies only to int8/int4 bundles of the onnxruntime backend, "
                              f"not {self.backend} {self.precision}; drop --kernels or build int8/int4")

    def to_dict(self) -> dict[str, Any]:
        """The profile as a JSON-ready dict (stored in the catalog and the manifest)."""
        out = dataclasses.asdict(self)
        for name, default in _OPTIONAL_DEFAULTS.items():
            if out[name] == default:
                del out[name]
        return out

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> BuildOptions:
        """Rebuild a profile from :meth:`to_dict` output; unknown keys are rejected by name."""
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise ConfigError(unknown[0], f"unknown build option (known: {', '.join(sorted(known))})")
        return cls(**data)

    @property
    def digest(self) -> str:
        """Stable SHA-256 of the profile (and the layout version), hex."""
        payload = json.dumps(
            {"layout_version": LAYOUT_VERSION, **self.to_dict()}, sort_keys=True, separators=(",", ":")
        )
        return hashlib.sha256(payload.encode()).hexdigest()

    @property
    def name(self) -> str:
        """Readable profile name, e.g. ``i4096-b1-kv8192-none-onnxruntime-fp32-<digest12>``."""
        spec = self.speculative_method or "none"
        parts = [
            f"i{self.max_input_len}",
            f"b{self.max_batch_size}",
            f"kv{self.max_kv_cache_capacity}",
            spec,
            self.backend,
        ]
        if self.device_arch:
            parts.append(re.sub(r"[^a-z0-9]+", "", self.device_arch.lower()) or "arch")
        if self.cpu_class:
            parts.append(re.sub(r"[^a-z0-9]+", "", self.cpu_class))
        if self.task != DEFAULT_TASK:
            parts.append(f"{self.task}{self.pooling or ''}")
        if self.lora:
            parts.append("lora")
        if self.kernels != "auto":
            parts.append(f"k{self.kernels}")
        if self.kv_cache_dtype != DEFAULT_KV_CACHE_DTYPE:
            parts.append(f"kv{self.kv_cache_dtype}")
        if self.max_image_tokens is not None:
            parts.append(f"img{self.max_image_tokens}")
        if self.max_image_tokens_per_image is not None:
            parts.append(f"imgp{self.max_image_tokens_per_image}")
        parts += [self.precision, self.digest[:12]]
        return "-".join(parts)


#: Profile fields added after bundles existed: omitted from the dict (and the digest) at these
#: defaults, so every older bundle keeps its id.
_OPTIONAL_DEFAULTS: dict[str, Any] = {"task": DEFAULT_TASK, "pooling": None, "lora": False, "kernels": "auto",
                                      "kv_cache_dtype": DEFAULT_KV_CACHE_DTYPE, "max_image_tokens": None,
                                      "max_image_tokens_per_image": None}


@dataclass(frozen=True)
class ProfileRequest:
    """What a caller asks for; the manager resolves it to a :class:`BuildOptions`.

    ``backend`` and ``precision`` may be ``auto``; ``draft_model`` is a model id or directory
    whose checkpoint digest goes into the profile.
    """

    backend: str = "auto"
    precision: str = "auto"
    max_input_len: int = DEFAULT_MAX_INPUT_LEN
    max_batch_size: int = DEFAULT_MAX_BATCH_SIZE
    max_kv_cache_capacity: int = DEFAULT_MAX_KV_CACHE_CAPACITY
    speculative_method: str | None = None
    draft_model: str | None = None
    #: ``embed`` builds an embedding bundle (``pooling`` ``last`` by default, or ``mean``).
    task: str = DEFAULT_TASK
    pooling: str | None = None
    lora: bool = False
    kernels: str = "auto"
    kv_cache_dtype: str = DEFAULT_KV_CACHE_DTYPE
    #: A vision-language checkpoint's image tokens per request and per image (None: the model's).
    max_image_tokens: int | None = None
    max_image_tokens_per_image: int | None = None

    def __post_init__(self) -> None:
        with _as_config_error():
            check_choice("task", self.task, TASKS)
            check_choice("kernels", self.kernels, KERNEL_MODES)
            check_kv_cache_dtype(self.kv_cache_dtype, self.backend, self.task)
            if self.pooling is not None and self.task != "embed":
                raise ProfileError("pooling", f"applies only to task 'embed', got task {self.task!r}")
            embed_ok = self.precision in ("auto", "fp32") and self.backend != "tensorrt"
            if self.task == "embed" and not embed_ok:
                raise ProfileError("task", "task 'embed' builds fp32 on the onnxruntime backend, got "
                                   f"{self.backend}/{self.precision}")
            check_choice("backend", self.backend, BACKEND_CHOICES)
            check_choice("precision", self.precision, PRECISION_CHOICES)
            check_shapes(self.max_input_len, self.max_batch_size, self.max_kv_cache_capacity)
            check_image_limits(self.max_image_tokens, self.max_image_tokens_per_image, self.max_input_len)
            check_choice("speculative_method", self.speculative_method, SPECULATIVE_METHODS, optional=True)
        draft = self.draft_model
        if draft is not None and (not isinstance(draft, str) or not draft.strip()):
            raise ConfigError("draft_model", f"must be a non-blank model id or directory, got {draft!r}")

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready dict."""
        return dataclasses.asdict(self)

    def check_draft(self, draft_digest: str | None) -> None:
        """Raise unless the speculative method and the draft (its digest, once resolved) fit."""
        with _as_config_error():
            check_draft_model(self.speculative_method, draft_digest is not None)

    def for_draft(self) -> ProfileRequest:
        """The profile of the draft checkpoint's own bundle (``draft_model``): the same backend,
        precision and shapes, without speculation."""
        return dataclasses.replace(self, speculative_method=None, draft_model=None)


#: The fields of a build-profile request (what ``POST /admin/builds`` takes besides ``model``).
PROFILE_FIELDS: tuple[str, ...] = tuple(f.name for f in dataclasses.fields(ProfileRequest))


@contextmanager
def _as_config_error() -> Iterator[None]:
    """Report the registry's :class:`ProfileError` as the cache's :class:`ConfigError`."""
    try:
        yield
    except ProfileError as exc:
        raise ConfigError(exc.field, exc.detail) from None


def bundle_id(model_digest: str, options: BuildOptions) -> str:
    """URL-safe bundle id: ``<model-digest16>-<profile-digest12>``."""
    return f"{model_digest[:16]}-{options.digest[:12]}"


@dataclass(frozen=True)
class BundleKey:
    """Who a bundle is: the identity every layer passes around as one value.

    The catalog row, the manifest and the directory of a bundle all carry these fields.
    :meth:`of` derives them from a checkpoint digest and a resolved profile; a bundle found on
    disk is keyed by its manifest (:meth:`from_manifest`), whose profile may come from another
    builder version and so is kept as the raw mapping it was written with.
    """

    id: str
    checkpoint_digest: str
    draft_digest: str | None
    profile: dict[str, Any]
    name: str
    backend: str
    relpath: Path

    @classmethod
    def of(cls, checkpoint_digest: str, options: BuildOptions) -> BundleKey:
        """The key of ``checkpoint_digest`` built with ``options``."""
        return cls(
            id=bundle_id(checkpoint_digest, options),
            checkpoint_digest=checkpoint_digest,
            draft_digest=options.draft_digest,
            profile=options.to_dict(),
            name=options.name,
            backend=options.backend,
            relpath=bundle_relpath(checkpoint_digest, options),
        )

    @classmethod
    def from_manifest(cls, manifest: Any, relpath: Path) -> BundleKey:
        """The key a published manifest records (``relpath`` is where it was found)."""
        profile = dict(manifest.profile)
        try:
            name = BuildOptions.from_dict(profile).name
        except (ConfigError, TypeError):
            name = Path(relpath).name  # a profile this version cannot parse keeps its directory name
        return cls(
            id=manifest.bundle_id,
            checkpoint_digest=manifest.checkpoint_digest,
            draft_digest=manifest.draft_digest,
            profile=profile,
            name=name,
            backend=manifest.backend,
            relpath=Path(relpath),
        )


def is_bundle_id(value: str) -> bool:
    """True when ``value`` has the shape of a bundle id (cheap check before any lookup)."""
    return bool(_BUNDLE_ID_RE.match(value))


def bundle_relpath(model_digest: str, options: BuildOptions) -> Path:
    """Bundle directory relative to the cache root: ``engines/<model-digest16>/<profile-name>``."""
    return Path("engines") / model_digest[:16] / options.name
