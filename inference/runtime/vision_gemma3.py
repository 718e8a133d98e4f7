"""Gemma 3's vision side at run time (``engine.json`` ``vision.family`` "gemma3"): one fixed-size
image -> ``<start_of_image>``, ``rows_per_image`` image tokens, ``<end_of_image>``.

Gemma3Processor writes ``"\\n\\n"`` on either side of that sequence into the text before it
tokenizes, and the newlines merge with the text around them (``"user\\n"`` + ``"\\n\\n"`` is one
pre-token), so they cannot be a fixed run of token ids: :meth:`Gemma3VisionEncoder.prompt_text`
writes them around each placeholder in the rendered prompt, and the placeholder token (the chat
template's ``<start_of_image>``, a special token: the text on its either side is tokenized
apart) is then replaced by :meth:`fixed_tokens`. The ids equal the processor's.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from inference.images.preprocess import ClipPreprocess
from inference.runtime.protocol import PreparedImage
from inference.runtime.vision_encoder import VisionSession


class Gemma3VisionEncoder(VisionSession):
    """SigLIP + Gemma 3's projector; images attend to themselves both ways (``whole_images``)."""

    whole_images = True

    def _read(self, record: Mapping[str, Any]) -> None:
        self.rows = int(record["rows_per_image"])
        self.image_size = int(record["image_size"])
        self.end_id = int(record["end_id"])
        self.placeholder_text = str(record["placeholder_text"])
        self.text_around = str(record["text_around"])
        if not self.placeholder_text:
            raise ValueError("placeholder_text is empty")
        self._preprocess = ClipPreprocess.from_record(record["preprocess"])
        #: prompt tokens of every image: its rows and the two markers
        self.tokens_per_image = self.rows + 2

    def fixed_tokens(self) -> tuple[int, ...]:
        """``<start_of_image>``, the image tokens, ``<end_of_image>``."""
        return (self.placeholder_id, *(self.image_token_id,) * self.rows, self.end_id)

    def prompt_text(self, text: str) -> str:
        """``text`` with ``"\\n\\n"`` around each placeholder, as Gemma3Processor's expansion has it."""
        around = self.text_around
        return text.replace(self.placeholder_text, around + self.placeholder_text + around)

    def pixels(self, image: Any) -> np.ndarray:
        """Pixel values ``[3, image_size, image_size]`` float32 of a decoded image."""
        return self._preprocess(image)

    def prepare(self, image: Any) -> PreparedImage:
        return PreparedImage(inputs={"pixel_values": self.pixels(image)[None]}, tokens=self.fixed_tokens(),
                             image_token_id=self.image_token_id)

    def encode(self, pixel_values: np.ndarray) -> np.ndarray:
        """Features ``[images, rows_per_image, feature_size]`` of ``[images, 3, size, size]``."""
        pixel_values = np.ascontiguousarray(pixel_values, dtype=np.float32)
        expected = (3, self.image_size, self.image_size)
        if pixel_values.ndim != 4 or pixel_values.shape[1:] != expected:
            raise ValueError(f"pixel values of shape {pixel_values.shape}; the vision graph takes "
                             f"[images, {', '.join(map(str, expected))}]")
        return self.run({"pixel_values": pixel_values})

    def features(self, images: Sequence[PreparedImage]) -> list[np.ndarray]:
        """All images in one run (they share one shape)."""
        if not images:
            return []
        out = self.encode(np.concatenate([im.inputs["pixel_values"] for im in images]))
        return [out[i] for i in range(len(images))]
