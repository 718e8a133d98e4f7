"""The CUDA device the TensorRT backend would use, probed without importing anything by default.

``tensorrt_installed`` only looks for the packages (``importlib.util.find_spec``): nothing is
imported, so a process that serves with onnxruntime never loads ``tensorrt`` or ``pycuda``.
``tensorrt_missing`` and ``cuda_device`` import them; call them only when the TensorRT backend
is asked for (``--backend tensorrt`` or ``auto``).
"""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass

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
