"""The CUDA device the TensorRT backend would use, probed without importing anything by default.

``tensorrt_installed`` only looks for the packages (``importlib.util.find_spec``): nothing is
imported, so a process that serves with onnxruntime never loads ``tensorrt`` or ``pycuda``.
``tensorrt_missing`` and ``cuda_device`` import them; call them only when the TensorRT backend
is asked for (``--backend tensorrt`` or ``auto``).
"""

from __future__ import annotations

import importlib.util
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

#: The Python packages the TensorRT backend needs (the ``[tensorrt]`` extra).
PACKAGES = ("tensorrt", "pycuda")


@dataclass(frozen=True)
class CudaDevice:
    """Facts about one CUDA device that decide whether a TensorRT plan can run on it."""

    ordinal: int
    name: str
    compute_capability: str  # "9.0"
    total_memory: int

    @property
    def arch(self) -> str:
        """The arch tag used in profile keys, e.g. ``sm90``."""
        return "sm" + self.compute_capability.replace(".", "")


def tensorrt_installed() -> bool:
    """True when both packages can be found; imports neither."""
    return all(importlib.util.find_spec(name) is not None for name in PACKAGES)


def cuda_device(ordinal: int = 0) -> CudaDevice:
    """Probe device ``ordinal`` through pycuda; raises when there is none."""
    import pycuda.driver as cuda

    cuda.init()
    dev = cuda.Device(ordinal)
    major, minor = dev.compute_capability()
    return CudaDevice(ordinal, str(dev.name()), f"{major}.{minor}", int(dev.total_memory()))


def tensorrt_missing() -> str | None:
    """None when tensorrt and pycuda import and a CUDA device answers; else what is missing, in words."""
    absent = [name for name in PACKAGES if importlib.util.find_spec(name) is None]
    if absent:
        return " and ".join(f"the Python package {name!r} is not installed" for name in absent)
    for name in ("tensorrt", "pycuda.driver"):
        try:
            importlib.import_module(name)
        except Exception as exc:
            return f"{name} does not import ({type(exc).__name__}: {exc})"
    try:
        cuda_device(0)
    except Exception as exc:
        return f"no CUDA device answers ({type(exc).__name__}: {exc})"
    return None


def plan_mismatch(meta: Mapping[str, Any], tensorrt_version: str, device: CudaDevice) -> str | None:
    """Why a TensorRT plan whose ``engine.json`` is ``meta`` cannot run with ``tensorrt_version``
    on ``device`` (None: it can). The one rule: a plan runs only on the TensorRT version that
    built it and on a GPU of the compute capability it was built for (the GPU's name may differ)."""
    built_with = str(meta.get("tensorrt_version"))
    if built_with != tensorrt_version:
        return (
            f"bundle was built with TensorRT {built_with} but this process runs {tensorrt_version}; "
            "a plan runs only on the TensorRT version that built it"
        )
    if str(meta.get("compute_capability")) != device.compute_capability:
        return (
            f"bundle was built for compute capability {meta.get('compute_capability')} "
            f"({meta.get('gpu_name')}); this GPU is {device.name} ({device.compute_capability})"
        )
    return None


def plan_runs_here(meta: Mapping[str, Any]) -> str | None:
    """None when the plan ``meta`` describes can run on this machine now; else why not (no
    tensorrt/pycuda, no CUDA device, another TensorRT version or compute capability).

    Imports tensorrt and pycuda: call it only for TensorRT bundles."""
    missing = tensorrt_missing()
    if missing is not None:
        return f"TensorRT cannot run here: {missing}"
    import tensorrt

    return plan_mismatch(meta, str(tensorrt.__version__), cuda_device(0))
