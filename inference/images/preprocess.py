"""Image preprocessing without torch: a checkpoint's ``preprocessor_config.json`` (CLIP's image
processor) as a frozen record, and the pixel values it makes of a decoded image.

The steps and their arithmetic are transformers' PIL backend (``CLIPImageProcessorPil``): convert
to RGB (transparency composited onto white; one difference: 16-bit greyscale is scaled to 8 bits
first, where Pillow's conversion, and so transformers', clips it to white), resize the shortest
edge with Pillow's filter
(``resample``; the long edge ``int(short_target * long / short)``), center crop (zero padding
where the image is smaller), rescale in float64 then float32, normalise per channel in float32.
The builder validates the config once and records it in ``engine.json`` (``vision.preprocess``);
the server rebuilds it from there, so a bundle needs no checkpoint file at run time.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import asdict, dataclass
from typing import Any, Self, cast

import numpy as np
from PIL import Image

from inference.images.decode import MAX_IMAGE_PIXELS, ImageInputError

#: Pillow's filters by the number transformers writes (``PILImageResampling``).
RESAMPLE_FILTERS = (0, 1, 2, 3, 4, 5)
#: Image processors whose steps this module implements.
SUPPORTED_PROCESSORS = ("CLIPImageProcessor", "CLIPImageProcessorFast", "CLIPImageProcessorPil",
                        "LlavaImageProcessor")
OPENAI_CLIP_MEAN = (0.48145466, 0.4578275, 0.40821073)
OPENAI_CLIP_STD = (0.26862954, 0.26130258, 0.27577711)


class PreprocessConfigError(ValueError):
    """preprocessor_config.json asks for a step this module does not implement, or is malformed."""


def _size(value: object, key: str) -> tuple[int | None, int | None, int | None]:
    """(shortest_edge, height, width) of a size field, each None where absent."""
    if isinstance(value, int) and not isinstance(value, bool):
        return value, None, None
    if not isinstance(value, Mapping):
        raise PreprocessConfigError(f"preprocessor_config.json {key} must be an object, got {value!r}")
    out: list[int | None] = []
    for name in ("shortest_edge", "height", "width"):
        v = value.get(name)
        if v is not None and (isinstance(v, bool) or not isinstance(v, int) or v < 1):
            raise PreprocessConfigError(f"preprocessor_config.json {key}.{name} must be a positive integer")
        out.append(v)
    unknown = sorted(set(value) - {"shortest_edge", "height", "width"})
    if unknown:
        raise PreprocessConfigError(f"preprocessor_config.json {key}.{unknown[0]} is not supported")
    return out[0], out[1], out[2]


def _triple(value: object, key: str, default: tuple[float, ...]) -> tuple[float, float, float]:
    if value is None:
        value = default
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        value = [value] * 3
    if not isinstance(value, (list, tuple)) or len(value) != 3 or not all(
            isinstance(v, (int, float)) and not isinstance(v, bool) for v in value):
        raise PreprocessConfigError(f"preprocessor_config.json {key} must be three numbers, got {value!r}")
    return float(value[0]), float(value[1]), float(value[2])


class RecordedPreprocess:
    """What every image preprocessing of a bundle shares: its settings (a frozen dataclass with
    ``image_mean`` and ``image_std`` triples) as the JSON ``engine.json`` keeps, and back."""

    image_mean: tuple[float, float, float]
    image_std: tuple[float, float, float]

    def record(self) -> dict[str, Any]:
        """The JSON form ``engine.json`` keeps (:meth:`from_record` reads it back)."""
        out = asdict(cast(Any, self))
        out["image_mean"], out["image_std"] = list(self.image_mean), list(self.image_std)
        return out

    @classmethod
    def from_record(cls, record: Mapping[str, Any]) -> Self:
        """The record :meth:`record` wrote."""
        fields = dict(record)
        fields["image_mean"] = tuple(fields["image_mean"])
        fields["image_std"] = tuple(fields["image_std"])
        return cls(**fields)


@dataclass(frozen=True)
class ClipPreprocess(RecordedPreprocess):
    """CLIP's image preprocessing, every field explicit (what ``engine.json`` records)."""

    do_convert_rgb: bool
    do_resize: bool
    shortest_edge: int | None  # resize so the shortest edge is this long (aspect kept)
    resize_height: int | None  # or to exactly this size
    resize_width: int | None
    resample: int
    do_center_crop: bool
    crop_height: int
    crop_width: int
    do_rescale: bool
    rescale_factor: float
    do_normalize: bool
    image_mean: tuple[float, float, float]
    image_std: tuple[float, float, float]

    @classmethod
    def from_config(cls, raw: Mapping[str, Any]) -> ClipPreprocess:
        """A checked record of ``preprocessor_config.json``'s contents (``PreprocessConfigError``
        naming the field it cannot follow)."""
        kind = raw.get("image_processor_type", "CLIPImageProcessor")
        if kind not in SUPPORTED_PROCESSORS:
            raise PreprocessConfigError(
                f"preprocessor_config.json image_processor_type {kind!r} is not supported; supported: "
                f"{', '.join(SUPPORTED_PROCESSORS)}")
        if raw.get("do_pad"):
            raise PreprocessConfigError(
                "preprocessor_config.json do_pad (padding to a square) is not supported")
        shortest, height, width = _size(raw.get("size", {"shortest_edge": 224}), "size")
        if shortest is None and (height is None or width is None):
            raise PreprocessConfigError(
                "preprocessor_config.json size needs shortest_edge, or height and width")
        crop = raw.get("crop_size", {"height": 224, "width": 224})
        if isinstance(crop, int) and not isinstance(crop, bool):  # an int crop is a square (transformers)
            crop = {"height": crop, "width": crop}
        _, crop_h, crop_w = _size(crop, "crop_size")
        if crop_h is None or crop_w is None:
            raise PreprocessConfigError("preprocessor_config.json crop_size needs height and width")
        resample = raw.get("resample", 3)
        if resample not in RESAMPLE_FILTERS:
            raise PreprocessConfigError(
                f"preprocessor_config.json resample {resample!r} is not a Pillow filter")
        factor = raw.get("rescale_factor", 1 / 255)
        if isinstance(factor, bool) or not isinstance(factor, (int, float)) or not math.isfinite(factor):
            raise PreprocessConfigError("preprocessor_config.json rescale_factor must be a number")
        std = _triple(raw.get("image_std"), "image_std", OPENAI_CLIP_STD)
        if any(s == 0 for s in std):
            raise PreprocessConfigError("preprocessor_config.json image_std must not contain 0")
        return cls(
            do_convert_rgb=bool(raw.get("do_convert_rgb", True)),
            do_resize=bool(raw.get("do_resize", True)),
            shortest_edge=shortest, resize_height=height if shortest is None else None,
            resize_width=width if shortest is None else None,
            resample=int(resample),
            do_center_crop=bool(raw.get("do_center_crop", True)),
            crop_height=crop_h, crop_width=crop_w,
            do_rescale=bool(raw.get("do_rescale", True)), rescale_factor=float(factor),
            do_normalize=bool(raw.get("do_normalize", True)),
            image_mean=_triple(raw.get("image_mean"), "image_mean", OPENAI_CLIP_MEAN),
            image_std=std,
        )

    def output_size(self) -> tuple[int, int]:
        """(height, width) of every pixel array this makes."""
        if self.do_center_crop:
            return self.crop_height, self.crop_width
        if self.shortest_edge is not None:
            raise PreprocessConfigError(
                "preprocessor_config.json: resizing the shortest edge without a center crop gives images of "
                "varying size, which this vision tower cannot take")
        assert self.resize_height is not None and self.resize_width is not None
        return self.resize_height, self.resize_width

    def _resized_size(self, height: int, width: int) -> tuple[int, int]:
        if self.shortest_edge is None:
            assert self.resize_height is not None and self.resize_width is not None
            return self.resize_height, self.resize_width
        short, long = (width, height) if width <= height else (height, width)
        new_short, new_long = self.shortest_edge, int(self.shortest_edge * long / short)
        return (new_long, new_short) if width <= height else (new_short, new_long)

    def __call__(self, image: Image.Image) -> np.ndarray:
        """Pixel values ``[3, height, width]`` float32 of a decoded image."""
        if self.do_convert_rgb:
            image = to_rgb(image)
        elif image.mode != "RGB":
            raise ImageInputError(f"is a {image.mode} image; this model's image processor takes RGB images "
                                  "only (its do_convert_rgb is false): send an RGB image")
        if self.do_resize:
            h, w = self._resized_size(image.height, image.width)
            if h * w > MAX_IMAGE_PIXELS:  # a 1 x 8192 strip would become 336 x 2.75 M pixels (2.8 GB)
                raise ImageInputError(
                    f"is {image.width}x{image.height} pixels; resized for this model it would be {w}x{h}, "
                    f"over {MAX_IMAGE_PIXELS} pixels: send an image with a less extreme aspect ratio "
                    "(crop it)")
            image = image.resize((w, h), resample=Image.Resampling(self.resample))
        pixels = np.asarray(image).transpose(2, 0, 1)  # [C, H, W] uint8
        if self.do_center_crop:
            pixels = _center_crop(pixels, self.crop_height, self.crop_width)
        out = pixels.astype(np.float32)
        if self.do_rescale:
            out = (pixels.astype(np.float64) * self.rescale_factor).astype(np.float32)
        if self.do_normalize:
            mean = np.array(self.image_mean, np.float32)[:, None, None]
            std = np.array(self.image_std, np.float32)[:, None, None]
            out = ((out - mean) / std).astype(np.float32)
        return np.ascontiguousarray(out)


#: Pillow's modes of 16-bit greyscale (a 16-bit PNG; older Pillows read it as ``I``).
SIXTEEN_BIT_MODES = ("I;16", "I;16L", "I;16B", "I;16N", "I")


def to_rgb(image: Image.Image) -> Image.Image:
    """RGB, with any transparency composited onto white (as transformers converts); 16-bit
    greyscale is scaled to 8 bits first (its high byte, as Pillow reads 16-bit RGB PNGs), where
    Pillow's own conversion would clip every value over 255 to white."""
    if image.mode in SIXTEEN_BIT_MODES:
        image = _eight_bit(image)
    if "A" in image.getbands() or image.info.get("transparency") is not None:
        rgba = image.convert("RGBA")
        background = Image.new("RGBA", rgba.size, (255, 255, 255, 255))
        return Image.alpha_composite(background, rgba).convert("RGB")
    return image.convert("RGB")


def _eight_bit(image: Image.Image) -> Image.Image:
    """A 16-bit greyscale image as 8-bit ``L`` (``LA`` where a transparent value is set)."""
    values = np.clip(np.asarray(image, dtype=np.int64), 0, 65535)
    grey = Image.fromarray((values >> 8).astype(np.uint8), "L")
    transparent = image.info.get("transparency")
    if isinstance(transparent, int):
        alpha = Image.fromarray(np.where(values == transparent, 0, 255).astype(np.uint8), "L")
        grey = Image.merge("LA", (grey, alpha))
    return grey


def _center_crop(pixels: np.ndarray, height: int, width: int) -> np.ndarray:
    """transformers' center crop of ``[C, H, W]``: zero padding where the image is smaller."""
    _, h, w = pixels.shape
    top, left = (h - height) // 2, (w - width) // 2
    if top >= 0 and left >= 0 and top + height <= h and left + width <= w:
        return pixels[:, top:top + height, left:left + width]
    new_h, new_w = max(height, h), max(width, w)
    padded = np.zeros((pixels.shape[0], new_h, new_w), pixels.dtype)
    pad_top, pad_left = math.ceil((new_h - h) / 2), math.ceil((new_w - w) / 2)
    padded[:, pad_top:pad_top + h, pad_left:pad_left + w] = pixels
    top, left = top + pad_top, left + pad_left
    return padded[:, max(0, top):min(new_h, top + height), max(0, left):min(new_w, left + width)]
