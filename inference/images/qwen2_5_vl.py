"""Qwen2.5-VL's image preprocessing without torch, and the per-image arrays its vision graph takes.

The steps and their arithmetic are transformers' PIL backend of ``Qwen2VLImageProcessor``
(``Qwen2VLImageProcessorPil``, what ``AutoProcessor`` picks where torchvision is not installed):
convert to RGB (transparency composited onto white), ``smart_resize`` (both sides multiples of
``patch_size * merge_size``, the area between ``min_pixels`` and ``max_pixels``, the aspect kept
as closely as it can) with Pillow's filter (``resample``, BICUBIC by default), rescale in float64
then float32, normalise in float32, then the patches flattened as transformers orders them: by
2x2 merge block (``grid_h / merge, grid_w / merge, merge, merge``), each patch
``[channels, temporal_patch_size, patch, patch]`` with the one frame repeated over the temporal
patch. An image is one frame: its grid is ``(1, grid_h, grid_w)`` and it takes
``grid_h * grid_w / merge**2`` tokens.

:func:`graph_inputs` precomputes what the vision graph needs beside the patches, per image, as
transformers' ``Qwen2_5_VisionTransformerPretrainedModel.forward`` derives it from the grid: the
window order (the patches of each attention window side by side), the 2D rotary cos/sin in that
order, the windows as padded blocks, and the order that puts the merged rows back.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np
from PIL import Image

from inference.images.preprocess import (
    OPENAI_CLIP_MEAN,
    OPENAI_CLIP_STD,
    RESAMPLE_FILTERS,
    RecordedPreprocess,
    to_rgb,
)

#: Image processors whose steps this module implements (the torchvision "fast" one resizes with
#: torchvision, not Pillow: its pixels differ slightly; its settings are the same).
SUPPORTED_PROCESSORS = ("Qwen2VLImageProcessor", "Qwen2VLImageProcessorPil", "Qwen2VLImageProcessorFast")
#: transformers' defaults (``Qwen2VLImageProcessorPil``).
DEFAULT_MIN_PIXELS = 56 * 56
DEFAULT_MAX_PIXELS = 28 * 28 * 1280
#: transformers refuses images whose long side is more than this many times the short one.
MAX_ASPECT_RATIO = 200
#: The vision graph's inputs, in order.
GRAPH_INPUTS = ("pixel_patches", "rope_cos", "rope_sin", "window_rows", "window_mask", "window_back",
                "merge_order")


class QwenPreprocessError(ValueError):
    """The image processor's settings ask for something this module does not do, or are malformed."""


def smart_resize(height: int, width: int, factor: int, min_pixels: int, max_pixels: int) -> tuple[int, int]:
    """transformers' ``smart_resize``: (height, width) multiples of ``factor``, their product
    within [min_pixels, max_pixels], the aspect ratio kept as closely as that allows.
    ``ValueError`` for an image more than 200 times as long as it is wide (or the reverse)."""
    if max(height, width) / min(height, width) > MAX_ASPECT_RATIO:
        raise ValueError(f"has an aspect ratio of {max(height, width) / min(height, width):.0f}; at most "
                         f"{MAX_ASPECT_RATIO} is accepted")
    h_bar = round(height / factor) * factor
    w_bar = round(width / factor) * factor
    if h_bar * w_bar > max_pixels:
        beta = math.sqrt((height * width) / max_pixels)
        h_bar = max(factor, math.floor(height / beta / factor) * factor)
        w_bar = max(factor, math.floor(width / beta / factor) * factor)
    elif h_bar * w_bar < min_pixels:
        beta = math.sqrt(min_pixels / (height * width))
        h_bar = math.ceil(height * beta / factor) * factor
        w_bar = math.ceil(width * beta / factor) * factor
    return h_bar, w_bar


def _positive(raw: Mapping[str, Any], key: str, default: int) -> int:
    value = raw.get(key, default)
    if value is None:
        value = default
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise QwenPreprocessError(f"preprocessor_config.json {key} must be a positive integer, got {value!r}")
    return value


Triple = tuple[float, float, float]


def _triple(raw: Mapping[str, Any], key: str, default: Triple) -> Triple:
    value = raw.get(key)
    if value is None:
        value = default
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        value = [value] * 3
    if not isinstance(value, (list, tuple)) or len(value) != 3 or not all(
            isinstance(v, (int, float)) and not isinstance(v, bool) for v in value):
        raise QwenPreprocessError(f"preprocessor_config.json {key} must be three numbers, got {value!r}")
    return float(value[0]), float(value[1]), float(value[2])


def _pixel_bounds(raw: Mapping[str, Any]) -> tuple[int, int]:
    """(min_pixels, max_pixels) as ``Qwen2VLImageProcessorPil.__init__`` reads them: ``size``'s
    ``shortest_edge``/``longest_edge`` (transformers 5), overridden by top-level ``min_pixels`` /
    ``max_pixels`` (the hub's configs)."""
    size = raw.get("size")
    bounds: dict[str, Any] = {"shortest_edge": DEFAULT_MIN_PIXELS, "longest_edge": DEFAULT_MAX_PIXELS}
    if size is not None:
        if not isinstance(size, Mapping):
            raise QwenPreprocessError(f"preprocessor_config.json size must be an object, got {size!r}")
        bounds = dict(size)
    for key, name in (("min_pixels", "shortest_edge"), ("max_pixels", "longest_edge")):
        if raw.get(key) is not None:
            bounds[name] = raw[key]
    out = []
    for name in ("shortest_edge", "longest_edge"):
        value = bounds.get(name)
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise QwenPreprocessError(f"preprocessor_config.json size.{name} (or min_pixels/max_pixels) must "
                                      f"be a positive integer, got {value!r}")
        out.append(value)
    if out[0] > out[1]:
        raise QwenPreprocessError(f"preprocessor_config.json min_pixels {out[0]} is above max_pixels "
                                  f"{out[1]}")
    return out[0], out[1]


@dataclass(frozen=True)
class QwenPreprocess(RecordedPreprocess):
    """Qwen2-VL's image preprocessing, every field explicit (what ``engine.json`` records)."""

    do_convert_rgb: bool
    min_pixels: int
    max_pixels: int
    patch_size: int
    temporal_patch_size: int
    merge_size: int
    resample: int
    do_rescale: bool
    rescale_factor: float
    do_normalize: bool
    image_mean: tuple[float, float, float]
    image_std: tuple[float, float, float]

    @classmethod
    def from_config(cls, raw: Mapping[str, Any]) -> QwenPreprocess:
        """A checked record of the image processor's settings (``QwenPreprocessError`` naming the
        field it cannot follow)."""
        kind = raw.get("image_processor_type", "Qwen2VLImageProcessor")
        if kind not in SUPPORTED_PROCESSORS:
            raise QwenPreprocessError(
                f"preprocessor_config.json image_processor_type {kind!r} is not supported; supported: "
                f"{', '.join(SUPPORTED_PROCESSORS)}")
        if raw.get("do_resize") is False:
            raise QwenPreprocessError("preprocessor_config.json do_resize false is not supported (images of "
                                      "any size need smart_resize to fit the patch grid)")
        resample = raw.get("resample", 3)
        if resample not in RESAMPLE_FILTERS:
            raise QwenPreprocessError(f"preprocessor_config.json resample {resample!r} is not a Pillow "
                                      "filter")
        factor = raw.get("rescale_factor", 1 / 255)
        if isinstance(factor, bool) or not isinstance(factor, (int, float)) or not math.isfinite(factor):
            raise QwenPreprocessError("preprocessor_config.json rescale_factor must be a number")
        std = _triple(raw, "image_std", OPENAI_CLIP_STD)
        if any(s == 0 for s in std):
            raise QwenPreprocessError("preprocessor_config.json image_std must not contain 0")
        min_pixels, max_pixels = _pixel_bounds(raw)
        return cls(
            do_convert_rgb=bool(raw.get("do_convert_rgb", True)), min_pixels=min_pixels,
            max_pixels=max_pixels,
            patch_size=_positive(raw, "patch_size", 14),
            temporal_patch_size=_positive(raw, "temporal_patch_size", 2),
            merge_size=_positive(raw, "merge_size", 2), resample=int(resample),
            do_rescale=bool(raw.get("do_rescale", True)), rescale_factor=float(factor),
            do_normalize=bool(raw.get("do_normalize", True)),
            image_mean=_triple(raw, "image_mean", OPENAI_CLIP_MEAN), image_std=std,
        )

    @property
    def factor(self) -> int:
        """Both resized sides are multiples of this (a merged patch)."""
        return self.patch_size * self.merge_size

    def resized_size(self, height: int, width: int) -> tuple[int, int]:
        """(height, width) an image of this size is resized to."""
        return smart_resize(height, width, self.factor, self.min_pixels, self.max_pixels)

    def min_tokens(self) -> int:
        """The fewest tokens an image can take (its area at least ``min_pixels``)."""
        return max(1, math.ceil(self.min_pixels / self.factor ** 2))

    def __call__(self, image: Image.Image) -> tuple[np.ndarray, tuple[int, int]]:
        """The flattened patches ``[grid_h * grid_w, 3 * temporal_patch_size * patch**2]`` float32
        of a decoded image, and its patch grid ``(grid_h, grid_w)``."""
        if self.do_convert_rgb:
            image = to_rgb(image)
        elif image.mode != "RGB":
            raise QwenPreprocessError(f"a {image.mode} image needs do_convert_rgb")
        h, w = self.resized_size(image.height, image.width)
        image = image.resize((w, h), resample=Image.Resampling(self.resample))
        pixels = np.asarray(image).transpose(2, 0, 1)  # [C, H, W] uint8
        out = pixels.astype(np.float32)
        if self.do_rescale:
            out = (pixels.astype(np.float64) * self.rescale_factor).astype(np.float32)
        if self.do_normalize:
            mean = np.array(self.image_mean, np.float32)[:, None, None]
            std = np.array(self.image_std, np.float32)[:, None, None]
            out = ((out - mean) / std).astype(np.float32)
        return self.patchify(out)

    def patchify(self, image: np.ndarray) -> tuple[np.ndarray, tuple[int, int]]:
        """``[C, H, W]`` float32 -> (patches, (grid_h, grid_w)), transformers' order."""
        p, m, t = self.patch_size, self.merge_size, self.temporal_patch_size
        channels, height, width = image.shape
        gh, gw = height // p, width // p
        patches = image.reshape(channels, gh // m, m, p, gw // m, m, p).transpose(1, 4, 2, 5, 0, 3, 6)
        patches = np.broadcast_to(patches[:, :, :, :, :, None], (*patches.shape[:5], t, p, p))
        flat = patches.reshape(gh * gw, channels * t * p * p)
        return np.ascontiguousarray(flat, dtype=np.float32), (gh, gw)


@dataclass(frozen=True)
class VisionGeometry:
    """What :func:`graph_inputs` needs of the vision tower (``engine.json`` ``vision.geometry``)."""

    head_dim: int
    rope_theta: float
    patch_size: int
    merge_size: int
    window_size: int

    def record(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_record(cls, record: Mapping[str, Any]) -> VisionGeometry:
        return cls(head_dim=int(record["head_dim"]), rope_theta=float(record["rope_theta"]),
                   patch_size=int(record["patch_size"]), merge_size=int(record["merge_size"]),
                   window_size=int(record["window_size"]))


def rotary_positions(grid_h: int, grid_w: int, merge: int) -> np.ndarray:
    """Each patch's (row, column) in the processor's order (by merge block): ``[n, 2]`` int64
    (transformers' ``get_vision_position_ids``)."""
    hgrid, wgrid = np.meshgrid(np.arange(grid_h), np.arange(grid_w), indexing="ij")
    shape = (grid_h // merge, merge, grid_w // merge, merge)
    hpos = hgrid.reshape(shape).transpose(0, 2, 1, 3).reshape(-1)
    wpos = wgrid.reshape(shape).transpose(0, 2, 1, 3).reshape(-1)
    return np.stack([hpos, wpos], axis=-1).astype(np.int64)


def rotary_cos_sin(positions: np.ndarray, head_dim: int, theta: float) -> tuple[np.ndarray, np.ndarray]:
    """cos and sin ``[n, head_dim]`` float32 of the patches' (row, column) positions, as
    transformers' ``Qwen2_5_VLVisionRotaryEmbedding`` lays them out: [rows' | columns'] angles
    over a quarter of the head each, the half repeated."""
    spatial = head_dim // 2
    exponents = np.arange(0, spatial, 2, dtype=np.int64).astype(np.float32) / np.float32(spatial)
    inv_freq = (np.float32(1.0) / (np.float32(theta) ** exponents)).astype(np.float32)
    freqs = positions.astype(np.float32)[..., None] * inv_freq  # [n, 2, head_dim/4]
    out = []
    for values in (np.cos(freqs), np.sin(freqs)):
        half = np.concatenate([values[:, 0], values[:, 1]], axis=-1)
        out.append(np.ascontiguousarray(np.concatenate([half, half], axis=-1), dtype=np.float32))
    return out[0], out[1]


def window_index(grid_h: int, grid_w: int, merge: int, window_size: int,
                 patch_size: int) -> tuple[np.ndarray, np.ndarray]:
    """transformers' ``get_vision_window_index`` of one image: the merged units in window order
    ``[units]`` and each window's size in merged units (windows without a unit dropped)."""
    vws = window_size // merge // patch_size
    llm_h, llm_w = grid_h // merge, grid_w // merge
    index = np.arange(llm_h * llm_w).reshape(llm_h, llm_w)
    pad_h, pad_w = vws - llm_h % vws, vws - llm_w % vws
    padded = np.full((llm_h + pad_h, llm_w + pad_w), -100, np.int64)
    padded[:llm_h, :llm_w] = index
    n_h, n_w = (llm_h + pad_h) // vws, (llm_w + pad_w) // vws
    windows = padded.reshape(n_h, vws, n_w, vws).transpose(0, 2, 1, 3).reshape(n_h * n_w, vws * vws)
    sizes = (windows != -100).sum(axis=1)
    order = windows.reshape(-1)
    return order[order != -100], sizes[sizes > 0]


def graph_inputs(patches: np.ndarray, grid: tuple[int, int],
                 geometry: VisionGeometry) -> dict[str, np.ndarray]:
    """The vision graph's inputs for one image (its patches in the processor's order):

    ``pixel_patches [n, patch_dim]`` the patches in window order; ``rope_cos``/``rope_sin`` ``[n,
    head_dim]`` in that order; ``window_rows [windows * L]`` the rows of each window padded to the
    longest (L), ``window_mask [windows, L]`` int32, 1 for a row, 0 for padding, ``window_back
    [n]`` where each row sits in that padded layout; ``merge_order [n / merge**2]`` the merged rows
    back in the processor's order (the inverse of the window order)."""
    grid_h, grid_w = grid
    m = geometry.merge_size
    unit = m * m
    units, sizes = window_index(grid_h, grid_w, m, geometry.window_size, geometry.patch_size)
    rows = (units[:, None] * unit + np.arange(unit)).reshape(-1)  # patch order -> window order
    positions = rotary_positions(grid_h, grid_w, m)[rows]
    cos, sin = rotary_cos_sin(positions, geometry.head_dim, geometry.rope_theta)
    lengths = sizes * unit
    longest = int(lengths.max())
    starts = np.concatenate([[0], np.cumsum(lengths)[:-1]])
    slot = np.arange(longest)
    valid = slot[None, :] < lengths[:, None]  # [windows, L]
    window_rows = np.where(valid, starts[:, None] + slot[None, :], 0).reshape(-1)
    mask = valid.astype(np.int32)
    window_of = np.repeat(np.arange(len(lengths)), lengths)
    back = window_of * longest + (np.arange(len(rows)) - starts[window_of])
    return {
        "pixel_patches": np.ascontiguousarray(patches[rows], dtype=np.float32),
        "rope_cos": cos, "rope_sin": sin,
        "window_rows": window_rows.astype(np.int64),
        "window_mask": mask,
        "window_back": back.astype(np.int64),
        "merge_order": np.argsort(units).astype(np.int64),
    }
