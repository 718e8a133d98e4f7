"""A vision-language bundle's vision graph (``engine.json`` ``vision``) as a :class:`VisionModel`:
Pillow image -> :class:`PreparedImage` (:mod:`inference.images.preprocess`) -> feature rows.

One encoder class per kind of vision side, chosen by the record's ``family``
(:func:`load_vision`); each reads the fields its builder wrote and refuses an incomplete record
with "rebuild the bundle"."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import onnxruntime as ort

from inference.build_profile import MAX_IMAGES_PER_REQUEST
from inference.images.preprocess import ClipPreprocess
from inference.runtime.errors import EngineLoadError
from inference.runtime.ort_session import cpu_session
from inference.runtime.protocol import PreparedImage, VisionModel

#: The image-token limit of a bundle that sets none where its images vary (max_input_len bounds it).
UNLIMITED = 1 << 62


class VisionSession:
    """What every vision side shares: the graph's session, the image token, the placeholder the
    chat template writes, the feature width and the image-token limits."""

    #: a family whose images all take the same tokens says how many (its encoder sets it)
    tokens_per_image: int | None = None

    #: each image's rows attend to one another both ways (Gemma 3): prefill keeps them whole
    whole_images = False

    def __init__(self, bundle_dir: Path, record: Mapping[str, Any], *, threads: int) -> None:
        model = Path(bundle_dir) / str(record.get("model", ""))
        if not model.is_file():
            raise EngineLoadError(f"bundle {bundle_dir} has no vision model file ({model.name}); rebuild it")
        try:
            self.image_token_id = int(record["image_token_id"])
            self.placeholder_id = int(record.get("placeholder_id", self.image_token_id))
            self.feature_size = int(record["feature_size"])
            self._read(record)
            # The profile's image-token limits (bundles built before they were recorded: the
            # model's tokens per image, and MAX_IMAGES_PER_REQUEST of them; no limit of its own
            # per image where a family's images vary, only the request's and max_input_len).
            fixed = self.tokens_per_image
            per = record.get("max_image_tokens_per_image") or fixed
            self.max_image_tokens_per_image = int(per) if per else UNLIMITED
            self.max_image_tokens = int(record.get("max_image_tokens")
                                        or (MAX_IMAGES_PER_REQUEST * fixed if fixed else UNLIMITED))
        except (KeyError, TypeError, ValueError) as exc:
            raise EngineLoadError(
                f"engine.json vision record is incomplete ({exc}); rebuild the bundle") from None
        self._session: ort.InferenceSession = cpu_session(model, threads=threads, optimized=False)

    def _read(self, record: Mapping[str, Any]) -> None:
        """Read the family's own fields of the record (KeyError/TypeError/ValueError: incomplete)."""

    def prompt_text(self, text: str) -> str:
        """The rendered prompt as the processor tokenizes it: itself, unless a family says otherwise."""
        return text

    def run(self, inputs: Mapping[str, np.ndarray]) -> np.ndarray:
        """One run of the vision graph: its ``image_features`` output."""
        out: np.ndarray = self._session.run(["image_features"], dict(inputs))[0]
        return out


class ClipVisionEncoder(VisionSession):
    """LLaVA's side: one fixed-size image -> ``tokens_per_image`` rows (CLIP preprocessing; the
    placeholder is the image token itself, repeated)."""

    tokens_per_image: int

    def _read(self, record: Mapping[str, Any]) -> None:
        self.tokens_per_image = int(record["tokens_per_image"])
        self.image_size = int(record["image_size"])
        self._preprocess = ClipPreprocess.from_record(record["preprocess"])

    def fixed_tokens(self) -> tuple[int, ...]:
        """``tokens_per_image`` image tokens."""
        return (self.image_token_id,) * self.tokens_per_image

    def pixels(self, image: Any) -> np.ndarray:
        """Pixel values ``[3, image_size, image_size]`` float32 of a decoded image."""
        return self._preprocess(image)

    def prepare(self, image: Any) -> PreparedImage:
        """The image's pixel values and its ``tokens_per_image`` image tokens."""
        return PreparedImage(inputs={"pixel_values": self.pixels(image)[None]}, tokens=self.fixed_tokens(),
                             image_token_id=self.image_token_id)

    def encode(self, pixel_values: np.ndarray) -> np.ndarray:
        """Features ``[images, tokens_per_image, feature_size]`` of ``[images, 3, size, size]``."""
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


def _tiled(bundle_dir: Path, record: Mapping[str, Any], *, threads: int) -> VisionModel:
    from inference.runtime.vision_idefics3 import TiledVisionEncoder  # (it imports VisionSession)

    return TiledVisionEncoder(bundle_dir, record, threads=threads)


def _gemma3(bundle_dir: Path, record: Mapping[str, Any], *, threads: int) -> VisionModel:
    from inference.runtime.vision_gemma3 import Gemma3VisionEncoder

    return Gemma3VisionEncoder(bundle_dir, record, threads=threads)


def _qwen2_5_vl(bundle_dir: Path, record: Mapping[str, Any], *, threads: int) -> VisionModel:
    from inference.runtime.vision_qwen2_5_vl import QwenVisionEncoder  # it builds on VisionSession

    return QwenVisionEncoder(bundle_dir, record, threads=threads)


#: The encoder of each vision family (``engine.json`` ``vision.family``).
ENCODERS: dict[str, Callable[..., VisionModel]] = {"llava": ClipVisionEncoder, "idefics3": _tiled,
                                                   "smolvlm": _tiled, "gemma3": _gemma3,
                                                   "qwen2_5_vl": _qwen2_5_vl}


def load_vision(bundle_dir: Path, record: Mapping[str, Any], *, threads: int) -> VisionModel:
    """The vision side of a bundle from its ``engine.json`` ``vision`` record."""
    family = record.get("family", "llava")
    encoder = ENCODERS.get(str(family))
    if encoder is None:
        raise EngineLoadError(f"engine.json vision family {family!r} is not one this server runs "
                              f"({', '.join(sorted(ENCODERS))}); rebuild the bundle or upgrade the server")
    return encoder(bundle_dir, record, threads=threads)
