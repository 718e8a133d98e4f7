"""The builder seam: how the CacheManager asks a backend to turn a checkpoint into bundle files.

The manager owns locking, staging, publishing and the catalog; a builder only writes files into
the staging directory it is given and returns engine metadata for the manifest. Builders live in
``inference.builder``; this module adapts them and keeps ``cachesvc`` importable without them.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

from cachesvc.errors import BuildError, ConfigError
from cachesvc.profiles import BuildOptions

#: ``progress(stage, fraction)``; fraction in [0, 1].
ProgressFn = Callable[[str, float], None]


@runtime_checkable
class Builder(Protocol):
    """A backend that writes an engine bundle into an empty directory."""

    @property
    def backend(self) -> str:
        """Backend name as used in profiles (``onnxruntime``, ``tensorrt``)."""
        ...

    @property
    def version(self) -> str:
        """Builder version; part of the profile, so a new version builds new bundles."""
        ...

    def versions(self) -> dict[str, str]:
        """Versions of the libraries that shape the artefact (recorded in the manifest)."""
        ...

    def build(
        self,
        checkpoint_dir: Path,
        draft_dir: Path | None,
        options: BuildOptions,
        out_dir: Path,
        progress: ProgressFn,
    ) -> dict[str, Any]:
        """Write the bundle files into ``out_dir`` (exists, empty); return engine metadata."""
        ...


class OnnxRuntimeBuilder:
    """The CPU backend: ``inference.builder.build_bundle`` (ONNX graph + ONNX Runtime)."""

    backend = "onnxruntime"

    @property
    def version(self) -> str:
        from inference.builder import BUILDER_VERSION

        return str(BUILDER_VERSION)

    def versions(self) -> dict[str, str]:
        import onnx
        import onnxruntime

        return {"onnx": onnx.__version__, "onnxruntime": onnxruntime.__version__, "builder": self.version}

    def build(
        self,
        checkpoint_dir: Path,
        draft_dir: Path | None,
        options: BuildOptions,
        out_dir: Path,
        progress: ProgressFn,
    ) -> dict[str, Any]:
        from inference.builder import EngineBuildSpec, build_bundle

        if options.speculative_method is not None:
            raise ConfigError(
                "--speculative-config",
                f"speculative method {options.speculative_method!r} is not supported by the onnxruntime "
                "backend yet; drop --speculative-config",
            )
        spec = EngineBuildSpec(
            precision=options.precision,
            max_input_len=options.max_input_len,
            max_batch_size=options.max_batch_size,
            max_kv_cache_capacity=options.max_kv_cache_capacity,
        )
        try:
            return dict(build_bundle(checkpoint_dir, out_dir, spec, progress))
        except ValueError as exc:
            raise BuildError(f"cannot build {checkpoint_dir}: {exc}") from exc


def gpu_available() -> bool:
    """True when TensorRT imports and a CUDA device is present (``--backend auto`` uses it)."""
    if os.environ.get("CACHESVC_DISABLE_GPU"):
        return False
    try:
        import tensorrt  # noqa: F401
        from cuda.bindings import runtime as cudart
    except Exception:
        return False
    try:
        err, count = cudart.cudaGetDeviceCount()
    except Exception:
        return False
    return int(err) == 0 and int(count) > 0


def default_builders() -> dict[str, Builder]:
    """The builders available on this machine, by backend name."""
    return {"onnxruntime": OnnxRuntimeBuilder()}


def resolve_backend(requested: str, builders: Mapping[str, Builder]) -> str:
    """Turn ``auto`` into a concrete backend; reject a backend that is not available here."""
    if requested == "auto":
        if "tensorrt" in builders and gpu_available():
            return "tensorrt"
        if "onnxruntime" in builders:
            return "onnxruntime"
        return next(iter(builders))
    if requested not in builders:
        hint = (
            " (install the [tensorrt] extra on a machine with an NVIDIA GPU)"
            if requested == "tensorrt"
            else ""
        )
        raise ConfigError(
            "--backend",
            f"backend {requested!r} is not available here{hint}; available: {', '.join(sorted(builders))}",
        )
    return requested


def resolve_precision(requested: str, backend: str) -> str:
    """``auto`` -> fp32 on the CPU, fp16 on TensorRT; reject fp16 on the CPU and int4 on TensorRT."""
    if requested == "auto":
        return "fp16" if backend == "tensorrt" else "fp32"
    if requested == "fp16" and backend == "onnxruntime":
        raise ConfigError("--precision", "fp16 needs the tensorrt backend; use fp32 or int8 on the CPU")
    if requested == "int4" and backend == "tensorrt":
        # MatMulNBits is an onnxruntime (com.microsoft) CPU op.
        raise ConfigError("--precision", "int4 is built for the onnxruntime (CPU) backend only")
    return requested
