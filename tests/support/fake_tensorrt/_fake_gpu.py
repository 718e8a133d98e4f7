"""The emulated GPU behind the fake ``tensorrt`` and ``pycuda`` modules (CPU only, for tests).

Device memory is a set of numpy byte buffers addressed by integer "device pointers"; a pointer
plus an offset resolves to its allocation, and any access past the end of an allocation is an
error (on a real GPU it would corrupt memory). Streams are queues: work enqueued on a non-null
stream runs only at ``synchronize``, so a result read before synchronizing is stale here as it
would be on a GPU. Contexts are per thread, as CUDA's are: memory calls need a current context
in the calling thread.

Environment knobs (read at call time): ``FAKE_CUDA_DEVICES`` (count, default 1),
``FAKE_CUDA_CC`` (compute capability ``major.minor``, default ``9.0``), ``FAKE_CUDA_NAME``.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

_BASE = 0x7F00_0000_0000
_ALIGN = 256
TOTAL_MEMORY = 80 * 1024**3


class FakeGpuError(RuntimeError):
    """A use of the emulated GPU that real hardware would reject or silently corrupt."""


def device_count() -> int:
    return int(os.environ.get("FAKE_CUDA_DEVICES", "1"))


def compute_capability() -> tuple[int, int]:
    major, minor = os.environ.get("FAKE_CUDA_CC", "9.0").split(".")
    return int(major), int(minor)


def device_name() -> str:
    return os.environ.get("FAKE_CUDA_NAME", "Fake NVIDIA H100 (CPU emulation)")


@dataclass
class _State:
    allocations: dict[int, np.ndarray] = field(default_factory=dict)
    next_ptr: int = _BASE
    streams: dict[int, list[Callable[[], None]]] = field(default_factory=dict)
    next_stream: int = 0x5000
    pinned: list[tuple[int, int]] = field(default_factory=list)
    lock: threading.Lock = field(default_factory=threading.Lock)


STATE = _State()
_local = threading.local()


# --- contexts (per thread) ---------------------------------------------------------------------
def context_stack() -> list[object]:
    stack: list[object] | None = getattr(_local, "stack", None)
    if stack is None:
        stack = []
        _local.stack = stack
    return stack


def require_context(what: str) -> None:
    if not context_stack():
        raise FakeGpuError(
            f"{what}: invalid device context - no currently active context in this thread "
            "(push a context in the thread that uses the GPU)"
        )


# --- device memory ------------------------------------------------------------------------------
def alloc(nbytes: int) -> int:
    if isinstance(nbytes, bool) or not isinstance(nbytes, int) or nbytes <= 0:
        raise FakeGpuError(f"mem_alloc needs a positive byte count, got {nbytes!r}")
    with STATE.lock:
        ptr = STATE.next_ptr
        STATE.allocations[ptr] = np.zeros(nbytes, dtype=np.uint8)
        STATE.next_ptr += (nbytes + _ALIGN - 1) // _ALIGN * _ALIGN + _ALIGN
    return ptr


def free(ptr: int) -> None:
    with STATE.lock:
        if STATE.allocations.pop(ptr, None) is None:
            raise FakeGpuError(f"free of {ptr:#x}, which is not a live allocation")


def view(ptr: int, nbytes: int) -> np.ndarray:
    """The bytes ``[ptr, ptr + nbytes)``; they must lie inside one live allocation."""
    with STATE.lock:
        for base, buf in STATE.allocations.items():
            if base <= ptr < base + buf.size or (nbytes == 0 and ptr == base):
                off = ptr - base
                if off + nbytes > buf.size:
                    raise FakeGpuError(
                        f"access of {nbytes} bytes at {ptr:#x} runs {off + nbytes - buf.size} bytes past "
                        f"the end of its {buf.size}-byte allocation"
                    )
                return buf[off : off + nbytes]
    raise FakeGpuError(f"device pointer {ptr:#x} is not inside any live allocation")


def live_bytes() -> int:
    with STATE.lock:
        return sum(b.size for b in STATE.allocations.values())


# --- pinned host memory ---------------------------------------------------------------------------
def register_pinned(array: np.ndarray) -> None:
    start = array.__array_interface__["data"][0]
    STATE.pinned.append((start, start + array.nbytes))


def is_pinned(array: np.ndarray) -> bool:
    start = array.__array_interface__["data"][0]
    return any(lo <= start and start + array.nbytes <= hi for lo, hi in STATE.pinned)


# --- streams ------------------------------------------------------------------------------------
def new_stream() -> int:
    with STATE.lock:
        STATE.next_stream += 1
        STATE.streams[STATE.next_stream] = []
        return STATE.next_stream


def enqueue(handle: int, work: Callable[[], None]) -> None:
    """Run ``work`` in stream order: at once on the null stream, else at ``synchronize``."""
    if handle == 0:
        work()
        return
    if handle not in STATE.streams:
        raise FakeGpuError(f"stream handle {handle:#x} is not a live stream")
    STATE.streams[handle].append(work)


def synchronize(handle: int) -> None:
    queue = STATE.streams.get(handle, [])
    while queue:
        queue.pop(0)()


def pending(handle: int) -> int:
    return len(STATE.streams.get(handle, []))
