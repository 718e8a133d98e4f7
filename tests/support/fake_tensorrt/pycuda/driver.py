"""Fake ``pycuda.driver`` (tests only), following pycuda's documented API and its rules.

Rules enforced (each one a real failure on a GPU): ``init()`` before ``Device``; a current
context in the calling thread for every memory call (contexts are per thread); copies stay
inside their allocations; ``*_async`` copies use page-locked host memory (``pagelocked_empty``)
and complete only when their stream is synchronized. The pinned-memory rule is stricter than
CUDA, which accepts pageable memory but then silently copies synchronously.
"""

from __future__ import annotations

import builtins
from typing import Any

import _fake_gpu as gpu
import numpy as np

_initialized = False


class Error(Exception):
    """Base of pycuda's errors."""


class LogicError(Error):
    """A call made in the wrong state (pycuda._driver.LogicError)."""


class RuntimeError(Error, builtins.RuntimeError):
    """A driver call that failed (pycuda._driver.RuntimeError)."""


def init(flags: int = 0) -> None:
    """cuInit: fails like the real one when no device is present."""
    global _initialized
    if gpu.device_count() < 1:
        raise RuntimeError("cuInit failed: no CUDA-capable device is detected")
    _initialized = True


def _require_init() -> None:
    if not _initialized:
        raise LogicError("cuInit context has not been called; call pycuda.driver.init() first")


def _require_context(what: str) -> None:
    try:
        gpu.require_context(what)
    except gpu.FakeGpuError as exc:
        raise LogicError(f"explicit_context_dependent failed: {exc}") from None


class Context:
    """A CUDA context; current per thread."""

    def __init__(self, device: Device) -> None:
        self._device = device
        self._detached = False

    def push(self) -> None:
        if self._detached:
            raise LogicError("cannot push a detached context")
        gpu.context_stack().append(self)

    @staticmethod
    def pop() -> None:
        stack = gpu.context_stack()
        if not stack:
            raise LogicError("context stack is empty in this thread")
        stack.pop()

    def detach(self) -> None:
        stack = gpu.context_stack()
        if self in stack:
            raise LogicError("detach of a context that is still current; pop it first")
        self._detached = True

    @staticmethod
    def synchronize() -> None:
        _require_context("Context.synchronize")
        for handle in list(gpu.STATE.streams):
            gpu.synchronize(handle)

    @staticmethod
    def get_device() -> Device:
        _require_context("Context.get_device")
        ctx = gpu.context_stack()[-1]
        assert isinstance(ctx, Context)
        return ctx._device


class Device:
    """One CUDA device."""

    def __init__(self, ordinal: int) -> None:
        _require_init()
        if not isinstance(ordinal, int) or not 0 <= ordinal < gpu.device_count():
            raise LogicError(f"cuDeviceGet failed: invalid device ordinal {ordinal!r}")
        self.ordinal = ordinal

    @staticmethod
    def count() -> int:
        _require_init()
        return gpu.device_count()

    def name(self) -> str:
        return gpu.device_name()

    def compute_capability(self) -> tuple[int, int]:
        return gpu.compute_capability()

    def total_memory(self) -> int:
        return gpu.TOTAL_MEMORY

    def make_context(self, flags: int = 0) -> Context:
        ctx = Context(self)
        ctx.push()
        return ctx

    def retain_primary_context(self) -> Context:
        return Context(self)


class DeviceAllocation:
    """Device memory; ``int()`` gives the device pointer."""

    def __init__(self, nbytes: int) -> None:
        self._ptr: int | None = gpu.alloc(nbytes)
        self.size = nbytes

    def __int__(self) -> int:
        if self._ptr is None:
            raise LogicError("use of a freed DeviceAllocation")
        return self._ptr

    __index__ = __int__

    def free(self) -> None:
        if self._ptr is not None:
            _require_context("DeviceAllocation.free")
            gpu.free(self._ptr)
            self._ptr = None


def mem_alloc(nbytes: int) -> DeviceAllocation:
    _require_context("mem_alloc")
    return DeviceAllocation(nbytes)


def mem_get_info() -> tuple[int, int]:
    _require_context("mem_get_info")
    return gpu.TOTAL_MEMORY - gpu.live_bytes(), gpu.TOTAL_MEMORY


def pagelocked_empty(shape: Any, dtype: Any, order: str = "C", mem_flags: int = 0) -> np.ndarray:
    _require_context("pagelocked_empty")
    array = np.empty(shape, dtype=dtype, order=order)  # type: ignore[call-overload]
    gpu.register_pinned(array)
    return array


class Stream:
    """A CUDA stream; ``handle`` is what TensorRT's ``execute_async_v3`` takes."""

    def __init__(self, flags: int = 0) -> None:
        _require_context("Stream")
        self.handle = gpu.new_stream()

    def synchronize(self) -> None:
        _require_context("Stream.synchronize")
        gpu.synchronize(self.handle)

    def is_done(self) -> bool:
        return gpu.pending(self.handle) == 0


def _ptr(dev: Any) -> int:
    if isinstance(dev, DeviceAllocation | int) and not isinstance(dev, bool):
        return int(dev)
    raise TypeError(f"expected a device pointer (DeviceAllocation or int), got {type(dev).__name__}")


def _host(array: Any, what: str, pinned: bool) -> np.ndarray:
    if not isinstance(array, np.ndarray):
        raise TypeError(f"{what}: host side must be a numpy array, got {type(array).__name__}")
    if not array.flags.c_contiguous:
        raise LogicError(f"{what}: host array must be contiguous")
    if pinned and not gpu.is_pinned(array):
        raise LogicError(f"{what}: host array is pageable; async copies need pagelocked_empty() memory")
    return array


def _handle(stream: Stream | None) -> int:
    return 0 if stream is None else stream.handle


def memcpy_htod(dest: Any, src: np.ndarray) -> None:
    _require_context("memcpy_htod")
    host = _host(src, "memcpy_htod", pinned=False)
    gpu.view(_ptr(dest), host.nbytes)[:] = host.reshape(-1).view(np.uint8)


def memcpy_dtoh(dest: np.ndarray, src: Any) -> None:
    _require_context("memcpy_dtoh")
    host = _host(dest, "memcpy_dtoh", pinned=False)
    host.reshape(-1).view(np.uint8)[:] = gpu.view(_ptr(src), host.nbytes)


def memcpy_htod_async(dest: Any, src: np.ndarray, stream: Stream | None = None) -> None:
    _require_context("memcpy_htod_async")
    host = _host(src, "memcpy_htod_async", pinned=True)
    ptr = _ptr(dest)
    gpu.view(ptr, host.nbytes)  # bounds are checked at enqueue time, like the driver does

    def work() -> None:
        gpu.view(ptr, host.nbytes)[:] = host.reshape(-1).view(np.uint8)

    gpu.enqueue(_handle(stream), work)


def memcpy_dtoh_async(dest: np.ndarray, src: Any, stream: Stream | None = None) -> None:
    _require_context("memcpy_dtoh_async")
    host = _host(dest, "memcpy_dtoh_async", pinned=True)
    ptr = _ptr(src)
    gpu.view(ptr, host.nbytes)

    def work() -> None:
        host.reshape(-1).view(np.uint8)[:] = gpu.view(ptr, host.nbytes)

    gpu.enqueue(_handle(stream), work)


def memcpy_dtod_async(dest: Any, src: Any, size: int, stream: Stream | None = None) -> None:
    _require_context("memcpy_dtod_async")
    d, s = _ptr(dest), _ptr(src)
    gpu.view(d, size)
    gpu.view(s, size)

    def work() -> None:
        gpu.view(d, size)[:] = gpu.view(s, size).copy()

    gpu.enqueue(_handle(stream), work)


def memset_d8_async(dest: Any, data: int, count: int, stream: Stream | None = None) -> None:
    _require_context("memset_d8_async")
    d = _ptr(dest)
    gpu.view(d, count)

    def work() -> None:
        gpu.view(d, count)[:] = data

    gpu.enqueue(_handle(stream), work)
