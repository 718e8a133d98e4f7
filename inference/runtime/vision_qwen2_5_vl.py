"""Qwen2.5-VL's vision side (``engine.json`` ``vision.family`` ``qwen2_5_vl``): an image becomes
its patches and the window/rotary arrays of its grid (:mod:`inference.images.qwen2_5_vl`), one
vision-graph run gives its merged rows; its prompt tokens are that many image tokens, and its
grid sets the language model's multimodal positions (:attr:`PreparedImage.grid`)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from inference.images.qwen2_5_vl import QwenPreprocess, VisionGeometry, graph_inputs
from inference.runtime.protocol import PreparedImage
from inference.runtime.vision_encoder import VisionSession


class QwenVisionEncoder(VisionSession):
    """Dynamic resolution: an image of ``grid_h x grid_w`` patches takes ``grid_h * grid_w /
    merge**2`` tokens (``tokens_per_image`` None); the chat template's placeholder is the image
    token itself, repeated."""

    def _read(self, record: Mapping[str, Any]) -> None:
        self._preprocess = QwenPreprocess.from_record(record["preprocess"])
        self._geometry = VisionGeometry.from_record(record["geometry"])

    def fixed_tokens(self) -> tuple[int, ...]:
        raise ValueError("a Qwen2.5-VL image takes a number of tokens that depends on its size")

    def prepare(self, image: Any) -> PreparedImage:
        """The image's vision-graph inputs, its image tokens and the grid of its rows."""
        patches, (grid_h, grid_w) = self._preprocess(image)
        merge = self._preprocess.merge_size
        rows = grid_h * grid_w // (merge * merge)
        return PreparedImage(inputs=graph_inputs(patches, (grid_h, grid_w), self._geometry),
                             tokens=(self.image_token_id,) * rows, image_token_id=self.image_token_id,
                             grid=(1, grid_h // merge, grid_w // merge))

    def features(self, images: Sequence[PreparedImage]) -> list[np.ndarray]:
        """One graph run per image (their sizes differ)."""
        return [self.run(im.inputs) for im in images]
