"""Write a safetensors file one tensor at a time (numpy only; no ``safetensors`` dependency).

The format is an 8-byte little-endian header length, a JSON header naming each tensor's dtype,
shape and byte range, then the raw little-endian payload. The header is written first from the
planned shapes, so tensors can be streamed in without holding the checkpoint in memory.
"""

from __future__ import annotations

import json
import struct
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType
from typing import BinaryIO

import numpy as np

from inference.builder.safetensors_reader import _DTYPES as _READER_DTYPES

#: safetensors dtype code -> numpy dtype of the payload (bf16 as raw 16-bit patterns).
DTYPES: dict[str, np.dtype] = {**_READER_DTYPES, "U8": np.dtype("u1")}


@dataclass(frozen=True)
class PlannedTensor:
    """One tensor of the file: its name, safetensors dtype code and shape."""

    name: str
    dtype: str
    shape: tuple[int, ...]

    @property
    def nbytes(self) -> int:
        return int(np.prod(self.shape, dtype=np.int64)) * DTYPES[self.dtype].itemsize


class SafetensorsWriter:
    """Writes the planned tensors, in plan order, to ``path``; ``write`` checks each one."""

    def __init__(self, path: Path, plan: Sequence[PlannedTensor], metadata: dict[str, str] | None = None):
        header: dict[str, object] = {}
        if metadata:
            header["__metadata__"] = dict(metadata)
        offset = 0
        for t in plan:
            span = [offset, offset + t.nbytes]
            header[t.name] = {"dtype": t.dtype, "shape": list(t.shape), "data_offsets": span}
            offset += t.nbytes
        raw = json.dumps(header, separators=(",", ":")).encode()
        raw += b" " * ((-len(raw)) % 8)  # the payload starts 8-byte aligned
        self._plan = list(plan)
        self._next = 0
        self._fh: BinaryIO = Path(path).open("wb")  # noqa: SIM115 (closed by close())
        self._fh.write(struct.pack("<Q", len(raw)))
        self._fh.write(raw)

    def write(self, name: str, array: np.ndarray) -> None:
        """Append the next planned tensor; its name, shape and dtype must match the plan."""
        expected = self._plan[self._next]
        arr = np.ascontiguousarray(array)
        if name != expected.name or tuple(arr.shape) != expected.shape or arr.dtype != DTYPES[expected.dtype]:
            raise ValueError(
                f"tensor {name} {arr.dtype}{list(arr.shape)} does not match the plan "
                f"({expected.name} {expected.dtype}{list(expected.shape)})"
            )
        self._fh.write(arr.tobytes())
        self._next += 1

    def close(self) -> None:
        """Close the file; raises if not every planned tensor was written."""
        self._fh.close()
        if self._next != len(self._plan):
            raise ValueError(f"wrote {self._next} of {len(self._plan)} planned tensors")

    def __enter__(self) -> SafetensorsWriter:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        if exc_type is None:
            self.close()
        else:
            self._fh.close()
