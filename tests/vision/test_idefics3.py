"""Idefics3 and SmolVLM built into bundles and run by the CPU engine, against transformers on tiny
random checkpoints: the vision graph's features (tiles, pixel shuffle, bucketed positions), and
greedy tokens for prompts with one and two images (split into tiles) equal to ``generate``."""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from PIL import Image

from inference.builder import EngineBuildSpec, build_bundle
from inference.builder.errors import BuildInputError
from inference.builder.vision_idefics3 import position_ids
from inference.errors import UnsupportedFeatureError
from inference.runtime.onnxruntime_loader import load_ort_engine
from inference.runtime.protocol import ImageEngine
from inference.runtime.vision_idefics3 import TiledVisionEncoder
from tests.vision.checkpoints import write_tiny_idefics3
from tests.vision.conftest import random_image, smolvlm_inputs

tf = pytest.importorskip("transformers")

STEPS = 16
FAMILIES = ["idefics3", "smolvlm"]
#: 3x3 tiles + global (10 frames) and 2x3 tiles + global (7 frames) at 96 pixels.
IMAGES = [random_image(1, (40, 50)), random_image(2, (70, 30))]


def _model(checkpoint: Path, family: str) -> Any:
    cls = tf.Idefics3ForConditionalGeneration if family == "idefics3" else tf.SmolVLMForConditionalGeneration
    return cls.from_pretrained(checkpoint, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def hf_models(tiled_bundles: Callable[[str], tuple[Path, Path]]) -> dict[str, Any]:
    return {family: _model(tiled_bundles(family)[0], family) for family in FAMILIES}


@pytest.fixture(scope="module")
def engines(tiled_bundles: Callable[[str], tuple[Path, Path]]) -> dict[str, ImageEngine]:
    out: dict[str, ImageEngine] = {}
    for family in FAMILIES:
        engine = load_ort_engine(tiled_bundles(family)[1], max_slots=1)
        assert isinstance(engine, ImageEngine)
        out[family] = engine
    return out


def _inputs(family: str, checkpoint: Path, images: Sequence[Image.Image], text: str) -> dict[str, Any]:
    """The processor's inputs (SmolVLM's as its processor makes them) for a user turn."""
    parts = [*([{"type": "image"}] * len(images)), {"type": "text", "text": text}]
    messages = [{"role": "user", "content": parts}]
    if family == "idefics3":
        processor = tf.AutoProcessor.from_pretrained(checkpoint)
        prompt = processor.apply_chat_template(messages, add_generation_prompt=True)
        inputs: dict[str, Any] = dict(processor(images=list(images), text=prompt, return_tensors="pt"))
        return inputs
    template = json.loads((checkpoint / "chat_template.json").read_text())["chat_template"]
    prompt = tf.AutoTokenizer.from_pretrained(checkpoint).apply_chat_template(
        messages, chat_template=template, add_generation_prompt=True, tokenize=False)
    raw = smolvlm_inputs(checkpoint, prompt, list(images))
    return {"input_ids": torch.from_numpy(raw["input_ids"]),
            "pixel_values": torch.from_numpy(raw["pixel_values"])}


def _reference(model: Any, inputs: dict[str, Any]) -> list[int]:
    """transformers' greedy tokens (generate, do_sample=False) after the prompt."""
    with torch.no_grad():
        out = model.generate(**inputs, max_new_tokens=STEPS, do_sample=False)
    n = inputs["input_ids"].shape[1]
    tokens: list[int] = out[0, n:].tolist()
    return tokens


def _engine_greedy(engine: ImageEngine, ids: list[int], images: Sequence[Image.Image]) -> list[int]:
    vision = engine.vision
    assert vision is not None
    features = np.concatenate(vision.features([vision.prepare(im) for im in images]))
    rows = np.array([i for i, t in enumerate(ids) if t == vision.image_token_id])
    logits = engine.prefill_images(0, ids, rows, features)
    tokens: list[int] = []
    for _ in range(STEPS):
        tokens.append(int(np.argmax(logits)))
        logits = engine.decode([0], [tokens[-1]])[0]
    engine.reset(0)
    return tokens


@pytest.mark.parametrize("family", FAMILIES)
def test_bundle_records_its_vision_side(family: str,
                                        tiled_bundles: Callable[[str], tuple[Path, Path]]) -> None:
    _, bundle = tiled_bundles(family)
    meta = json.loads((bundle / "engine.json").read_text())
    arch = "Idefics3ForConditionalGeneration" if family == "idefics3" else "SmolVLMForConditionalGeneration"
    assert meta["architecture"] == arch and meta["model_type"] == "llama"
    assert meta["tied_lm_head"] is (family == "smolvlm")  # tie_word_embeddings of the top level
    vision = meta["vision"]
    assert vision["family"] == family and vision["precision"] == "fp32"
    assert vision["tokens_per_image"] is None and vision["tokens_per_tile"] == 4
    assert vision["placeholder_id"] == vision["image_token_id"] == vision["prompt"]["image"]
    assert vision["preprocess"]["tile"] == vision["image_size"] == 32
    assert len(vision["prompt"]["tile_tags"]) == 4  # 96 pixels: up to 3 rows (4 with the even rounding)
    assert {"model.vision.onnx", "model.vision.onnx.data"} <= set(meta["files"])
    assert meta["inputs"][-2:] == ["image_features", "image_rows"]


@pytest.mark.parametrize("family", FAMILIES)
def test_vision_features_match_transformers(family: str, engines: dict[str, ImageEngine],
                                            hf_models: dict[str, Any]) -> None:
    pixels = torch.randn(1, 6, 3, 32, 32, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        expected = hf_models[family].model.get_image_features(pixels).pooler_output[0].numpy()
    vision = engines[family].vision
    assert isinstance(vision, TiledVisionEncoder)
    got = vision.encode(pixels[0].numpy())  # six frames: two runs of the graph
    assert got.shape == (6, 4, 64) and expected.shape == (24, 64)
    np.testing.assert_allclose(got.reshape(24, 64), expected, atol=1e-4, rtol=0)
    assert np.abs(expected).max() > 0.5  # features of magnitude, so the tolerance means something


def test_position_buckets_are_transformers() -> None:
    """The position table's rows equal transformers' bucketing of a full frame, identity or not."""
    from transformers.models.idefics3.modeling_idefics3 import Idefics3VisionEmbeddings

    not_identity = 0
    for side in range(1, 41):
        for grid in {side, side + 3, max(1, side - 2)}:
            config = tf.Idefics3VisionConfig(hidden_size=4, image_size=side, patch_size=1)
            embed = Idefics3VisionEmbeddings(config)
            with torch.no_grad():
                embed.patch_embedding.weight.zero_()
                embed.patch_embedding.bias.zero_()  # type: ignore[union-attr]
                embed.position_embedding.weight.copy_(torch.arange(side * side, dtype=torch.float32)[:, None])
                out = embed(torch.zeros(1, 3, grid, grid), torch.ones(1, grid, grid, dtype=torch.bool))
            expected = out[0, :, 0].long().tolist()
            assert position_ids(side, grid).tolist() == expected, (side, grid)
            not_identity += grid == side and expected != list(range(side * side))
    assert not_identity >= 3  # sides 19, 25, 29, 31, ...: the table is not arange


def test_features_of_a_tower_whose_buckets_are_not_the_identity(tmp_path: Path) -> None:
    """25 patches a side (transformers puts several in their neighbours' buckets) and tiles larger
    than the tower's image_size (positions stretched over more patches): still transformers'."""
    for name, tile in (("side25", 50), ("tile-larger", 60)):
        ckpt = write_tiny_idefics3(tmp_path / name, seed=4, scale_factor=5, tile=tile,
                                   vision={"image_size": 50, "patch_size": 2, "num_hidden_layers": 1},
                                   longest_edge=2 * tile)
        out = tmp_path / f"{name}-bundle"
        out.mkdir()
        build_bundle(ckpt, out, EngineBuildSpec(max_input_len=256, max_kv_cache_capacity=384))
        engine = load_ort_engine(out, max_slots=1)
        assert isinstance(engine, ImageEngine) and isinstance(engine.vision, TiledVisionEncoder)
        pixels = torch.randn(1, 2, 3, tile, tile, generator=torch.Generator().manual_seed(2))
        with torch.no_grad():
            expected = _model(ckpt, "idefics3").model.get_image_features(pixels).pooler_output[0].numpy()
        got = engine.vision.encode(pixels[0].numpy())
        np.testing.assert_allclose(got.reshape(expected.shape), expected, atol=1e-4, rtol=0)


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("n_images", [1, 2])
def test_greedy_tokens_equal_transformers(family: str, n_images: int, engines: dict[str, ImageEngine],
                                          hf_models: dict[str, Any],
                                          tiled_bundles: Callable[[str], tuple[Path, Path]]) -> None:
    images = IMAGES[:n_images]
    inputs = _inputs(family, tiled_bundles(family)[0], images, "What is in the picture?")
    expected = _reference(hf_models[family], inputs)
    ids = inputs["input_ids"][0].tolist()
    assert len(inputs["pixel_values"][0]) == [10, 17][n_images - 1]  # 3x3 and 2x3 tiles, global images
    assert len(expected) == STEPS  # the random model never says EOS in these prompts
    assert _engine_greedy(engines[family], ids, images) == expected


@pytest.mark.parametrize("family", FAMILIES)
def test_the_image_changes_the_answer(family: str, engines: dict[str, ImageEngine], hf_models: dict[str, Any],
                                      tiled_bundles: Callable[[str], tuple[Path, Path]]) -> None:
    """The same prompt with another image of the same tiling changes transformers' answer, and
    ours with it: every frame's rows reach the language model (a test that cannot pass by
    ignoring the images)."""
    checkpoint = tiled_bundles(family)[0]
    other = random_image(3, (40, 50))
    first, second = (_inputs(family, checkpoint, [im], "Describe.") for im in (IMAGES[0], other))
    assert torch.equal(first["input_ids"], second["input_ids"])
    forward, backward = (_reference(hf_models[family], inputs) for inputs in (first, second))
    assert forward != backward
    ids = first["input_ids"][0].tolist()
    assert _engine_greedy(engines[family], ids, [other]) == backward


def test_prefill_in_chunks_splits_an_images_rows(tiled_bundles: Callable[[str], tuple[Path, Path]],
                                                 built_bundle: Callable[..., Path],
                                                 hf_models: dict[str, Any]) -> None:
    """A bundle whose prefill chunk (max_input_len, 15) cuts the image's tokens inside a tile's
    rows and between markers: every chunk gets its own rows, the answer is transformers'."""
    checkpoint = tiled_bundles("idefics3")[0]
    chunk = 15
    chunked = load_ort_engine(built_bundle(checkpoint, max_input_len=chunk, max_kv_cache_capacity=384),
                              max_slots=1)
    assert isinstance(chunked, ImageEngine) and chunked.vision is not None
    inputs = _inputs("idefics3", checkpoint, IMAGES[1:], "Where?")
    ids = inputs["input_ids"][0].tolist()
    image = chunked.vision.image_token_id
    cuts = list(range(chunk, len(ids), chunk))
    assert any(ids[i - 1] == ids[i] == image for i in cuts)  # a cut inside a tile's rows
    assert any(ids[i] != image and image in ids[i:] for i in cuts)  # and one among the markers
    assert _engine_greedy(chunked, ids, IMAGES[1:]) == _reference(hf_models["idefics3"], inputs)


def test_an_int8_bundle_keeps_an_fp32_vision_graph(tiled_bundles: Callable[[str], tuple[Path, Path]],
                                                   built_bundle: Callable[..., Path],
                                                   engines: dict[str, ImageEngine]) -> None:
    """int8 quantizes the language model only: the vision graph is the fp32 bundle's, byte for
    byte, and the quantized language model takes the image rows (logits close to fp32's)."""
    checkpoint, fp32_bundle = tiled_bundles("smolvlm")
    int8 = built_bundle(checkpoint, max_input_len=256, max_kv_cache_capacity=384, precision="int8")
    meta, fp32 = (json.loads((b / "engine.json").read_text()) for b in (int8, fp32_bundle))
    assert meta["precision"] == "int8" and meta["vision"] == fp32["vision"]
    for name in ("model.vision.onnx", "model.vision.onnx.data"):
        assert meta["files"][name]["sha256"] == fp32["files"][name]["sha256"]
    quantized = load_ort_engine(int8, max_slots=1)
    assert isinstance(quantized, ImageEngine) and quantized.vision is not None
    vision = quantized.vision
    prepared = vision.prepare(IMAGES[1])
    ids = [5, 6, *prepared.tokens, 7, 8]
    (features,) = vision.features([prepared])
    rows = np.array([i for i, t in enumerate(ids) if t == vision.image_token_id])
    engine = engines["smolvlm"]
    got, want = (e.prefill_images(0, ids, rows, features) for e in (quantized, engine))
    engine.reset(0)
    quantized.reset(0)
    text_only = quantized.prefill(0, ids)  # the image tokens' own embeddings instead
    quantized.reset(0)
    assert np.abs(got - text_only).max() > 0.5  # the rows matter
    cosine = float(got @ want / (np.linalg.norm(got) * np.linalg.norm(want)))
    assert cosine > 0.99, cosine


def _config_edit(checkpoint: Path, name: str, edit: Callable[[dict[str, Any]], None]) -> None:
    path = checkpoint / name
    raw = json.loads(path.read_text())
    edit(raw)
    path.write_text(json.dumps(raw))


@pytest.mark.parametrize(("name", "edit", "error", "message"), [
    ("config.json", lambda c: c.update(scale_factor=3), BuildInputError,
     r"scale_factor 3 does not divide the 4x4 patches"),
    ("config.json", lambda c: c["vision_config"].update(model_type="clip_vision_model"),
     UnsupportedFeatureError, r"vision_config\.model_type 'clip_vision_model' is not supported for smolvlm"),
    ("config.json", lambda c: c["vision_config"].update(hidden_act="relu"), UnsupportedFeatureError,
     r"vision_config\.hidden_act 'relu'"),
    ("config.json", lambda c: c.update(image_token_id=5), BuildInputError,
     r"makes '<image>' \[\d+\], not config\.json image_token_id \[5\]"),
    ("processor_config.json", lambda c: c.update(image_seq_len=16), BuildInputError,
     r"image_seq_len 16 is not the 4 image tokens"),
    ("preprocessor_config.json", lambda c: c.update(do_resize=False), BuildInputError,
     r"do_resize false with do_image_splitting"),
    ("preprocessor_config.json", lambda c: c.update(size={"height": 64, "width": 64}), BuildInputError,
     r"size\.height is not supported"),
])
def test_refusals_name_the_field(name: str, edit: Callable[[dict[str, Any]], None], error: type[Exception],
                                 message: str, tiled_bundles: Callable[[str], tuple[Path, Path]],
                                 copy_checkpoint: Callable[[Path], Path], tmp_path: Path) -> None:
    broken = copy_checkpoint(tiled_bundles("smolvlm")[0])
    _config_edit(broken, name, edit)
    out = tmp_path / "out"
    out.mkdir()
    with pytest.raises(error, match=message):
        build_bundle(broken, out, EngineBuildSpec(max_input_len=256, max_kv_cache_capacity=384))
    assert not any(out.iterdir())


def test_spec_refusals(tiled_bundles: Callable[[str], tuple[Path, Path]], tmp_path: Path) -> None:
    checkpoint = tiled_bundles("idefics3")[0]
    out = tmp_path / "out"
    out.mkdir()
    with pytest.raises(BuildInputError, match="lora"):
        build_bundle(checkpoint, out, EngineBuildSpec(lora=True))
    with pytest.raises(BuildInputError, match="one image takes at least 7 prompt tokens"):
        build_bundle(checkpoint, out, EngineBuildSpec(max_input_len=7, max_kv_cache_capacity=64))
    assert not any(out.iterdir())


def test_the_tensorrt_builder_refuses_it(fake_trt: Any, tiled_bundles: Callable[[str], tuple[Path, Path]],
                                         tmp_path: Path) -> None:
    from inference.builder.trt_backend import TrtBuildSpec, build_trt_bundle

    out = tmp_path / "trt"
    out.mkdir()
    spec = TrtBuildSpec(max_kv_cache_capacity=256, max_input_len=64, timing_cache_dir=tmp_path / "timing")
    with pytest.raises(BuildInputError, match="built by the onnxruntime backend only"):
        build_trt_bundle(tiled_bundles("smolvlm")[0], out, spec)
    assert not any(out.iterdir())
