"""One way for the builders to open a checkpoint directory's weights, whatever their format.

A directory with ``model.gguf`` (a converted GGUF, see ``gguf_convert``) is read by
``GgufCheckpoint``, which dequantizes one tensor at a time; anything else by
``SafetensorsCheckpoint``. Both answer the same questions under Hugging Face tensor names.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Protocol

import numpy as np

from inference.builder.gguf_reader import GGUF_FILE, GgufCheckpoint, RawBlocks
from inference.builder.safetensors_reader import SafetensorsCheckpoint


class CheckpointReader(Protocol):
    """What a builder reads from a checkpoint: tensor names, shapes and float32 values."""

    def __contains__(self, name: str) -> bool: ...

    def names(self) -> list[str]:
        """Every tensor name in the checkpoint."""
        ...

    def shape(self, name: str) -> tuple[int, ...]:
        """The shape of ``name``."""
        ...

    def source_dtypes(self) -> set[str]:
        """The storage types present (recorded in ``engine.json``)."""
        ...

    def get_f32(self, name: str, expected_shape: tuple[int, ...] | None = None) -> np.ndarray:
        """``name`` as a new float32 array (``BuildInputError`` when missing or of another shape)."""
        ...

    def blocks(self, name: str) -> RawBlocks | None:
        """The raw Q4_0/Q4_1/Q8_0 blocks of ``name`` when it is stored so, else None."""
        ...


def open_checkpoint(checkpoint_dir: Path) -> CheckpointReader:
    """The weights of ``checkpoint_dir``: its ``model.gguf`` if it has one, else its safetensors."""
    checkpoint_dir = Path(checkpoint_dir)
    if (checkpoint_dir / GGUF_FILE).is_file():
        return GgufCheckpoint(checkpoint_dir)
    return SafetensorsCheckpoint(checkpoint_dir)


class RenamedCheckpoint:
    """A view of part of a checkpoint under other names: ``rename`` maps a name of the view to
    the checkpoint's (None: not in the view). A vision-language checkpoint's language model is
    read through one (``language_model.model.layers.0...`` as ``model.layers.0...``), so the
    decoder graph builder reads it as it reads a text checkpoint."""

    def __init__(self, inner: CheckpointReader, rename: Callable[[str], str | None],
                 names: Iterable[str]) -> None:
        self._inner = inner
        self._rename = rename
        self._names = list(names)

    def __contains__(self, name: str) -> bool:
        real = self._rename(name)
        return real is not None and real in self._inner

    def _real(self, name: str) -> str:
        real = self._rename(name)
        # An unknown name passes through unchanged, so the inner reader's "missing" error names it.
        return name if real is None else real

    def names(self) -> list[str]:
        """The view's tensor names."""
        return list(self._names)

    def shape(self, name: str) -> tuple[int, ...]:
        """The shape of ``name``."""
        return self._inner.shape(self._real(name))

    def source_dtypes(self) -> set[str]:
        """The storage types of the whole checkpoint."""
        return self._inner.source_dtypes()

    def get_f32(self, name: str, expected_shape: tuple[int, ...] | None = None) -> np.ndarray:
        """``name`` as a new float32 array."""
        return self._inner.get_f32(self._real(name), expected_shape)

    def blocks(self, name: str) -> RawBlocks | None:
        """The raw quantized blocks of ``name`` (None for safetensors)."""
        return self._inner.blocks(self._real(name))


def prefixed_view(inner: CheckpointReader, prefixes: dict[str, str]) -> RenamedCheckpoint:
    """The tensors of ``inner`` under ``prefixes`` (view prefix -> checkpoint prefix; the longest
    view prefix that matches wins), named as in the view."""
    order = sorted(prefixes, key=len, reverse=True)

    def rename(name: str) -> str | None:
        for view in order:
            if name.startswith(view):
                return prefixes[view] + name[len(view):]
        return None

    names = []
    real_order = sorted(prefixes.items(), key=lambda kv: len(kv[1]), reverse=True)
    for real in inner.names():
        for view, src in real_order:
            if real.startswith(src):
                names.append(view + real[len(src):])
                break
    return RenamedCheckpoint(inner, rename, names)
