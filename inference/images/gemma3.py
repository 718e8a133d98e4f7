"""Gemma 3's image preprocessing without torch: ``Gemma3ImageProcessor``'s settings as the CLIP
pipeline's record (:class:`inference.images.preprocess.ClipPreprocess`), which runs the same steps
with the same arithmetic (transformers' PIL backend, ``Gemma3ImageProcessorPil``): convert to RGB,
resize to exactly ``size`` (height x width; Pillow's ``resample``, bilinear by default), rescale,
normalise (mean and std 0.5 by default). No crop: the tower takes the whole resized image.

Pan-and-scan (``do_pan_and_scan``: extra crops of a wide or tall image, each with its own image
tokens and text around them) is refused by name; Gemma 3's processors leave it off by default.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

from inference.images.preprocess import (
    RESAMPLE_FILTERS,
    ClipPreprocess,
    PreprocessConfigError,
    _size,
    _triple,
)

#: Image processors whose steps this module implements (the PIL and torchvision backends of
#: transformers 5 and the names earlier releases saved).
GEMMA3_PROCESSORS = ("Gemma3ImageProcessor", "Gemma3ImageProcessorFast", "Gemma3ImageProcessorPil")
#: transformers' IMAGENET_STANDARD_MEAN / _STD, Gemma 3's defaults.
STANDARD_MEAN = (0.5, 0.5, 0.5)
STANDARD_STD = (0.5, 0.5, 0.5)
#: Gemma3ImageProcessor's default size and filter (PILImageResampling.BILINEAR).
DEFAULT_SIZE = {"height": 224, "width": 224}
BILINEAR = 2


def _flag(raw: Mapping[str, Any], key: str) -> bool:
    """A step's switch; absent or null (as the hub's configs write do_convert_rgb): on, the default
    of Gemma3ImageProcessor and Gemma3Processor for every step this module runs."""
    value = raw.get(key)
    return True if value is None else bool(value)


def gemma3_preprocess(raw: Mapping[str, Any]) -> ClipPreprocess:
    """The pipeline of a Gemma 3 image processor's settings (``preprocessor_config.json``, or
    ``processor_config.json``'s ``image_processor``); ``PreprocessConfigError`` naming the field it
    cannot follow."""
    kind = raw.get("image_processor_type", "Gemma3ImageProcessor")
    if kind not in GEMMA3_PROCESSORS:
        raise PreprocessConfigError(f"preprocessor_config.json image_processor_type {kind!r} is not "
                                    f"supported for gemma3; supported: {', '.join(GEMMA3_PROCESSORS)}")
    if raw.get("do_pan_and_scan"):
        raise PreprocessConfigError("preprocessor_config.json do_pan_and_scan (pan-and-scan crops) is not "
                                    "supported; set it to false")
    size = raw.get("size", DEFAULT_SIZE)
    if isinstance(size, int) and not isinstance(size, bool):  # default_to_square: an int is a square
        size = {"height": size, "width": size}
    shortest, height, width = _size(size, "size")
    if shortest is not None or height is None or width is None:
        raise PreprocessConfigError("preprocessor_config.json size must give height and width for gemma3")
    if not _flag(raw, "do_resize"):
        raise PreprocessConfigError("preprocessor_config.json do_resize false gives images of varying size, "
                                    "which the vision tower cannot take")
    resample = raw.get("resample", BILINEAR)
    if resample not in RESAMPLE_FILTERS:
        raise PreprocessConfigError(f"preprocessor_config.json resample {resample!r} is not a Pillow filter")
    factor = raw.get("rescale_factor", 1 / 255)
    if isinstance(factor, bool) or not isinstance(factor, (int, float)) or not math.isfinite(factor):
        raise PreprocessConfigError("preprocessor_config.json rescale_factor must be a number")
    std = _triple(raw.get("image_std"), "image_std", STANDARD_STD)
    if any(s == 0 for s in std):
        raise PreprocessConfigError("preprocessor_config.json image_std must not contain 0")
    return ClipPreprocess(
        do_convert_rgb=_flag(raw, "do_convert_rgb"),
        do_resize=True, shortest_edge=None, resize_height=height, resize_width=width,
        resample=int(resample), do_center_crop=False, crop_height=height, crop_width=width,
        do_rescale=_flag(raw, "do_rescale"), rescale_factor=float(factor),
        do_normalize=_flag(raw, "do_normalize"),
        image_mean=_triple(raw.get("image_mean"), "image_mean", STANDARD_MEAN), image_std=std,
    )
