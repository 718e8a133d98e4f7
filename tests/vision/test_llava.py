"""LLaVA built into a bundle and run by the CPU engine, against transformers on a tiny random
checkpoint: the vision graph's features, and greedy tokens for prompts with one and two images."""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import onnx
import pytest
import torch
from PIL import Image

from inference.builder import EngineBuildSpec, build_bundle
from inference.builder.errors import BuildInputError
from inference.runtime.onnxruntime_loader import load_ort_engine
from inference.runtime.protocol import ImageEngine
from inference.runtime.vision_encoder import ClipVisionEncoder
from tests.vision.checkpoints import write_tiny_llava
from tests.vision.conftest import random_image

STEPS = 16
IMAGES = [random_image(1, (40, 50)), random_image(2, (64, 48))]


def _messages(n_images: int, text: str) -> list[dict[str, Any]]:
    return [{"role": "user", "content": [*([{"type": "image"}] * n_images), {"type": "text", "text": text}]}]


def _reference(hf: tuple[Any, Any], images: Sequence[Image.Image],
               text: str) -> tuple[list[int], list[int], Any]:
    """transformers: (prompt ids, greedy tokens of generate(do_sample=False), pixel values); the
    tokens stop early only at EOS, which the engine's 16 then continue past."""
    model, processor = hf
    prompt = processor.apply_chat_template(_messages(len(images), text), add_generation_prompt=True)
    inputs = processor(images=list(images), text=prompt, return_tensors="pt")
    with torch.no_grad():
        out = model.generate(**inputs, max_new_tokens=STEPS, do_sample=False)
    ids = inputs["input_ids"][0].tolist()
    return ids, out[0, len(ids):].tolist(), inputs["pixel_values"]


def _engine_greedy(engine: ImageEngine, ids: list[int], images: Sequence[Image.Image]) -> list[int]:
    vision = engine.vision
    assert vision is not None
    features = np.concatenate(vision.features([vision.prepare(im) for im in images]))
    rows = np.array([i for i, t in enumerate(ids) if t == vision.image_token_id])
    logits = engine.prefill_images(0, ids, rows, features.reshape(len(rows), -1))
    tokens: list[int] = []
    for _ in range(STEPS):
        tokens.append(int(np.argmax(logits)))
        logits = engine.decode([0], [tokens[-1]])[0]
    engine.reset(0)
    return tokens


@pytest.fixture(scope="module")
def engine(llava_bundle: Path) -> ImageEngine:
    loaded = load_ort_engine(llava_bundle, max_slots=2)
    assert isinstance(loaded, ImageEngine)
    return loaded


def test_bundle_records_its_vision_side(llava_bundle: Path) -> None:
    meta = json.loads((llava_bundle / "engine.json").read_text())
    assert meta["architecture"] == "LlavaForConditionalGeneration" and meta["model_type"] == "llama"
    vision = meta["vision"]
    assert vision["precision"] == "fp32" and vision["tokens_per_image"] == 16
    # No image-token limits in the profile: one image's tokens, 16 images within max_input_len 128.
    assert (vision["max_image_tokens"], vision["max_image_tokens_per_image"]) == (128, 16)
    assert {"model.vision.onnx", "model.vision.onnx.data"} <= set(meta["files"])
    assert meta["inputs"][-2:] == ["image_features", "image_rows"]


def test_vision_features_match_transformers(engine: ImageEngine, hf_llava: tuple[Any, Any]) -> None:
    model, _ = hf_llava
    pixels = torch.randn(3, 3, 32, 32, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        out = model.model.get_image_features(
            pixels, vision_feature_layer=model.config.vision_feature_layer,
            vision_feature_select_strategy=model.config.vision_feature_select_strategy)
    expected = torch.stack(list(out.pooler_output)).numpy()
    assert isinstance(engine.vision, ClipVisionEncoder)
    got = engine.vision.encode(pixels.numpy())
    assert got.shape == expected.shape == (3, 16, 64)
    np.testing.assert_allclose(got, expected, atol=1e-4, rtol=0)
    assert np.abs(expected).max() > 0.1  # features of magnitude, so the tolerance means something


@pytest.mark.parametrize("n_images", [1, 2])
def test_greedy_tokens_equal_transformers(engine: ImageEngine, hf_llava: tuple[Any, Any],
                                          n_images: int) -> None:
    images = IMAGES[:n_images]
    ids, expected, _ = _reference(hf_llava, images, "What is in the picture?")
    assert sum(1 for t in ids if t == 1024) == 16 * n_images
    assert len(expected) == STEPS  # the random model never says EOS in these prompts
    assert _engine_greedy(engine, ids, images) == expected


def test_the_image_changes_the_answer(engine: ImageEngine, hf_llava: tuple[Any, Any]) -> None:
    """Swapping the two images changes transformers' answer, and ours with it: the features reach
    the language model at the right rows (a test that cannot pass by ignoring the images)."""
    ids, forward, _ = _reference(hf_llava, IMAGES, "Compare them.")
    _, backward, _ = _reference(hf_llava, IMAGES[::-1], "Compare them.")
    assert forward != backward
    assert _engine_greedy(engine, ids, IMAGES[::-1]) == backward


def test_prefill_in_chunks_splits_the_image_rows(llava_checkpoint: Path, built_bundle: Callable[..., Path],
                                                 hf_llava: tuple[Any, Any]) -> None:
    """A bundle whose prefill chunk (the engine's: max_input_len, 24) cuts through an image's
    tokens: the chunk after the cut still gets the rest of that image's rows."""
    chunked = load_ort_engine(built_bundle(llava_checkpoint, max_input_len=24), max_slots=1)
    assert isinstance(chunked, ImageEngine) and chunked.vision is not None
    ids, expected, _ = _reference(hf_llava, IMAGES, "Two?")
    rows = [i for i, t in enumerate(ids) if t == chunked.vision.image_token_id]
    assert any(r % 24 == 0 for r in rows[1:])  # a chunk boundary inside the image rows
    assert _engine_greedy(chunked, ids, IMAGES) == expected


def test_full_strategy_and_several_feature_layers(tmp_path: Path) -> None:
    """vision_feature_select_strategy full (CLS row kept) and a list of feature layers."""
    tf = pytest.importorskip("transformers")
    ckpt = write_tiny_llava(tmp_path / "ckpt", seed=3, strategy="full", feature_layer=[-3, -1])
    out = tmp_path / "bundle"
    out.mkdir()
    build_bundle(ckpt, out, EngineBuildSpec(max_kv_cache_capacity=128, max_input_len=64))
    model = tf.LlavaForConditionalGeneration.from_pretrained(ckpt, dtype=torch.float32).eval()
    pixels = torch.randn(2, 3, 32, 32, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        out_hf = model.model.get_image_features(pixels, vision_feature_layer=[-3, -1],
                                                vision_feature_select_strategy="full")
    expected = torch.stack(list(out_hf.pooler_output)).numpy()
    engine = load_ort_engine(out, max_slots=1)
    assert isinstance(engine, ImageEngine) and isinstance(engine.vision, ClipVisionEncoder)
    got = engine.vision.encode(pixels.numpy())
    assert got.shape == (2, 17, 64)
    np.testing.assert_allclose(got, expected, atol=1e-4, rtol=0)


def test_refusals_name_the_field(llava_checkpoint: Path, tmp_path: Path,
                                 copy_checkpoint: Callable[[Path], Path]) -> None:
    out = tmp_path / "out"
    out.mkdir()
    with pytest.raises(BuildInputError, match="lora"):
        build_bundle(llava_checkpoint, out, EngineBuildSpec(lora=True))
    with pytest.raises(BuildInputError, match="one image takes 16 prompt tokens"):
        build_bundle(llava_checkpoint, out, EngineBuildSpec(max_input_len=16, max_kv_cache_capacity=64))
    for spec, field in ((EngineBuildSpec(max_input_len=64, max_image_tokens_per_image=8),
                         "max_image_tokens_per_image"),
                        (EngineBuildSpec(max_input_len=64, max_image_tokens=15), "max_image_tokens")):
        refused = rf"{field}: \(\d+\) admits no image: one image of a llava checkpoint takes 16 tokens; raise"
        with pytest.raises(BuildInputError, match=refused):
            build_bundle(llava_checkpoint, out, spec)
    broken = copy_checkpoint(llava_checkpoint)
    (broken / "processor_config.json").unlink()
    with pytest.raises(BuildInputError, match=r"processor_config\.json"):
        build_bundle(broken, out, EngineBuildSpec())
    assert not any(out.iterdir())


def test_text_bundles_are_unchanged(tmp_path: Path) -> None:
    """A text model's graph has no image inputs and no ScatterND (its files are what they were)."""
    from inference.demo import write_demo_checkpoint

    ckpt = write_demo_checkpoint(tmp_path / "llama", arch="llama", size="tiny", seed=1)
    out = tmp_path / "bundle"
    out.mkdir()
    with pytest.raises(BuildInputError, match="max_image_tokens: applies only to a vision-language"):
        build_bundle(ckpt, out, EngineBuildSpec(max_kv_cache_capacity=64, max_input_len=32,
                                                max_image_tokens=16))
    meta = build_bundle(ckpt, out, EngineBuildSpec(max_kv_cache_capacity=64, max_input_len=32))
    assert "vision" not in meta and "image_rows" not in meta["inputs"]
    for name in ("model.onnx", "model.ort.onnx"):
        graph = onnx.load(str(out / name), load_external_data=False).graph
        assert not any(n.op_type == "ScatterND" for n in graph.node)
        assert not any(i.name.startswith("image_") for i in graph.input)


def test_an_int8_bundle_keeps_an_fp32_vision_graph(llava_checkpoint: Path, llava_bundle: Path,
                                                   built_bundle: Callable[..., Path],
                                                   engine: ImageEngine) -> None:
    """int8 quantizes the language model only: the vision graph is the fp32 bundle's, byte for
    byte, and the quantized language model takes the image rows (logits close to fp32's)."""
    int8 = built_bundle(llava_checkpoint, max_input_len=128, precision="int8")
    meta, fp32 = (json.loads((b / "engine.json").read_text()) for b in (int8, llava_bundle))
    assert meta["precision"] == "int8" and meta["vision"]["precision"] == "fp32"
    for name in ("model.vision.onnx", "model.vision.onnx.data"):
        assert meta["files"][name]["sha256"] == fp32["files"][name]["sha256"]
    quantized = load_ort_engine(int8, max_slots=1)
    assert isinstance(quantized, ImageEngine) and quantized.vision is not None
    vision = quantized.vision
    ids = [5, 6, *[vision.image_token_id] * 16, 7, 8, 9]
    (features,) = vision.features([vision.prepare(IMAGES[0])])
    rows = np.arange(2, 18)
    got, want = (e.prefill_images(0, ids, rows, features) for e in (quantized, engine))
    engine.reset(0)
    quantized.reset(0)
    text_only = quantized.prefill(0, ids)  # the image tokens' own embeddings instead
    assert np.abs(got - text_only).max() > 0.5  # the rows matter
    cosine = float(got @ want / (np.linalg.norm(got) * np.linalg.norm(want)))
    assert cosine > 0.99, cosine


def test_a_hub_layout_checkpoint_builds_the_same(llava_checkpoint: Path, llava_bundle: Path, tmp_path: Path,
                                                copy_checkpoint: Callable[[Path], Path]) -> None:
    """The hub's llava-hf layout: preprocessor_config.json (int sizes) instead of transformers 5's
    processor_config.json, the processor's template in chat_template.json; same bundle."""
    hub = copy_checkpoint(llava_checkpoint)
    processor = json.loads((hub / "processor_config.json").read_text())
    image = {**processor["image_processor"], "size": 32, "crop_size": 32}
    (hub / "preprocessor_config.json").write_text(json.dumps(image))
    (hub / "processor_config.json").unlink()
    template = (hub / "chat_template.jinja").read_text()
    (hub / "chat_template.json").write_text(json.dumps({"chat_template": template}))
    (hub / "chat_template.jinja").unlink()
    out = tmp_path / "hub-bundle"
    out.mkdir()
    meta = build_bundle(hub, out, EngineBuildSpec(max_kv_cache_capacity=256, max_input_len=128))
    reference = json.loads((llava_bundle / "engine.json").read_text())
    assert meta["vision"] == reference["vision"]
    assert (out / "chat_template.jinja").read_text() == template
    assert meta["files"]["model.ort.onnx"]["sha256"] == reference["files"]["model.ort.onnx"]["sha256"]


def test_the_tensorrt_builder_refuses_a_vision_checkpoint(fake_trt: Any, llava_checkpoint: Path,
                                                          tmp_path: Path) -> None:
    """The vision graph and the image inputs are the CPU backend's: one line, nothing built."""
    from inference.builder.trt_backend import TrtBuildSpec, build_trt_bundle

    out = tmp_path / "trt"
    out.mkdir()
    spec = TrtBuildSpec(max_kv_cache_capacity=256, max_input_len=64, timing_cache_dir=tmp_path / "timing")
    with pytest.raises(BuildInputError, match="built by the onnxruntime backend only"):
        build_trt_bundle(llava_checkpoint, out, spec)
    assert not any(out.iterdir())
