"""Idefics3's / SmolVLM's image preprocessing without torch (Pillow + numpy) against transformers'
own image processors (the PIL backend, which AutoProcessor picks without torchvision) on the same
images, and the chat template's ``<image>`` expanded to the processors' input ids."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from PIL import Image

from inference.images.idefics3 import TilePreprocess, TilePrompt, longest_edge_size
from inference.images.preprocess import PreprocessConfigError
from inference.openai.images import expand_placeholders
from inference.runtime.onnxruntime_loader import load_ort_engine
from inference.runtime.protocol import ImageEngine
from inference.serving.tokenizer import load_tokenizer
from tests.vision.conftest import random_image, smolvlm_inputs

tf = pytest.importorskip("transformers")

CONFIGS: dict[str, dict[str, Any]] = {
    # SmolVLM-256M/500M-Instruct's image processor: LANCZOS, 2048 then 512-pixel tiles
    "smolvlm-256m": {"size": {"longest_edge": 2048}, "max_image_size": {"longest_edge": 512}, "resample": 1},
    "tiny": {"size": {"longest_edge": 96}, "max_image_size": {"longest_edge": 32}},
    "one-tile": {"size": {"longest_edge": 30}, "max_image_size": {"longest_edge": 32}},
    "no-splitting": {"size": {"longest_edge": 80}, "max_image_size": {"longest_edge": 28},
                     "do_image_splitting": False},
    "bilinear-odd": {"size": {"longest_edge": 75}, "max_image_size": {"longest_edge": 25}, "resample": 2,
                     "image_mean": [0.48, 0.45, 0.4], "image_std": [0.26, 0.26, 0.27]},
    "no-normalize": {"size": {"longest_edge": 64}, "max_image_size": {"longest_edge": 24},
                     "do_normalize": False, "rescale_factor": 0.5},
}


def _images() -> list[Image.Image]:
    rgba = random_image(5, (33, 47), "RGBA")
    rgba.putalpha(Image.fromarray(np.random.default_rng(6).integers(0, 256, (47, 33), dtype=np.uint8)))
    return [random_image(1, (40, 50)), random_image(2, (301, 97)), random_image(3, (17, 17), "L"),
            random_image(4, (64, 48), "P"), random_image(7, (50, 50), "CMYK"), rgba,
            random_image(8, (300, 7)), random_image(9, (9, 251))]


@pytest.mark.parametrize("family", ["Idefics3", "SmolVLM"])
@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_frames_and_grid_equal_transformers(name: str, family: str) -> None:
    processor = getattr(tf, f"{family}ImageProcessorPil")(**CONFIGS[name])
    ours = TilePreprocess.from_config(processor.to_dict())
    images = [random_image(10, (640, 480))] if name == "smolvlm-256m" else _images()
    expected = processor(images=[images], return_tensors="np", return_row_col_info=True)
    assert expected["pixel_attention_mask"].all()  # every frame a full tile: no padding to follow
    frames = [ours(image) for image in images]
    got = np.concatenate([f for f, _, _ in frames])
    assert got.dtype == np.float32 and got.shape == expected["pixel_values"][0].shape
    np.testing.assert_allclose(got, expected["pixel_values"][0], atol=1e-6, rtol=0)
    assert [(r, c) for _, r, c in frames] == list(zip(expected["rows"][0], expected["cols"][0], strict=True))
    if name == "smolvlm-256m":
        assert got.shape == (13, 3, 512, 512) and frames[0][1:] == (3, 4)  # 640x480: 4x3 tiles + global


def test_the_resize_rounds_as_transformers() -> None:
    """The longest edge becomes the target, the other ``int(target / aspect)`` rounded up to
    even, then at most 4096 (transformers' two helpers, on odd and extreme sizes)."""
    from transformers.models.idefics3 import image_processing_pil_idefics3 as reference

    for height, width in ((480, 640), (7, 300), (251, 9), (1, 1), (333, 333), (5000, 20), (3, 4096)):
        for longest in (30, 364, 1456, 2048, 5000):
            expected = reference._resize_output_size_rescale_to_max_len(height, width, max_len=longest)
            expected = reference._resize_output_size_scale_below_upper_bound(
                *expected, max_len=4096)  # type: ignore[arg-type]  # (transformers' annotation is wrong)
            assert longest_edge_size(height, width, longest) == expected, (height, width, longest)


def test_records_read_back() -> None:
    ours = TilePreprocess.from_config(CONFIGS["smolvlm-256m"])
    assert TilePreprocess.from_record(ours.record()) == ours
    prompt = TilePrompt(image=9, tokens_per_tile=2, fake=(5,), global_image=(6,), newline=(7,),
                        last_newlines=(7, 7), tile_tags=(((11,), (12,)), ((13,), (14,))))
    assert TilePrompt.from_record(prompt.record()) == prompt
    assert prompt.tokens(0, 0) == (5, 6, 9, 9, 5)
    assert prompt.tokens(2, 1) == (5, 11, 9, 9, 7, 5, 13, 9, 9, 7, 7, 5, 6, 9, 9, 5)
    with pytest.raises(ValueError, match="tile tags up to 2x2"):
        prompt.tokens(3, 1)


@pytest.mark.parametrize(("raw", "field"), [
    ({"image_processor_type": "SiglipImageProcessor"}, "image_processor_type"),
    ({"size": {"height": 30, "width": 40}}, "size.height"),
    ({"max_image_size": {"longest_edge": 0}}, "max_image_size.longest_edge"),
    ({"size": 512}, "size must be an object"),
    ({"resample": 9}, "resample"),
    ({"image_std": [1, 0, 1]}, "image_std"),
    ({"do_resize": False}, "do_resize false with do_image_splitting"),
])
def test_unsupported_configs_are_refused_by_name(raw: dict[str, Any], field: str) -> None:
    with pytest.raises(PreprocessConfigError, match=field):
        TilePreprocess.from_config(raw)


@pytest.mark.parametrize("family", ["idefics3", "smolvlm"])
@pytest.mark.parametrize("n_images", [0, 1, 2])
def test_input_ids_equal_the_processors(family: str, n_images: int,
                                        tiled_bundles: Callable[[str], tuple[Path, Path]]) -> None:
    """Our tokenizer and chat template (read from the bundle) and each image's tokens in place of
    its ``<image>`` give the processor's input ids; the frames its pixel values."""
    checkpoint, bundle = tiled_bundles(family)
    images = [random_image(i, (40 + 30 * i, 50 - 10 * i)) for i in range(n_images)]
    user = [{"type": "text", "text": "Look:"}, *([{"type": "image"}] * n_images),
            {"type": "text", "text": "what is it?"}]
    messages = [{"role": "system", "content": [{"type": "text", "text": "Be brief."}]},
                {"role": "user", "content": user}]
    tok = load_tokenizer(bundle)
    ours = tok.apply_chat_template(messages, add_generation_prompt=True)
    if family == "idefics3":
        processor = tf.AutoProcessor.from_pretrained(checkpoint)
        assert type(processor.image_processor).__name__ == "Idefics3ImageProcessorPil"
        assert ours == processor.apply_chat_template(messages, add_generation_prompt=True)
        expected = processor(images=images or None, text=ours, return_tensors="np")
    else:
        expected = smolvlm_inputs(checkpoint, ours, images)
    engine = load_ort_engine(bundle, max_slots=1)
    assert isinstance(engine, ImageEngine) and engine.vision is not None
    prepared = [engine.vision.prepare(im) for im in images]
    ids, rows = expand_placeholders(tok.encode(ours), engine.vision, [p.tokens for p in prepared])
    assert ids == expected["input_ids"][0].tolist()
    assert len(rows) == sum(p.rows for p in prepared) == sum(t == engine.vision.image_token_id for t in ids)
    if images:
        pixels = np.concatenate([p.inputs["pixel_values"] for p in prepared])
        np.testing.assert_allclose(pixels, expected["pixel_values"][0], atol=1e-6, rtol=0)
        assert len(pixels) > 2 * n_images  # the images were split into tiles
