"""Idefics3's and SmolVLM's vision side (``engine.json`` ``vision.family`` idefics3 / smolvlm): an
image -> its frames (tiles row-major, then the global image) and its prompt tokens (the tile
markers around ``image_seq_len`` image tokens a frame) -> the connector's rows of every frame,
in the order their tokens appear."""

from __future__ import annotations

import itertools
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from inference.images.idefics3 import TilePreprocess, TilePrompt
from inference.runtime.protocol import PreparedImage
from inference.runtime.vision_encoder import VisionSession

#: Frames per run of the vision graph: a SigLIP-base tile at 512 pixels holds ~50 MB of attention
#: scores, so a 4x4-tiled image's 17 frames run in five runs, not one of ~0.8 GB.
FRAMES_PER_RUN = 4


class TiledVisionEncoder(VisionSession):
    """An image of any size -> ``rows x cols`` tiles plus the global image, each tile
    ``tokens_per_tile`` feature rows; ``tokens_per_image`` None (it follows the image's size)."""

    def _read(self, record: Mapping[str, Any]) -> None:
        self.image_size = int(record["image_size"])
        self.tokens_per_tile = int(record["tokens_per_tile"])
        self._preprocess = TilePreprocess.from_record(record["preprocess"])
        self._prompt = TilePrompt.from_record(record["prompt"])
        if self._prompt.image != self.image_token_id or self._prompt.tokens_per_tile != self.tokens_per_tile:
            raise ValueError("vision.prompt disagrees with the image token or tokens_per_tile")

    def fixed_tokens(self) -> tuple[int, ...]:
        """Refused: the tokens follow the image's size (:meth:`prepare`)."""
        raise ValueError("this model's images take a number of tokens that depends on their size")

    def prepare(self, image: Any) -> PreparedImage:
        """The image's frames ``[tiles, 3, size, size]`` and its prompt tokens."""
        frames, rows, cols = self._preprocess(image)
        return PreparedImage(inputs={"pixel_values": frames}, tokens=self._prompt.tokens(rows, cols),
                             image_token_id=self.image_token_id)

    def encode(self, pixel_values: np.ndarray) -> np.ndarray:
        """Features ``[frames, tokens_per_tile, feature_size]`` of ``[frames, 3, size, size]``, in
        runs of at most :data:`FRAMES_PER_RUN` frames."""
        pixel_values = np.ascontiguousarray(pixel_values, dtype=np.float32)
        expected = (3, self.image_size, self.image_size)
        if pixel_values.ndim != 4 or pixel_values.shape[1:] != expected:
            raise ValueError(f"pixel values of shape {pixel_values.shape}; the vision graph takes "
                             f"[frames, {', '.join(map(str, expected))}]")
        runs = [self.run({"pixel_values": pixel_values[i:i + FRAMES_PER_RUN]})
                for i in range(0, len(pixel_values), FRAMES_PER_RUN)]
        if not runs:
            return np.zeros((0, self.tokens_per_tile, self.feature_size), np.float32)
        return np.concatenate(runs)

    def features(self, images: Sequence[PreparedImage]) -> list[np.ndarray]:
        """Each image's rows ``[frames * tokens_per_tile, feature_size]`` (all frames of all
        images through the graph together)."""
        if not images:
            return []
        counts = [len(im.inputs["pixel_values"]) for im in images]
        out = self.encode(np.concatenate([im.inputs["pixel_values"] for im in images]))
        bounds = np.cumsum([0, *counts]).tolist()
        return [out[a:b].reshape(-1, self.feature_size) for a, b in itertools.pairwise(bounds)]
