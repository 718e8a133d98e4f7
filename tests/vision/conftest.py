"""Fixtures of the vision-language tests: tiny random LLaVA, Idefics3 and SmolVLM checkpoints
written by transformers with their processors, their bundles, transformers' model and processor,
and test images."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from PIL import Image

from tests.support.tiny_models import bundle_factory
from tests.trt.conftest import fake_trt  # noqa: F401 - fixture: the fake tensorrt (re-exported)
from tests.vision.checkpoints import write_tiny_idefics3, write_tiny_llava


@pytest.fixture(scope="session")
def llava_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny LLaVA (CLIP 32x32 / patch 8, 3 layers, feature layer -2, strategy default; Llama)."""
    return write_tiny_llava(tmp_path_factory.mktemp("llava"))


@pytest.fixture(scope="session")
def built_bundle(tmp_path_factory: pytest.TempPathFactory) -> Callable[..., Path]:
    """Factory: (checkpoint dir, **spec fields) -> bundle dir, built once per session."""
    return bundle_factory(tmp_path_factory)


@pytest.fixture(scope="session")
def llava_bundle(llava_checkpoint: Path, built_bundle: Callable[..., Path]) -> Path:
    """The tiny LLaVA built (fp32, input 128 tokens: two images and some text)."""
    return built_bundle(llava_checkpoint, max_input_len=128)


@pytest.fixture(scope="session")
def hf_llava(llava_checkpoint: Path) -> tuple[Any, Any]:
    """transformers' model (fp32) and processor of the tiny checkpoint."""
    torch = pytest.importorskip("torch")
    tf = pytest.importorskip("transformers")
    model = tf.LlavaForConditionalGeneration.from_pretrained(llava_checkpoint, dtype=torch.float32).eval()
    return model, tf.AutoProcessor.from_pretrained(llava_checkpoint)


@pytest.fixture(scope="session")
def tiled_bundles(tmp_path_factory: pytest.TempPathFactory,
                  built_bundle: Callable[..., Path]) -> Callable[[str], tuple[Path, Path]]:
    """Factory: family ("idefics3" / "smolvlm") -> (tiny checkpoint, its fp32 bundle), made once:
    32-pixel tiles of 4 tokens, images resized to 96 pixels first (up to 3x3 tiles); the SmolVLM
    one ties its lm_head through the top-level tie_word_embeddings."""
    made: dict[str, tuple[Path, Path]] = {}

    def get(family: str) -> tuple[Path, Path]:
        if family not in made:
            ckpt = write_tiny_idefics3(tmp_path_factory.mktemp(family), family=family,  # type: ignore[arg-type]
                                       tied=family == "smolvlm")
            made[family] = ckpt, built_bundle(ckpt, max_input_len=256, max_kv_cache_capacity=384)
        return made[family]

    return get


@pytest.fixture
def copy_checkpoint(tmp_path: Path) -> Callable[[Path], Path]:
    """Factory: a copy of a checkpoint directory under tmp_path (to damage it safely)."""
    import shutil

    def copy(src: Path) -> Path:
        dst = tmp_path / f"copy-{src.name}"
        shutil.copytree(src, dst)
        return dst

    return copy


def random_image(seed: int, size: tuple[int, int], mode: str = "RGB") -> Image.Image:
    """A seeded noise image of ``size`` (width, height) in ``mode``."""
    rng = np.random.default_rng(seed)
    pixels = rng.integers(0, 256, (size[1], size[0], 3), dtype=np.uint8)
    return Image.fromarray(pixels).convert(mode)


def smolvlm_inputs(checkpoint: Path, prompt: str, images: list[Image.Image]) -> dict[str, Any]:
    """SmolVLMProcessor's __call__ (it cannot be built here: it needs num2words and torchvision for
    its video processor): each ``<image>`` replaced by ``get_image_prompt_string`` of the image
    processor's rows and columns, then tokenized."""
    tf = pytest.importorskip("transformers")
    from transformers.models.smolvlm.processing_smolvlm import get_image_prompt_string

    seq_len = json.loads((checkpoint / "processor_config.json").read_text())["image_seq_len"]
    image_processor = tf.AutoImageProcessor.from_pretrained(checkpoint)
    tokenizer = tf.AutoTokenizer.from_pretrained(checkpoint)
    pixels = image_processor(images=[images], return_tensors="np", return_row_col_info=True) if images else {}
    pieces = prompt.split("<image>")
    text = pieces[0]
    for i, piece in enumerate(pieces[1:]):
        text += get_image_prompt_string(pixels["rows"][0][i], pixels["cols"][0][i], seq_len,
                                        "<fake_token_around_image>", "<image>", "<global-img>") + piece
    return {"input_ids": tokenizer(text, return_tensors="np")["input_ids"],
            "pixel_values": pixels.get("pixel_values")}
