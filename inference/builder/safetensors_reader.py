"""Read safetensors shards lazily with numpy, including bf16 (which safetensors' numpy API refuses).

Only the JSON header is parsed up front; each tensor is memory-mapped on request, so a
checkpoint is never held in memory all at once.
"""

from __future__ import annotations

import json
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from inference.builder.errors import BuildInputError

if TYPE_CHECKING:
    from inference.builder.gguf_reader import RawBlocks

INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"
# Headers of real checkpoints are kilobytes; anything this large means a corrupt length field.
_MAX_HEADER_BYTES = 100 * 1024 * 1024

_DTYPES: dict[str, np.dtype] = {
    "F32": np.dtype("<f4"),
    "F16": np.dtype("<f2"),
    "BF16": np.dtype("<u2"),
}


@dataclass(frozen=True)
class TensorEntry:
    """Where one tensor's bytes live inside a shard."""

    file: Path
    dtype: str
    shape: tuple[int, ...]
    start: int  # absolute byte offset in the file
    end: int


def _read_header(path: Path) -> dict[str, TensorEntry]:
    size = path.stat().st_size
    with path.open("rb") as fh:
        raw_len = fh.read(8)
        if len(raw_len) < 8:
            raise BuildInputError(f"safetensors file {path.name} is truncated (no header); re-download it")
        (header_len,) = struct.unpack("<Q", raw_len)
        if header_len > _MAX_HEADER_BYTES or 8 + header_len > size:
            raise BuildInputError(
                f"safetensors file {path.name} is truncated or corrupt (header of {header_len} bytes "
                f"in a {size}-byte file); re-download it"
            )
        try:
            header = json.loads(fh.read(header_len))
        except ValueError as exc:
            raise BuildInputError(f"safetensors file {path.name} has an unreadable header: {exc}") from exc
    base = 8 + header_len
    entries: dict[str, TensorEntry] = {}
    for name, meta in header.items():
        if name == "__metadata__":
            continue
        dtype = meta["dtype"]
        begin, end = meta["data_offsets"]
        shape = tuple(int(d) for d in meta["shape"])
        entries[name] = TensorEntry(path, dtype, shape, base + begin, base + end)
        if base + end > size:
            raise BuildInputError(
                f"safetensors file {path.name} is truncated: tensor {name!r} ends at byte {base + end} "
                f"but the file has {size} bytes; re-download it"
            )
    return entries


class SafetensorsCheckpoint:
    """All tensors of a checkpoint directory (index file, single file, or every *.safetensors)."""

    def __init__(self, checkpoint_dir: Path) -> None:
        self.dir = checkpoint_dir
        index = checkpoint_dir / INDEX_FILE
        if index.is_file():
            weight_map = json.loads(index.read_text())["weight_map"]
            files = sorted({checkpoint_dir / name for name in weight_map.values()})
        elif (checkpoint_dir / SINGLE_FILE).is_file():
            files = [checkpoint_dir / SINGLE_FILE]
        else:
            files = sorted(checkpoint_dir.glob("*.safetensors"))
        if not files:
            raise BuildInputError(
                f"no safetensors weights in {checkpoint_dir} (expected {SINGLE_FILE} or {INDEX_FILE}); "
                "only safetensors checkpoints are supported"
            )
        self._entries: dict[str, TensorEntry] = {}
        for path in files:
            if not path.is_file():
                raise BuildInputError(f"weight shard {path.name} named in {INDEX_FILE} is missing")
            self._entries.update(_read_header(path))
        self.files = tuple(files)

    @classmethod
    def from_file(cls, path: Path) -> SafetensorsCheckpoint:
        """The tensors of one safetensors file, whatever its name."""
        ckpt = cls.__new__(cls)
        ckpt.dir = path.parent
        ckpt._entries = _read_header(path)
        ckpt.files = (path,)
        return ckpt

    def __contains__(self, name: str) -> bool:
        return name in self._entries

    def names(self) -> list[str]:
        """Every tensor name in the checkpoint."""
        return list(self._entries)

    def shape(self, name: str) -> tuple[int, ...]:
        """The stored shape of ``name``."""
        return self._entry(name).shape

    def source_dtypes(self) -> set[str]:
        """The safetensors dtype codes present (F32, F16, BF16, ...)."""
        return {e.dtype for e in self._entries.values()}

    def _entry(self, name: str) -> TensorEntry:
        try:
            return self._entries[name]
        except KeyError:
            raise BuildInputError(
                f"missing weight {name!r} in {self.dir}; the checkpoint is incomplete or not of the "
                "architecture its config.json names"
            ) from None

    def get_f32(self, name: str, expected_shape: tuple[int, ...] | None = None) -> np.ndarray:
        """Load ``name`` as a float32 array (bf16/fp16 widened), checking its shape first."""
        entry = self._entry(name)
        if expected_shape is not None and entry.shape != tuple(expected_shape):
            raise BuildInputError(
                f"weight {name!r} has shape {list(entry.shape)}, expected {list(expected_shape)} "
                "from config.json; the config and the weights do not match"
            )
        np_dtype = _DTYPES.get(entry.dtype)
        if np_dtype is None:
            raise BuildInputError(
                f"weight {name!r} is stored as {entry.dtype}; supported storage types are "
                f"{', '.join(_DTYPES)} (quantized checkpoints are not supported)"
            )
        count = int(np.prod(entry.shape, dtype=np.int64))
        if entry.end - entry.start != count * np_dtype.itemsize:
            raise BuildInputError(
                f"weight {name!r} in {entry.file.name} has {entry.end - entry.start} bytes, expected "
                f"{count * np_dtype.itemsize} for shape {list(entry.shape)} {entry.dtype}; "
                "the file is corrupt"
            )
        raw = np.memmap(entry.file, dtype=np_dtype, mode="r", offset=entry.start, shape=(count,))
        if entry.dtype == "BF16":
            # bf16 is the top half of an fp32: shifting the 16-bit pattern up is exact.
            out = (raw.astype(np.uint32) << 16).view(np.float32)
        else:
            out = raw.astype(np.float32)
        return out.reshape(entry.shape)

    def blocks(self, name: str) -> RawBlocks | None:
        """Always None: safetensors holds no GGUF blocks (the surface shared with ``GgufCheckpoint``)."""
        self._entry(name)  # a missing name fails here as it does in the GGUF reader
        return None

    def get_raw(self, name: str) -> np.ndarray:
        """Memory-map a ``U8`` tensor as stored (e.g. raw quantized blocks)."""
        entry = self._entry(name)
        if entry.dtype != "U8":
            raise BuildInputError(f"tensor {name!r} is {entry.dtype}, not raw bytes (U8)")
        count = int(np.prod(entry.shape, dtype=np.int64))
        if entry.end - entry.start != count:
            raise BuildInputError(
                f"tensor {name!r} in {entry.file.name} has the wrong byte count; the file is corrupt"
            )
        return np.memmap(entry.file, dtype=np.uint8, mode="r", offset=entry.start, shape=entry.shape)
