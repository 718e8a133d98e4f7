"""The builder seam: how the CacheManager asks a backend to turn a checkpoint into bundle files.

The manager owns locking, staging, publishing and the catalog; a builder only writes files into
the staging directory it is given and returns engine metadata for the manifest. Builders live in
``inference.builder``; this module adapts them and keeps ``cachesvc`` importable without them.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

from cachesvc.cache.profiles import BuildOptions
from cachesvc.cache.store.layout import CacheLayout
from cachesvc.errors import BuildError, ConfigError, QualityGateError
from inference.build_profile import (
    AUTO_PRECISION,
    ProfileError,
    check_backend_precision,
    check_backend_speculative,
)

#: ``progress(stage, fraction)``; fraction in [0, 1].
ProgressFn = Callable[[str, float], None]


@dataclass(frozen=True)
class BuildJob:
    """One build a builder is asked for: write the bundle of ``checkpoint_dir`` (and of the
    draft checkpoint ``draft_dir``, None without one) under ``options`` into ``out_dir``
    (exists, empty), reporting through ``progress``."""

    checkpoint_dir: Path
    draft_dir: Path | None
    options: BuildOptions
    out_dir: Path
    progress: ProgressFn
    #: The checkpoint's content digest: keys what a builder keeps per checkpoint (the quality
    #: gate's fp32 answers); empty when the caller has none.
    checkpoint_digest: str = ""


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

    def build(self, job: BuildJob) -> dict[str, Any]:
        """Write the bundle files into ``job.out_dir``; return engine metadata."""
        ...


def _refuse_speculative(backend: str, options: BuildOptions) -> None:
    try:
        check_backend_speculative(backend, options.speculative_method)
    except ProfileError as exc:
        raise ConfigError(exc.field, f"{exc.detail}; change or drop --speculative-config") from None


class OnnxRuntimeBuilder:
    """The CPU backend: ``inference.builder.build_bundle`` (ONNX graph + ONNX Runtime).

    ``min_agreement`` is the quality gate's threshold for int8/int4 builds (None: the builder's
    documented default); ``accuracy_level`` forces the quantized layers' ``MatMulNBits``
    accuracy level instead of the CPU class's choice (tests use it to force a bad choice).
    """

    backend = "onnxruntime"

    def __init__(self, *, min_agreement: float | None = None, accuracy_level: int | None = None,
                 reference_file: Callable[[str], Path] | None = None) -> None:
        self.min_agreement = min_agreement
        self.accuracy_level = accuracy_level
        #: Where the quality gate keeps fp32's answers for a checkpoint digest
        #: (``CacheLayout.gate_reference_file``); None: computed for every quantized build.
        self.reference_file = reference_file

    @property
    def version(self) -> str:
        from inference.builder import BUILDER_VERSION

        return str(BUILDER_VERSION)

    def versions(self) -> dict[str, str]:
        import onnx
        import onnxruntime

        return {"onnx": onnx.__version__, "onnxruntime": onnxruntime.__version__, "builder": self.version}

    def build(self, job: BuildJob) -> dict[str, Any]:
        from inference.builder import EngineBuildSpec, build_bundle
        from inference.builder.kernel_plan import kernel_plan
        from inference.builder.quality import MIN_AGREEMENT
        from inference.builder.quality import QualityGateError as GateFailed
        from inference.cpu_class import cpu_class

        options = job.options

        _refuse_speculative(self.backend, options)
        if options.cpu_class is not None and options.cpu_class != cpu_class():
            raise BuildError(f"profile is for CPU class {options.cpu_class} but this CPU is {cpu_class()}")
        spec = EngineBuildSpec(
            precision=options.precision,
            max_input_len=options.max_input_len,
            max_batch_size=options.max_batch_size,
            max_kv_cache_capacity=options.max_kv_cache_capacity,
            speculative_method=options.speculative_method,
            draft_digest=options.draft_digest,
            cpu_class=options.cpu_class,
            task=options.task,
            pooling=options.pooling,
            lora=options.lora,
            kernels=options.kernels,
            kv_cache_dtype=options.kv_cache_dtype,
            max_image_tokens=options.max_image_tokens,
            max_image_tokens_per_image=options.max_image_tokens_per_image,
        )
        forced = None
        if self.accuracy_level is not None and options.cpu_class is not None:
            forced = kernel_plan(options.precision, options.cpu_class, accuracy_level=self.accuracy_level)
        threshold = MIN_AGREEMENT if self.min_agreement is None else self.min_agreement
        reference = None
        if self.reference_file is not None and job.checkpoint_digest:
            reference = self.reference_file(job.checkpoint_digest)
        try:
            return dict(build_bundle(job.checkpoint_dir, job.out_dir, spec, job.progress,
                                     kernels_override=forced, min_agreement=threshold,
                                     reference_file=reference))
        except GateFailed as exc:
            raise QualityGateError(str(exc)) from exc
        except ValueError as exc:
            raise BuildError(f"cannot build {job.checkpoint_dir}: {exc}") from exc


class TensorRTBuilder:
    """The GPU backend: ``inference.builder.trt_backend`` (the same ONNX graph -> a TensorRT plan).

    Nothing here imports ``tensorrt`` or ``pycuda`` until a property or ``build`` is used, which
    happens only once the tensorrt backend has been chosen. ``timing_cache_dir`` (the cache
    root's ``trt-timing/``) holds the timing caches shared by builds.
    """

    backend = "tensorrt"

    def __init__(self, timing_cache_dir: Path | None = None) -> None:
        self.timing_cache_dir = timing_cache_dir

    @property
    def version(self) -> str:
        """Builder version plus the TensorRT version: a plan runs only on the TensorRT that built it,
        so another TensorRT version keys (and builds) other bundles."""
        import tensorrt

        from inference.builder.trt_backend import TRT_BUILDER_VERSION

        return f"{TRT_BUILDER_VERSION}+trt{tensorrt.__version__}"

    @property
    def device_arch(self) -> str:
        """The GPU's arch tag (``sm90``); part of the profile key."""
        from inference.cuda_device import cuda_device

        return cuda_device(0).arch

    def versions(self) -> dict[str, str]:
        import onnx
        import pycuda
        import tensorrt

        from inference.cuda_device import cuda_device

        device = cuda_device(0)
        return {
            "tensorrt": str(tensorrt.__version__),
            "pycuda": str(getattr(pycuda, "VERSION_TEXT", "?")),
            "onnx": onnx.__version__,
            "gpu_name": device.name,
            "compute_capability": device.compute_capability,
            "builder": self.version,
        }

    def build(self, job: BuildJob) -> dict[str, Any]:
        from inference.builder.errors import BuildInputError
        from inference.builder.trt_backend import TrtBuildSpec, build_trt_bundle

        options = job.options

        _refuse_speculative(self.backend, options)
        if options.device_arch != self.device_arch:
            raise BuildError(f"profile is for {options.device_arch} but this GPU is {self.device_arch}")
        try:
            spec = TrtBuildSpec(
                precision=options.precision,
                max_input_len=options.max_input_len,
                max_batch_size=options.max_batch_size,
                max_kv_cache_capacity=options.max_kv_cache_capacity,
                timing_cache_dir=self.timing_cache_dir,
            )
            return dict(build_trt_bundle(job.checkpoint_dir, job.out_dir, spec, job.progress))
        except (BuildInputError, ValueError) as exc:
            raise BuildError(f"cannot build {job.checkpoint_dir}: {exc}") from exc


#: Why nothing runs on the GPU when the launch settings disable it (``CACHESVC_DISABLE_GPU``,
#: read by :mod:`cachesvc.settings.groups` and passed down as ``gpu_disabled``).
GPU_DISABLED = "the GPU is disabled by CACHESVC_DISABLE_GPU"


def tensorrt_missing(*, gpu_disabled: bool = False) -> str | None:
    """None when the tensorrt backend can run here; else what is missing, in one phrase.

    Imports tensorrt and pycuda only when both are installed (``--backend tensorrt``/``auto``).
    ``gpu_disabled``: the launch settings disable the GPU.
    """
    if gpu_disabled:
        return GPU_DISABLED
    from inference.cuda_device import tensorrt_missing as probe

    return probe()


def stale_reason(backend: str, engine: Mapping[str, Any], *, gpu_disabled: bool = False) -> str | None:
    """Why a bundle of ``backend`` whose manifest records engine metadata ``engine`` cannot be
    loaded on this node now (None: it can); the one check behind the ``stale`` state, used by
    reconcile, verify and prepare.

    Two kinds of bundle are tied to the machine. A quantized CPU bundle (int8/int4) runs the
    int8 kernels of the CPU class it was built and gated for (``kernels.cpu_class``): on
    another class its answers may differ. A TensorRT plan runs only with the TensorRT version
    that built it, on a GPU of the compute capability it was built for (the GPU's name is not in
    the profile key and may differ), and only where tensorrt, pycuda and a CUDA device answer.
    tensorrt and pycuda are imported for TensorRT bundles only. ``gpu_disabled``: the launch
    settings disable the GPU, so no TensorRT bundle runs here.
    """
    if backend == "onnxruntime":
        from inference.cpu_class import cpu_class_mismatch

        return cpu_class_mismatch(engine)
    if backend != "tensorrt":
        return None
    if gpu_disabled:
        return f"TensorRT cannot run here: {GPU_DISABLED}"
    from inference.cuda_device import plan_runs_here

    return plan_runs_here(engine)


def gpu_available(*, gpu_disabled: bool = False) -> bool:
    """True when tensorrt and pycuda import and a CUDA device answers (``--backend auto`` uses it)."""
    return tensorrt_missing(gpu_disabled=gpu_disabled) is None


def default_builders(cache_root: Path | None = None, *, gpu_disabled: bool = False) -> dict[str, Builder]:
    """The builders installed on this machine, by backend name.

    The tensorrt builder is listed when its packages are installed (found, not imported) and
    the GPU is not disabled (``gpu_disabled``); whether a GPU answers is asked only when that
    backend is chosen (:func:`resolve_backend`).
    """
    from inference.cuda_device import tensorrt_installed

    references = None if cache_root is None else CacheLayout(Path(cache_root)).gate_reference_file
    builders: dict[str, Builder] = {"onnxruntime": OnnxRuntimeBuilder(reference_file=references)}
    if tensorrt_installed() and not gpu_disabled:
        timing = None if cache_root is None else Path(cache_root) / "trt-timing"
        builders["tensorrt"] = TensorRTBuilder(timing)
    return builders


def resolve_backend(requested: str, builders: Mapping[str, Builder], *, gpu_disabled: bool = False) -> str:
    """Turn ``auto`` into a concrete backend; reject a backend that is not available here."""
    if requested == "auto":
        if "tensorrt" in builders and gpu_available(gpu_disabled=gpu_disabled):
            return "tensorrt"
        if "onnxruntime" in builders:
            return "onnxruntime"
        return next(iter(builders))
    missing = None
    # A builder injected under the name (tests) is taken as it is; the real one needs the GPU.
    injected = "tensorrt" in builders and not isinstance(builders["tensorrt"], TensorRTBuilder)
    if requested == "tensorrt" and not injected:
        missing = tensorrt_missing(gpu_disabled=gpu_disabled)
    if requested not in builders or missing is not None:
        hint = (
            f": {missing or 'no tensorrt builder was configured'} (install the [tensorrt] extra on a "
            "machine with an NVIDIA GPU)"
            if requested == "tensorrt"
            else ""
        )
        raise ConfigError(
            "backend",
            f"backend {requested!r} is not available here{hint}; available: {', '.join(sorted(builders))}",
        )
    return requested


def build_disk_bytes(checkpoint_dir: Path, options: BuildOptions) -> int | None:
    """The most disk a build of ``checkpoint_dir`` under ``options`` holds at once (a floor, from
    the checkpoint's tensor table: ``inference.builder.disk_estimate``); None when its weights
    cannot be read, which the build itself then reports."""
    from inference.builder.disk_estimate import estimate_disk
    from inference.builder.errors import BuildInputError

    try:
        estimate = estimate_disk(checkpoint_dir, backend=options.backend, precision=options.precision,
                                 task=options.task)
    except (BuildInputError, OSError, ValueError):
        return None
    return estimate.peak


def checkpoint_precision(checkpoint_dir: Path) -> str:
    """The precision a checkpoint's weights are stored in (int4 for a Q4 GGUF, int8 for Q8_0,
    else fp32): what ``auto`` builds on the CPU."""
    from inference.builder.native_precision import native_precision

    return native_precision(checkpoint_dir)


def resolve_precision(requested: str, backend: str, checkpoint_dir: Path | None = None) -> str:
    """``auto`` -> the checkpoint's own precision on the CPU (:func:`checkpoint_precision`; fp32
    without a checkpoint), fp16 on TensorRT; reject a precision the backend does not build."""
    precision = requested
    if requested == "auto":
        native = checkpoint_precision(checkpoint_dir) if checkpoint_dir is not None else None
        precision = native if backend == "onnxruntime" and native else AUTO_PRECISION[backend]
    try:
        check_backend_precision(backend, precision)
    except ProfileError as exc:
        raise ConfigError(exc.field, exc.detail) from None
    return precision
