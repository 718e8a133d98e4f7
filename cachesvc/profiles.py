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
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from cachesvc.errors import ConfigError

#: Version of the on-disk bundle layout (manifest format, directory shape).
LAYOUT_VERSION = 1

BACKENDS = ("onnxruntime", "tensorrt")
PRECISIONS = ("fp32", "fp16", "int8", "int4")
SPECULATIVE_METHODS = ("eagle3", "mtp", "dflash", "jetspec", "dspark")

_DIGEST_RE = re.compile(r"^[0-9a-f]{64}$")
_BUNDLE_ID_RE = re.compile(r"^[0-9a-f]{16}-[0-9a-f]{12}$")


@dataclass(frozen=True)
class BuildOptions:
    """A build profile. ``backend`` and ``precision`` are resolved values (never ``auto``)."""

    backend: str = "onnxruntime"
    precision: str = "fp32"
    max_input_len: int = 4096
    max_batch_size: int = 1
    max_kv_cache_capacity: int = 8192
    speculative_method: str | None = None
    draft_digest: str | None = None
    builder_version: str = ""
    device_arch: str | None = None

    def __post_init__(self) -> None:
        if self.backend not in BACKENDS:
            raise ConfigError("backend", f"must be one of {', '.join(BACKENDS)}, got {self.backend!r}")
        if self.precision not in PRECISIONS:
            raise ConfigError("precision", f"must be one of {', '.join(PRECISIONS)}, got {self.precision!r}")
        for name in ("max_input_len", "max_batch_size", "max_kv_cache_capacity"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise ConfigError(name, f"must be a positive integer, got {value!r}")
        if self.max_input_len > self.max_kv_cache_capacity:
            raise ConfigError(
                "max_input_len",
                f"({self.max_input_len}) must not exceed max_kv_cache_capacity "
                f"({self.max_kv_cache_capacity})",
            )
        if self.speculative_method is not None and self.speculative_method not in SPECULATIVE_METHODS:
            raise ConfigError(
                "speculative_method",
                f"must be one of {', '.join(SPECULATIVE_METHODS)} or null, got {self.speculative_method!r}",
            )
        if self.draft_digest is not None and not _DIGEST_RE.match(self.draft_digest):
            raise ConfigError("draft_digest", "must be a 64-character lowercase hex SHA-256")
        if self.backend == "tensorrt" and not self.device_arch:
            raise ConfigError("device_arch", "is required for the tensorrt backend (e.g. 'sm90')")
        if self.backend != "tensorrt" and self.device_arch is not None:
            raise ConfigError("device_arch", "applies only to the tensorrt backend")

    def to_dict(self) -> dict[str, Any]:
        """The profile as a JSON-ready dict (stored in the catalog and the manifest)."""
        return dataclasses.asdict(self)

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
        parts += [self.precision, self.digest[:12]]
        return "-".join(parts)


@dataclass(frozen=True)
class ProfileRequest:
    """What a caller asks for; the manager resolves it to a :class:`BuildOptions`.

    ``backend`` and ``precision`` may be ``auto``; ``draft_model`` is a model id or directory
    whose checkpoint digest goes into the profile.
    """

    backend: str = "auto"
    precision: str = "auto"
    max_input_len: int = 4096
    max_batch_size: int = 1
    max_kv_cache_capacity: int = 8192
    speculative_method: str | None = None
    draft_model: str | None = None

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready dict."""
        return dataclasses.asdict(self)


def bundle_id(model_digest: str, options: BuildOptions) -> str:
    """URL-safe bundle id: ``<model-digest16>-<profile-digest12>``."""
    return f"{model_digest[:16]}-{options.digest[:12]}"


def is_bundle_id(value: str) -> bool:
    """True when ``value`` has the shape of a bundle id (cheap check before any lookup)."""
    return bool(_BUNDLE_ID_RE.match(value))


def bundle_relpath(model_digest: str, options: BuildOptions) -> Path:
    """Bundle directory relative to the cache root: ``engines/<model-digest16>/<profile-name>``."""
    return Path("engines") / model_digest[:16] / options.name
