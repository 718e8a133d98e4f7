"""A vision-language bundle's vision graph (``engine.json`` ``vision``) as a :class:`VisionModel`:
Pillow image -> pixel values (:mod:`inference.image_preprocess`) -> feature rows."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import onnxruntime as ort

from inference.build_profile import MAX_IMAGES_PER_REQUEST
from inference.image_preprocess import ClipPreprocess
from inference.runtime.errors import EngineLoadError
from inference.runtime.ort_session import cpu_session


class VisionEncoder:
    """The vision tower + projector of one bundle, in its own onnxruntime session."""

    def __init__(self, bundle_dir: Path, record: dict[str, Any], *, threads: int) -> None:
        model = Path(bundle_dir) / str(record.get("model", ""))
        if not model.is_file():
            raise EngineLoadError(f"bundle {bundle_dir} has no vision model file ({model.name}); rebuild it")
        try:
            self.image_token_id = int(record["image_token_id"])
            self.tokens_per_image = int(record["tokens_per_image"])
            self.image_size = int(record["image_size"])
            self.feature_size = int(record["feature_size"])
            self._preprocess = ClipPreprocess.from_record(record["preprocess"])
            # The profile's image-token limits (bundles built before they were recorded: the
            # model's tokens per image, and MAX_IMAGES_PER_REQUEST of them).
            self.max_image_tokens_per_image = int(record.get("max_image_tokens_per_image")
                                                  or self.tokens_per_image)
            self.max_image_tokens = int(record.get("max_image_tokens")
                                        or MAX_IMAGES_PER_REQUEST * self.max_image_tokens_per_image)
        except (KeyError, TypeError, ValueError) as exc:
            raise EngineLoadError(
                f"engine.json vision record is incomplete ({exc}); rebuild the bundle") from None
        self._session: ort.InferenceSession = cpu_session(model, threads=threads, optimized=False)

    def pixels(self, image: Any) -> np.ndarray:
        """Pixel values ``[3, image_size, image_size]`` float32 of a decoded image."""
        return self._preprocess(image)

    def encode(self, pixel_values: np.ndarray) -> np.ndarray:
        """Features ``[images, tokens_per_image, feature_size]`` of ``[images, 3, size, size]``."""
        pixel_values = np.ascontiguousarray(pixel_values, dtype=np.float32)
        expected = (3, self.image_size, self.image_size)
        if pixel_values.ndim != 4 or pixel_values.shape[1:] != expected:
            raise ValueError(f"pixel values of shape {pixel_values.shape}; the vision graph takes "
                             f"[images, {', '.join(map(str, expected))}]")
        out: np.ndarray = self._session.run(["image_features"], {"pixel_values": pixel_values})[0]
        return out
