"""The one way our engines open an ONNX Runtime session on the CPU."""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path

import numpy as np
import onnxruntime as ort


def cpu_session(model_path: Path, *, threads: int, optimized: bool,
                initializers: Mapping[str, np.ndarray] | None = None,
                profile_prefix: str | None = None) -> ort.InferenceSession:
    """A CPU session with ``threads`` intra-op threads; a stored optimised model (``optimized``)
    skips the optimiser pass at load, which would only cost load time. ``initializers`` (name:
    array) stand in for the graph's external ones, read from memory instead of its data file
    (the session keeps them alive). ``profile_prefix``: ONNX Runtime's profiler on, its JSON
    trace written to ``{profile_prefix}_<time>.json`` by ``end_profiling()`` (benchmarks only)."""
    opts = ort.SessionOptions()
    if profile_prefix is not None:
        opts.enable_profiling = True
        opts.profile_file_prefix = profile_prefix
    values = [ort.OrtValue.ortvalue_from_numpy(a) for a in (initializers or {}).values()]
    for name, value in zip(initializers or {}, values, strict=True):
        opts.add_initializer(name, value)
    opts.intra_op_num_threads = threads
    opts.inter_op_num_threads = 1
    opts.log_severity_level = 3
    level = ort.GraphOptimizationLevel
    opts.graph_optimization_level = level.ORT_DISABLE_ALL if optimized else level.ORT_ENABLE_EXTENDED
    session = ort.InferenceSession(str(model_path), opts, providers=["CPUExecutionProvider"])
    if values:
        session._cachesvc_initializers = values  # must outlive it
    return session


def available_cores() -> int:
    """Cores this process may run on (its affinity mask where the OS has one)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        return os.cpu_count() or 1
