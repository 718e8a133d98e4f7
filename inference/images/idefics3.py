"""Idefics3's and SmolVLM's image preprocessing without torch, and the prompt tokens of an image.

The steps and their arithmetic are transformers' PIL backend (``Idefics3ImageProcessorPil``;
``SmolVLMImageProcessorPil`` is the same code): convert to RGB (transparency composited onto
white), resize so the longest edge is ``size["longest_edge"]`` (the other edge
``int(longest / aspect)``, rounded up to even, at most 4096), then with ``do_image_splitting``
resize again so both edges are multiples of the tile (``max_image_size["longest_edge"]``) and cut
the result into ``rows x cols`` tiles, row-major, followed by the whole image resized to one tile
(the "global" image); an image that fits one tile is that one tile alone. Without splitting the
image is resized to one tile. Every resize is Pillow's on uint8 (``resample``); then rescale in
float64 then float32 and normalise per channel in float32.

Every frame is one tile square, so the processor's ``do_pad`` (padding frames to the largest of
the batch) never pads and its ``pixel_attention_mask`` is all ones: the vision graph takes full
tiles only.

The prompt: the chat template's ``<image>`` becomes, for a split image, for each row
``(<fake_token_around_image><row_r_col_c><image>*n)*cols`` then ``\\n``, then
``\\n<fake_token_around_image><global-img><image>*n<fake_token_around_image>``; for one tile
``<fake_token_around_image><global-img><image>*n<fake_token_around_image>`` (transformers'
``Idefics3Processor`` / ``SmolVLMProcessor``, ``n`` = ``image_seq_len``). The builder tokenizes
each piece with the checkpoint's tokenizer in the context it has there (between the added tokens
around it) and records the ids (:class:`TilePrompt`), so the server needs no tokenizer for it.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
from PIL import Image

from inference.images.preprocess import RESAMPLE_FILTERS, PreprocessConfigError, RecordedPreprocess, to_rgb

#: Image processors whose steps this module implements (``image_processor_type``).
SUPPORTED_PROCESSORS = tuple(f"{name}{suffix}" for name in ("Idefics3ImageProcessor", "SmolVLMImageProcessor")
                             for suffix in ("", "Fast", "Pil"))
#: transformers' bound on the resized image's longest edge (``MAX_IMAGE_SIZE``).
MAX_IMAGE_SIZE = 4096
IMAGENET_STANDARD = (0.5, 0.5, 0.5)
LANCZOS = 1


def _edge(raw: Mapping[str, Any], key: str, default: int) -> int:
    value = raw.get(key, {"longest_edge": default})
    if not isinstance(value, Mapping):
        raise PreprocessConfigError(f"preprocessor_config.json {key} must be an object, got {value!r}")
    unknown = sorted(set(value) - {"longest_edge"})
    if unknown:
        raise PreprocessConfigError(f"preprocessor_config.json {key}.{unknown[0]} is not supported (only "
                                    "longest_edge)")
    edge = value.get("longest_edge")
    if isinstance(edge, bool) or not isinstance(edge, int) or edge < 1:
        raise PreprocessConfigError(f"preprocessor_config.json {key}.longest_edge must be a positive integer")
    return edge


def _triple(value: object, key: str) -> tuple[float, float, float]:
    if value is None:
        value = IMAGENET_STANDARD
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        value = [value] * 3
    if not isinstance(value, (list, tuple)) or len(value) != 3 or not all(
            isinstance(v, (int, float)) and not isinstance(v, bool) for v in value):
        raise PreprocessConfigError(f"preprocessor_config.json {key} must be three numbers, got {value!r}")
    return float(value[0]), float(value[1]), float(value[2])


def longest_edge_size(height: int, width: int, longest: int) -> tuple[int, int]:
    """(height, width) with the longest edge ``longest`` (transformers'
    ``_resize_output_size_rescale_to_max_len``, then at most :data:`MAX_IMAGE_SIZE`)."""
    aspect = width / height
    if width >= height:
        width = longest
        height = int(width / aspect)
        if height % 2:
            height += 1
    else:
        height = longest
        width = int(height * aspect)
        if width % 2:
            width += 1
    height, width = max(height, 1), max(width, 1)
    aspect = width / height  # _resize_output_size_scale_below_upper_bound
    if width >= height and width > MAX_IMAGE_SIZE:
        width = MAX_IMAGE_SIZE
        height = int(width / aspect)
    elif height > width and height > MAX_IMAGE_SIZE:
        height = MAX_IMAGE_SIZE
        width = int(height * aspect)
    return max(height, 1), max(width, 1)


def tiled_size(height: int, width: int, tile: int) -> tuple[int, int]:
    """(height, width) rounded up to multiples of ``tile`` (transformers' ``resize_for_vision_encoder``)."""
    aspect = width / height
    if width >= height:
        width = math.ceil(width / tile) * tile
        height = int(width / aspect)
        height = math.ceil(height / tile) * tile
    else:
        height = math.ceil(height / tile) * tile
        width = int(height * aspect)
        width = math.ceil(width / tile) * tile
    return height, width


@dataclass(frozen=True)
class TilePreprocess(RecordedPreprocess):
    """Idefics3's image preprocessing, every field explicit (what ``engine.json`` records)."""

    do_convert_rgb: bool
    do_resize: bool
    longest_edge: int  # size["longest_edge"]: the first resize's target
    tile: int  # max_image_size["longest_edge"]: one frame's edge (the vision graph's input)
    resample: int
    do_image_splitting: bool
    do_rescale: bool
    rescale_factor: float
    do_normalize: bool
    image_mean: tuple[float, float, float]
    image_std: tuple[float, float, float]

    @classmethod
    def from_config(cls, raw: Mapping[str, Any]) -> TilePreprocess:
        """A checked record of the image processor's settings (``PreprocessConfigError`` naming
        the field it cannot follow); absent fields take ``Idefics3ImageProcessor``'s defaults."""
        kind = raw.get("image_processor_type", "Idefics3ImageProcessor")
        if kind not in SUPPORTED_PROCESSORS:
            raise PreprocessConfigError(
                f"preprocessor_config.json image_processor_type {kind!r} is not supported; supported: "
                f"{', '.join(SUPPORTED_PROCESSORS)}")
        resample = raw.get("resample", LANCZOS)
        if resample not in RESAMPLE_FILTERS:
            raise PreprocessConfigError(
                f"preprocessor_config.json resample {resample!r} is not a Pillow filter")
        factor = raw.get("rescale_factor", 1 / 255)
        if isinstance(factor, bool) or not isinstance(factor, (int, float)) or not math.isfinite(factor):
            raise PreprocessConfigError("preprocessor_config.json rescale_factor must be a number")
        std = _triple(raw.get("image_std"), "image_std")
        if any(s == 0 for s in std):
            raise PreprocessConfigError("preprocessor_config.json image_std must not contain 0")
        do_resize = bool(raw.get("do_resize", True))
        splitting = bool(raw.get("do_image_splitting", True))
        if splitting and not do_resize:
            raise PreprocessConfigError(
                "preprocessor_config.json do_resize false with do_image_splitting (images split at their own "
                "size, into any number of tiles) is not supported")
        return cls(
            do_convert_rgb=bool(raw.get("do_convert_rgb", True)), do_resize=do_resize,
            longest_edge=_edge(raw, "size", 4 * 364), tile=_edge(raw, "max_image_size", 364),
            resample=int(resample), do_image_splitting=splitting,
            do_rescale=bool(raw.get("do_rescale", True)), rescale_factor=float(factor),
            do_normalize=bool(raw.get("do_normalize", True)),
            image_mean=_triple(raw.get("image_mean"), "image_mean"), image_std=std,
        )

    @property
    def max_grid(self) -> int:
        """The most tile rows (or columns) an image can be cut into."""
        if not self.do_image_splitting:
            return 0
        # The even rounding may make the shorter edge one longer than the longest.
        return math.ceil((min(self.longest_edge, MAX_IMAGE_SIZE) + 1) / self.tile)

    def _resize(self, image: Image.Image, height: int, width: int) -> Image.Image:
        return image.resize((width, height), resample=Image.Resampling(self.resample))

    def __call__(self, image: Image.Image) -> tuple[np.ndarray, int, int]:
        """The frames ``[tiles, 3, tile, tile]`` float32 of a decoded image (its tiles row-major,
        then the global image; one frame where it is not split) and its (rows, cols)."""
        if self.do_convert_rgb:
            image = to_rgb(image)
        elif image.mode != "RGB":
            raise PreprocessConfigError(f"a {image.mode} image needs do_convert_rgb")
        if self.do_resize:
            image = self._resize(image, *longest_edge_size(image.height, image.width, self.longest_edge))
        t = self.tile
        rows = cols = 0
        if self.do_image_splitting:
            image = self._resize(image, *tiled_size(image.height, image.width, t))
            if image.height > t or image.width > t:
                rows, cols = (image.height - t) // t + 1, (image.width - t) // t + 1
                whole = np.asarray(image)
                frames = [whole[r * t:(r + 1) * t, c * t:(c + 1) * t]
                          for r in range(rows) for c in range(cols)]
                frames.append(np.asarray(self._resize(image, t, t)))
            else:
                frames = [np.asarray(image)]
        else:
            frames = [np.asarray(self._resize(image, t, t))]
        pixels = np.stack(frames).transpose(0, 3, 1, 2)  # [N, C, H, W] uint8
        out = pixels.astype(np.float32)
        if self.do_rescale:
            out = (pixels.astype(np.float64) * self.rescale_factor).astype(np.float32)
        if self.do_normalize:
            mean = np.array(self.image_mean, np.float32)[None, :, None, None]
            std = np.array(self.image_std, np.float32)[None, :, None, None]
            out = ((out - mean) / std).astype(np.float32)
        return np.ascontiguousarray(out), rows, cols


@dataclass(frozen=True)
class TilePrompt:
    """The token ids of the pieces of an image's prompt, as the checkpoint's tokenizer makes them in
    place (what ``engine.json`` records under ``vision.prompt``)."""

    image: int  #: ``<image>``: one feature row each
    tokens_per_tile: int  #: ``image_seq_len``: image tokens of one frame
    fake: tuple[int, ...]  #: ``<fake_token_around_image>``
    global_image: tuple[int, ...]  #: ``<global-img>``
    newline: tuple[int, ...]  #: ``\n`` after a row of tiles
    last_newlines: tuple[int, ...]  #: ``\n\n``: after the last row (its ``\n`` and the global image's)
    #: ``<row_{r}_col_{c}>`` by ``[r - 1][c - 1]``, for every row and column an image can have
    tile_tags: tuple[tuple[tuple[int, ...], ...], ...]

    def record(self) -> dict[str, Any]:
        """The JSON form ``engine.json`` keeps."""
        return {"image": self.image, "tokens_per_tile": self.tokens_per_tile, "fake": list(self.fake),
                "global_image": list(self.global_image), "newline": list(self.newline),
                "last_newlines": list(self.last_newlines),
                "tile_tags": [[list(tag) for tag in row] for row in self.tile_tags]}

    @classmethod
    def from_record(cls, record: Mapping[str, Any]) -> TilePrompt:
        """The record :meth:`record` wrote."""
        def ids(value: Sequence[Any]) -> tuple[int, ...]:
            return tuple(int(v) for v in value)

        return cls(image=int(record["image"]), tokens_per_tile=int(record["tokens_per_tile"]),
                   fake=ids(record["fake"]), global_image=ids(record["global_image"]),
                   newline=ids(record["newline"]), last_newlines=ids(record["last_newlines"]),
                   tile_tags=tuple(tuple(ids(tag) for tag in row) for row in record["tile_tags"]))

    def tokens(self, rows: int, cols: int) -> tuple[int, ...]:
        """The tokens of an image cut into ``rows x cols`` tiles ((0, 0): one frame) that replace its
        placeholder: ``get_image_prompt_string`` of transformers' processors."""
        tile = (self.image,) * self.tokens_per_tile
        out: list[int] = []
        if rows and cols:
            if rows > len(self.tile_tags) or cols > len(self.tile_tags[0]):
                raise ValueError(f"an image of {rows}x{cols} tiles; the bundle has tile tags up to "
                                 f"{len(self.tile_tags)}x{len(self.tile_tags[0])}")
            for r in range(rows):
                for c in range(cols):
                    out += [*self.fake, *self.tile_tags[r][c], *tile]
                out += self.last_newlines if r == rows - 1 else self.newline
        out += [*self.fake, *self.global_image, *tile, *self.fake]
        return tuple(out)
