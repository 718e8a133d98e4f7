"""Image preprocessing without torch (Pillow + numpy) against transformers' own processor on the
same images, and the chat template's placeholders expanded to the same input ids."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
from PIL import Image

from inference.images.preprocess import ClipPreprocess, PreprocessConfigError
from inference.openai.images import expand_placeholders
from inference.runtime.onnxruntime_loader import load_ort_engine
from inference.runtime.protocol import ImageEngine
from inference.runtime.vision_encoder import ClipVisionEncoder
from inference.serving.tokenizer import load_tokenizer
from tests.vision.conftest import random_image

CONFIGS: dict[str, dict[str, Any]] = {
    "llava-1.5": {"size": {"shortest_edge": 336}, "crop_size": {"height": 336, "width": 336}},
    "bilinear-uncropped": {"size": {"height": 48, "width": 40}, "do_center_crop": False, "resample": 2},
    "crop-larger-than-image": {"size": {"shortest_edge": 20}, "crop_size": {"height": 32, "width": 24}},
    "no-normalize": {"size": {"shortest_edge": 30}, "crop_size": {"height": 30, "width": 30},
                     "do_normalize": False, "rescale_factor": 0.5},
}


def _images() -> list[Image.Image]:
    rgba = random_image(5, (33, 47), "RGBA")
    rgba.putalpha(Image.fromarray(np.random.default_rng(6).integers(0, 256, (47, 33), dtype=np.uint8)))
    return [random_image(1, (40, 50)), random_image(2, (301, 97)), random_image(3, (17, 17), "L"),
            random_image(4, (64, 48), "P"), random_image(7, (50, 50), "CMYK"), rgba]


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_pixel_values_equal_transformers(name: str) -> None:
    tf = pytest.importorskip("transformers")
    processor = tf.CLIPImageProcessor(**CONFIGS[name])
    ours = ClipPreprocess.from_config(processor.to_dict())
    for image in _images():
        expected = processor(images=[image], return_tensors="np")["pixel_values"][0]
        got = ours(image)
        assert got.dtype == np.float32 and got.shape == expected.shape
        np.testing.assert_allclose(got, expected, atol=1e-6, rtol=0)


def test_a_record_reads_back() -> None:
    ours = ClipPreprocess.from_config(CONFIGS["llava-1.5"])
    assert ClipPreprocess.from_record(ours.record()) == ours


@pytest.mark.parametrize(("raw", "field"), [
    ({"image_processor_type": "SiglipImageProcessor"}, "image_processor_type"),
    ({"size": {"longest_edge": 3}}, "size.longest_edge"),
    ({"resample": 9}, "resample"),
    ({"image_std": [1, 0, 1]}, "image_std"),
    ({"do_pad": True}, "do_pad"),
])
def test_unsupported_configs_are_refused_by_name(raw: dict[str, Any], field: str) -> None:
    with pytest.raises(PreprocessConfigError, match=field):
        ClipPreprocess.from_config(raw)


@pytest.mark.parametrize("n_images", [0, 1, 2])
def test_input_ids_equal_the_processors(llava_bundle: Path, hf_llava: tuple[Any, Any], n_images: int) -> None:
    """Our tokenizer and chat template (read from the bundle) and the expansion of each image
    token give transformers' processor's input ids."""
    _, processor = hf_llava
    images = [random_image(i, (40 + i, 30)) for i in range(n_images)]
    user = [{"type": "text", "text": "Look:"}, *([{"type": "image"}] * n_images),
            {"type": "text", "text": "what is it?"}]
    messages = [{"role": "system", "content": [{"type": "text", "text": "Be brief."}]},
                {"role": "user", "content": user}]
    prompt = processor.apply_chat_template(messages, add_generation_prompt=True)
    expected = processor(images=images or None, text=prompt, return_tensors="np")
    tok = load_tokenizer(llava_bundle)
    ours = tok.apply_chat_template(messages, add_generation_prompt=True)
    assert ours == prompt
    engine = load_ort_engine(llava_bundle, max_slots=1)
    assert isinstance(engine, ImageEngine) and engine.vision is not None
    ids, rows = expand_placeholders(tok.encode(ours), engine.vision,
                                    [engine.vision.fixed_tokens()] * n_images)
    assert ids == expected["input_ids"][0].tolist()
    assert len(rows) == 16 * n_images
    if images:
        assert isinstance(engine.vision, ClipVisionEncoder)
        pixels = np.stack([engine.vision.pixels(im) for im in images])
        np.testing.assert_allclose(pixels, expected["pixel_values"], atol=1e-6, rtol=0)
