"""The precision a checkpoint's weights are stored in: what ``--precision auto`` keeps on the CPU.

A GGUF checkpoint (the converted directory keeps the file as ``model.gguf``) is as precise as the
type holding most of its linear-layer weights: Q4_x files build int4, Q8_0 int8, F16/F32/BF16
fp32 (:data:`inference.build_profile.GGUF_TYPE_PRECISION`). Safetensors checkpoints build fp32:
quantizing them is the user's choice (``--precision int8|int4``).
"""

from __future__ import annotations

import functools
from collections import Counter
from pathlib import Path

import numpy as np

from inference.build_profile import GGUF_TYPE_PRECISION
from inference.builder.gguf_reader import GGUF_FILE, read_gguf_header


def native_precision(checkpoint_dir: Path) -> str:
    """``int4``, ``int8`` or ``fp32`` for the checkpoint in ``checkpoint_dir`` (reads only the
    GGUF's tensor table, memory-mapped)."""
    path = Path(checkpoint_dir) / GGUF_FILE
    try:
        stat = path.stat()
    except OSError:
        return "fp32"
    # Asked on every prepare, cache hits included: read the header once per file version.
    return _gguf_precision(str(path), stat.st_size, stat.st_mtime_ns)


@functools.lru_cache(maxsize=64)
def _gguf_precision(path: str, size: int, mtime_ns: int) -> str:
    from gguf import GGMLQuantizationType

    elements: Counter[str] = Counter()
    for tensor in read_gguf_header(Path(path)).tensors:
        # The linear layers decide; the embedding and norms are often kept at other types.
        if tensor.name.startswith("blk.") and tensor.name.endswith(".weight") and len(tensor.dims) == 2:
            elements[GGMLQuantizationType(tensor.type_id).name] += int(np.prod(tensor.dims))
    if not elements:
        return "fp32"
    dominant = elements.most_common(1)[0][0]
    return GGUF_TYPE_PRECISION.get(dominant, "fp32")
