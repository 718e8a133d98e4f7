"""What is done to embedding vectors after the engine: Matryoshka truncation."""

from __future__ import annotations

import numpy as np


def truncate(vectors: np.ndarray, dimensions: int) -> np.ndarray:
    """The leading ``dimensions`` of each unit vector, L2-normalised again (Matryoshka)."""
    cut = vectors[:, :dimensions]
    norms = np.linalg.norm(cut, axis=1, keepdims=True)
    return (cut / np.maximum(norms, 1e-12)).astype(np.float32)
