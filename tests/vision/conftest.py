"""Fixtures of the vision-language tests: a tiny random LLaVA checkpoint written by transformers
with its processor, its bundle, transformers' model and processor, and test images."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from PIL import Image

from tests.support.tiny_models import bundle_factory
from tests.trt.conftest import fake_trt  # noqa: F401 - fixture: the fake tensorrt (re-exported)
from tests.vision.checkpoints import write_tiny_llava


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
