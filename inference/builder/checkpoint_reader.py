"""One way for the builders to open a checkpoint directory's weights, whatever their format.

A directory with ``model.gguf`` (a converted GGUF, see ``gguf_convert``) is read by
``GgufCheckpoint``, which dequantizes one tensor at a time; anything else by
``SafetensorsCheckpoint``. Both answer the same questions under Hugging Face tensor names.
"""

from __future__ import annotations

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
