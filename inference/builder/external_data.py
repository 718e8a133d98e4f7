"""One weights file per bundle: let a second ONNX model point into the first one's external data.

A bundle holds the portable graph and the ONNX Runtime CPU graph; both read the same weights.
:func:`share_external_data` rewrites the second model's external initializers to reference the
bytes already stored in the first model's data file (matched by content, so renamed or reordered
initializers are found too), appends the few it lacks (page-aligned, so ONNX Runtime can still
memory-map them) and deletes the second model's own data file.
"""

from __future__ import annotations

import hashlib
import mmap
from pathlib import Path
from typing import BinaryIO

import onnx
from onnx import TensorProto

_ALIGN = 4096


def _external(tensor: TensorProto) -> dict[str, str] | None:
    if tensor.data_location != TensorProto.EXTERNAL:
        return None
    return {e.key: e.value for e in tensor.external_data}


def _set_location(tensor: TensorProto, location: str, offset: int, length: int) -> None:
    del tensor.external_data[:]
    for key, value in (("location", location), ("offset", str(offset)), ("length", str(length))):
        entry = tensor.external_data.add()
        entry.key, entry.value = key, value


def _initializers(model: onnx.ModelProto) -> list[TensorProto]:
    return list(model.graph.initializer)


def share_external_data(primary: Path, secondary: Path) -> dict[str, int]:
    """Make ``secondary`` (a model file next to ``primary``) use ``primary``'s external data file.

    Returns counts: ``shared`` tensors found in the primary data, ``appended`` tensors added to
    it, and ``bytes_appended``. The secondary's own data files are removed.
    """
    folder = primary.parent
    if secondary.parent != folder:
        raise ValueError("both models must live in the same directory")
    p_model = onnx.load(str(primary), load_external_data=False)
    locations = {e["location"] for t in _initializers(p_model) if (e := _external(t)) is not None}
    if len(locations) != 1:
        raise ValueError(
            f"{primary.name} must keep its weights in exactly one external file, has {sorted(locations)}")
    data_name = locations.pop()
    data_path = folder / data_name
    index: dict[tuple[int, bytes], int] = {}
    with data_path.open("rb") as fh, mmap.mmap(fh.fileno(), 0, access=mmap.ACCESS_READ) as mm:
        for tensor in _initializers(p_model):
            ext = _external(tensor)
            if ext is None:
                continue
            offset, length = int(ext.get("offset", 0)), int(ext["length"])
            digest = hashlib.blake2b(mm[offset:offset + length], digest_size=20).digest()
            index.setdefault((length, digest), offset)

    s_model = onnx.load(str(secondary), load_external_data=False)
    old_files: set[str] = set()
    counts = {"shared": 0, "appended": 0, "bytes_appended": 0}
    handles: dict[str, tuple[BinaryIO, mmap.mmap]] = {}
    try:
        with data_path.open("ab") as out:
            end = out.tell()
            for tensor in _initializers(s_model):
                ext = _external(tensor)
                if ext is None:
                    continue
                location = ext["location"]
                if location == data_name:
                    continue
                old_files.add(location)
                if location not in handles:
                    src = (folder / location).open("rb")
                    handles[location] = (src, mmap.mmap(src.fileno(), 0, access=mmap.ACCESS_READ))
                mm = handles[location][1]
                offset, length = int(ext.get("offset", 0)), int(ext["length"])
                payload = mm[offset:offset + length]
                key = (length, hashlib.blake2b(payload, digest_size=20).digest())
                found = index.get(key)
                if found is None:
                    pad = (-end) % _ALIGN
                    out.write(b"\0" * pad)
                    found = end + pad
                    out.write(payload)
                    end = found + length
                    index[key] = found
                    counts["appended"] += 1
                    counts["bytes_appended"] += length
                else:
                    counts["shared"] += 1
                _set_location(tensor, data_name, found, length)
    finally:
        for reader, view in handles.values():
            view.close()
            reader.close()
    onnx.save_model(s_model, str(secondary))
    for name in old_files:
        (folder / name).unlink(missing_ok=True)
    return counts
