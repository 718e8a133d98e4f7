"""The one way our engines open an ONNX Runtime session on the CPU."""

from __future__ import annotations

import os
from pathlib import Path

import onnxruntime as ort


def cpu_session(model_path: Path, *, threads: int, optimized: bool) -> ort.InferenceSession:
    """A CPU session with ``threads`` intra-op threads; a stored optimised model (``optimized``)
    skips the optimiser pass at load, which would only cost load time."""
    opts = ort.SessionOptions()
    opts.intra_op_num_threads = threads
    opts.inter_op_num_threads = 1
    opts.log_severity_level = 3
    level = ort.GraphOptimizationLevel
    opts.graph_optimization_level = level.ORT_DISABLE_ALL if optimized else level.ORT_ENABLE_EXTENDED
    return ort.InferenceSession(str(model_path), opts, providers=["CPUExecutionProvider"])


def available_cores() -> int:
    """Cores this process may run on (its affinity mask where the OS has one)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        return os.cpu_count() or 1
