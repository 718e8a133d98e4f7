"""Qwen2.5-VL built into a bundle and run by the CPU engine, against transformers on a tiny random
checkpoint: preprocessing (pixel values, grids, input ids), the vision graph's features (window
attention), the M-RoPE positions, greedy tokens for prompts with no, one and two images, chunked
prefill, batched decode, the portable graph, an int8 build, the hub's layouts and the refusals."""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import onnx
import onnxruntime as ort
import pytest
import torch
import transformers as tf
from PIL import Image
from safetensors.numpy import load_file, save_file

from cachesvc.cache.checkpoints import check_family
from cachesvc.errors import UnsupportedModelError
from inference.builder import EngineBuildSpec, build_bundle
from inference.builder.errors import BuildInputError
from inference.images.qwen2_5_vl import QwenPreprocess, QwenPreprocessError, smart_resize
from inference.openai.images import expand_placeholders
from inference.runtime.mrope import mrope_positions
from inference.runtime.onnxruntime_loader import load_ort_engine
from inference.runtime.protocol import ImageEngine, KVEngine, PreparedImage
from inference.serving.tokenizer import load_tokenizer
from tests.vision.conftest import random_image
from tests.vision.qwen_checkpoints import IMAGE_PROCESSOR, qwen_processor, write_tiny_qwen2_5_vl

STEPS = 16
#: 40x50 -> 5x6 merged patches, 64x30 -> 8x4: windows of 2x2 merged patches, some partial
IMAGES = [random_image(1, (40, 50)), random_image(2, (64, 30))]


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_qwen2_5_vl(tmp_path_factory.mktemp("qwen2_5_vl"))


@pytest.fixture(scope="module")
def bundle(checkpoint: Path, built_bundle: Callable[..., Path]) -> Path:
    return built_bundle(checkpoint, max_input_len=128)


@pytest.fixture(scope="module")
def hf(checkpoint: Path) -> tuple[Any, Any]:
    model = tf.Qwen2_5_VLForConditionalGeneration.from_pretrained(checkpoint, dtype=torch.float32).eval()
    return model, qwen_processor(checkpoint)


@pytest.fixture(scope="module")
def engine(bundle: Path) -> ImageEngine:
    loaded = load_ort_engine(bundle, max_slots=2)
    assert isinstance(loaded, ImageEngine) and loaded.vision is not None
    return loaded


def _messages(n_images: int, text: str) -> list[dict[str, Any]]:
    return [{"role": "user", "content": [*([{"type": "image"}] * n_images), {"type": "text", "text": text}]}]


def _reference(hf: tuple[Any, Any], images: Sequence[Image.Image], text: str,
               steps: int = STEPS) -> tuple[list[int], list[int]]:
    """transformers: (prompt ids, greedy tokens of generate(do_sample=False))."""
    model, processor = hf
    prompt = processor.apply_chat_template(_messages(len(images), text), add_generation_prompt=True)
    inputs = processor(images=list(images) or None, text=prompt, return_tensors="pt")
    with torch.no_grad():
        out = model.generate(**inputs, max_new_tokens=steps, do_sample=False)
    ids = inputs["input_ids"][0].tolist()
    return ids, out[0, len(ids):].tolist()


def _prefill(engine: ImageEngine, slot: int, ids: list[int], images: Sequence[Image.Image]) -> np.ndarray:
    """The prompt prefilled as the chat turn does it: image rows and their M-RoPE positions."""
    vision = engine.vision
    assert vision is not None
    prepared = [vision.prepare(im) for im in images]
    rows = np.array([i for i, t in enumerate(ids) if t == vision.image_token_id], np.int64)
    features = np.concatenate(vision.features(prepared)) if prepared else np.zeros((0, 64), np.float32)
    grids = [p.grid for p in prepared if p.grid is not None]
    rope = mrope_positions(len(ids), rows, grids)
    return engine.prefill_images(slot, ids, rows, features, rope_positions=rope)


def _greedy(engine: ImageEngine, ids: list[int], images: Sequence[Image.Image],
            steps: int = STEPS) -> list[int]:
    logits = _prefill(engine, 0, ids, images)
    tokens: list[int] = []
    for _ in range(steps):
        tokens.append(int(np.argmax(logits)))
        logits = engine.decode([0], [tokens[-1]])[0]
    engine.reset(0)
    return tokens


def _portable_logits(bundle: Path, ids: list[int], rows: np.ndarray, features: np.ndarray,
                     rope: np.ndarray) -> np.ndarray:
    """The last position's logits of the bundle's portable graph (model.onnx) on the prompt, with
    its image rows and its positions [3, 1, S]."""
    session = ort.InferenceSession(str(bundle / "model.onnx"), providers=["CPUExecutionProvider"])
    feeds: dict[str, np.ndarray] = {
        "input_ids": np.array([ids]), "attention_mask": np.ones((1, len(ids)), np.int64),
        "position_ids": rope[:, None, :], "logits_to_keep": np.array([1]),
        "image_rows": np.stack([np.zeros_like(rows), rows], axis=1), "image_features": features}
    for i in range(2):
        for kind in ("key", "value"):
            feeds[f"past_key_values.{i}.{kind}"] = np.zeros((1, 2, 0, 16), np.float32)
    logits: np.ndarray = session.run(["logits"], feeds)[0][0, -1]
    return logits


def test_bundle_records_its_vision_side(bundle: Path) -> None:
    meta = json.loads((bundle / "engine.json").read_text())
    assert meta["architecture"] == "Qwen2_5_VLForConditionalGeneration" and meta["model_type"] == "qwen2"
    vision = meta["vision"]
    assert (vision["family"], vision["precision"], vision["tokens_per_image"]) == ("qwen2_5_vl", "fp32", None)
    assert vision["placeholder_id"] == vision["image_token_id"] == 1026
    assert {"model.vision.onnx", "model.vision.onnx.data"} <= set(meta["files"])
    # the decoder takes temporal/height/width positions: both graphs, and the engine binds them
    assert "position_ids" in meta["kv_cache"]["inputs"] and "position_ids" in meta["inputs"]
    graph = onnx.load(str(bundle / "model.ort.onnx"), load_external_data=False).graph
    positions = next(i for i in graph.input if i.name == "position_ids")
    assert positions.type.tensor_type.shape.dim[0].dim_value == 3
    assert all(a.i == 0 for n in graph.node if n.op_type == "GroupQueryAttention"
               for a in n.attribute if a.name == "do_rotary")


# -- preprocessing ---------------------------------------------------------------------------

PROCESSORS: dict[str, dict[str, Any]] = {
    "tiny": IMAGE_PROCESSOR,
    "hub-default": {},  # patch 14, merge 2, 3136..1003520 pixels
    "size-dict-bilinear": {"size": {"shortest_edge": 28 * 28, "longest_edge": 56 * 84}, "resample": 2},
    "no-normalize": {**IMAGE_PROCESSOR, "do_normalize": False, "rescale_factor": 0.5},
}


def _images() -> list[Image.Image]:
    rgba = random_image(5, (33, 47), "RGBA")
    rgba.putalpha(Image.fromarray(np.random.default_rng(6).integers(0, 256, (47, 33), dtype=np.uint8)))
    return [random_image(1, (40, 50)), random_image(2, (301, 97)), random_image(3, (5, 9), "L"),
            random_image(4, (64, 48), "P"), random_image(7, (50, 50), "CMYK"), rgba,
            random_image(8, (900, 20)), random_image(9, (700, 500))]


@pytest.mark.parametrize("name", sorted(PROCESSORS))
def test_pixel_values_and_grids_equal_transformers(name: str) -> None:
    """Our patches and grid of every image (small ones upscaled past min_pixels, large ones down
    to max_pixels, long ones, every colour mode) are transformers' PIL processor's."""
    processor = tf.Qwen2VLImageProcessorPil(**PROCESSORS[name])
    ours = QwenPreprocess.from_config(processor.to_dict())
    assert QwenPreprocess.from_record(ours.record()) == ours
    for image in _images():
        expected = processor(images=[image], return_tensors="np")
        patches, (grid_h, grid_w) = ours(image)
        assert [1, grid_h, grid_w] == expected["image_grid_thw"][0].tolist()
        assert patches.dtype == np.float32 and patches.shape == expected["pixel_values"].shape
        np.testing.assert_allclose(patches, expected["pixel_values"], atol=1e-6, rtol=0)


def test_the_hubs_min_and_max_pixels_override_size() -> None:
    """Qwen/Qwen2.5-VL-*'s preprocessor_config.json names min_pixels/max_pixels (no size); where
    both are given, they win over size, as in transformers."""
    hub = {"min_pixels": 3136, "max_pixels": 12845056, "patch_size": 14, "temporal_patch_size": 2,
           "merge_size": 2, "image_processor_type": "Qwen2VLImageProcessor",
           "size": {"shortest_edge": 1, "longest_edge": 2}}
    ours = QwenPreprocess.from_config(hub)
    kwargs: dict[str, Any] = {k: v for k, v in hub.items() if k != "image_processor_type"}
    theirs = tf.Qwen2VLImageProcessorPil(**kwargs)
    assert (ours.min_pixels, ours.max_pixels) == (theirs.size["shortest_edge"], theirs.size["longest_edge"])
    assert (ours.min_pixels, ours.max_pixels) == (3136, 12845056)
    reference = tf.models.qwen2_vl.image_processing_pil_qwen2_vl.smart_resize
    for height, width in ((10, 1000), (1, 150), (4000, 3000), (29, 27), (1000, 5)):
        assert ours.resized_size(height, width) == reference(height, width, 28, 3136, 12845056)


def test_images_transformers_refuses_are_refused() -> None:
    with pytest.raises(ValueError, match="aspect ratio"):
        smart_resize(10, 2500, 28, 3136, 12845056)
    for raw, field in (({"image_processor_type": "SiglipImageProcessor"}, "image_processor_type"),
                       ({"do_resize": False}, "do_resize"), ({"resample": 9}, "resample"),
                       ({"size": {"max_pixels": 4}}, "size.shortest_edge"),
                       ({"min_pixels": 500, "max_pixels": 400}, "min_pixels"),
                       ({"image_std": [1, 0, 1]}, "image_std")):
        with pytest.raises(QwenPreprocessError, match=field):
            QwenPreprocess.from_config(raw)


@pytest.mark.parametrize("n_images", [0, 1, 2])
def test_input_ids_equal_the_processors(bundle: Path, engine: ImageEngine, hf: tuple[Any, Any],
                                        n_images: int) -> None:
    """The bundle's tokenizer and chat template, each placeholder replaced by its image's tokens
    (as many as its grid has merged patches), give the processor's input ids."""
    _, processor = hf
    images = IMAGES[:n_images]
    messages = [{"role": "system", "content": [{"type": "text", "text": "Be brief."}]},
                {"role": "user", "content": [{"type": "text", "text": "Look:"},
                                             *([{"type": "image"}] * n_images),
                                             {"type": "text", "text": "what is it?"}]}]
    prompt = processor.apply_chat_template(messages, add_generation_prompt=True)
    expected = processor(images=images or None, text=prompt, return_tensors="np")
    tok = load_tokenizer(bundle)
    assert tok.apply_chat_template(messages, add_generation_prompt=True) == prompt
    vision = engine.vision
    assert vision is not None and vision.tokens_per_image is None
    prepared = [vision.prepare(im) for im in images]
    ids, rows = expand_placeholders(tok.encode(prompt), vision, [p.tokens for p in prepared])
    assert ids == expected["input_ids"][0].tolist()
    assert [len(p.tokens) for p in prepared] == [30, 32][:n_images]
    if images:
        assert [list(p.grid or ()) for p in prepared] == (expected["image_grid_thw"] // [1, 2, 2]).tolist()
        assert rows.tolist() == np.flatnonzero(expected["mm_token_type_ids"][0]).tolist()


# -- vision graph and positions --------------------------------------------------------------

@pytest.mark.parametrize("image", [*IMAGES, random_image(3, (23, 64)), random_image(4, (17, 17))])
def test_vision_features_match_transformers(engine: ImageEngine, hf: tuple[Any, Any],
                                            image: Image.Image) -> None:
    """Window attention (windows of 2x2 merged patches, partial at the edges) in blocks 0 and 2,
    full attention in 1 and 3, the merger, the rows back in order: transformers' to 1e-4; the
    same tower attending over the whole image everywhere is far off (the windows matter)."""
    model, processor = hf
    inputs = processor.image_processor(images=[image], return_tensors="pt")
    with torch.no_grad():
        expected = model.model.get_image_features(inputs["pixel_values"], inputs["image_grid_thw"])
        expected = expected.pooler_output[0].numpy()
        model.model.visual.fullatt_block_indexes = list(range(4))
        try:
            full = model.model.get_image_features(inputs["pixel_values"], inputs["image_grid_thw"])
        finally:
            model.model.visual.fullatt_block_indexes = [1, 3]
    vision = engine.vision
    assert vision is not None
    (got,) = vision.features([vision.prepare(image)])
    assert got.shape == expected.shape
    np.testing.assert_allclose(got, expected, atol=1e-4, rtol=0)
    assert np.abs(expected).max() > 1.0
    if got.shape[0] > 4:  # more than one window
        assert np.abs(full.pooler_output[0].numpy() - expected).max() > 1e-2


@pytest.mark.parametrize("n_images", [0, 1, 2])
def test_positions_equal_get_rope_index(hf: tuple[Any, Any], n_images: int) -> None:
    model, processor = hf
    prompt = processor.apply_chat_template(_messages(n_images, "Where?"), add_generation_prompt=True)
    inputs = processor(images=IMAGES[:n_images] or None, text=prompt, return_tensors="pt")
    ids = inputs["input_ids"]
    merged = (inputs["image_grid_thw"] // torch.tensor([1, 2, 2])).tolist() if n_images else []
    grids = [(t, h, w) for t, h, w in merged]
    ours = mrope_positions(ids.shape[1], np.flatnonzero(inputs["mm_token_type_ids"][0].numpy()), grids)
    if n_images:
        expected, delta = model.model.get_rope_index(ids, inputs["mm_token_type_ids"],
                                                     inputs["image_grid_thw"])
        np.testing.assert_array_equal(ours, expected[:, 0].numpy())
        assert ours.max() + 1 - ids.shape[1] == int(delta) < 0  # decode continues from here
    else:
        np.testing.assert_array_equal(ours, np.broadcast_to(np.arange(ids.shape[1]), (3, ids.shape[1])))


def test_positions_of_made_up_prompts() -> None:
    """An image first, two side by side, a 1-row image, text after: each image's rows take
    (t, row, column) from where the text stopped; the text after goes on from max + 1."""
    got = mrope_positions(9, np.array([0, 1, 2, 3, 4, 5]), [(1, 2, 2), (1, 1, 2)])
    expected = [[0, 0, 0, 0, 2, 2, 4, 5, 6],
                [0, 0, 1, 1, 2, 2, 4, 5, 6],
                [0, 1, 0, 1, 2, 3, 4, 5, 6]]
    assert got.tolist() == expected
    with pytest.raises(ValueError, match="side by side"):
        mrope_positions(9, np.array([0, 1, 3, 4]), [(1, 2, 2)])
    with pytest.raises(ValueError, match="rows for grids"):
        mrope_positions(9, np.array([0, 1]), [(1, 2, 2)])


# -- the language model ----------------------------------------------------------------------

@pytest.mark.parametrize("n_images", [0, 1, 2])
def test_greedy_tokens_equal_transformers(engine: ImageEngine, hf: tuple[Any, Any], n_images: int) -> None:
    images = IMAGES[:n_images]
    ids, expected = _reference(hf, images, "What is in the picture?")
    assert len(expected) == STEPS  # the random model never says EOS in these prompts
    assert _greedy(engine, ids, images) == expected
    if not n_images:  # a text prompt through the plain path: the positions are the token indices
        logits = engine.prefill(0, ids)
        tokens = [int(np.argmax(logits))]
        for _ in range(STEPS - 1):
            tokens.append(int(np.argmax(engine.decode([0], [tokens[-1]])[0])))
        engine.reset(0)
        assert tokens == expected


def test_the_image_changes_the_answer(engine: ImageEngine, hf: tuple[Any, Any]) -> None:
    """Swapping the two images changes transformers' answer, and ours with it (their features
    and their grids: 5x6 and 8x4 merged patches give different positions after them)."""
    ids, forward = _reference(hf, IMAGES, "Compare them.")
    backward_ids, backward = _reference(hf, IMAGES[::-1], "Compare them.")
    assert forward != backward and ids != backward_ids
    assert _greedy(engine, backward_ids, IMAGES[::-1]) == backward


def test_the_positions_matter(engine: ImageEngine, hf: tuple[Any, Any]) -> None:
    """The image rows at plain positions (what a model without M-RoPE would do) give another
    answer: the test above cannot pass by ignoring the positions."""
    ids, expected = _reference(hf, IMAGES[:1], "What is in the picture?")
    vision = engine.vision
    assert vision is not None
    (features,) = vision.features([vision.prepare(IMAGES[0])])
    rows = np.array([i for i, t in enumerate(ids) if t == vision.image_token_id])
    plain = np.broadcast_to(np.arange(len(ids)), (3, len(ids)))
    logits = engine.prefill_images(0, ids, rows, features, rope_positions=plain)
    tokens = [int(np.argmax(logits))]
    for _ in range(STEPS - 1):
        tokens.append(int(np.argmax(engine.decode([0], [tokens[-1]])[0])))
    engine.reset(0)
    assert tokens != expected
    with pytest.raises(ValueError, match="rope_positions"):
        engine.prefill_images(0, ids, rows, features)


def test_prefill_in_chunks_splits_the_image_rows(checkpoint: Path, built_bundle: Callable[..., Path],
                                                 hf: tuple[Any, Any]) -> None:
    """A prefill chunk (max_input_len 24) that ends inside an image's rows, and text chunks after
    the images that continue from their positions."""
    chunked = load_ort_engine(built_bundle(checkpoint, max_input_len=24), max_slots=1)
    assert isinstance(chunked, ImageEngine) and chunked.vision is not None
    ids, expected = _reference(hf, IMAGES, "Two?")
    rows = [i for i, t in enumerate(ids) if t == chunked.vision.image_token_id]
    assert any(r % 24 == 0 for r in rows[1:])  # a chunk starts inside an image's rows
    assert any(start > rows[-1] for start in range(0, len(ids), 24))  # a chunk of text after the images
    assert _greedy(chunked, ids, IMAGES) == expected


def test_batched_decode_keeps_each_slots_positions(engine: ImageEngine, hf: tuple[Any, Any]) -> None:
    """Slot 0 holds a prompt with an image (its decode positions behind its length), slot 1 a
    text prompt: decoded together, each gets transformers' tokens; a copy of slot 0's prefix
    into slot 1 carries its positions."""
    image_ids, image_expected = _reference(hf, IMAGES[1:], "Describe.", steps=8)
    text_ids, text_expected = _reference(hf, [], "Say something.", steps=8)
    logits = [_prefill(engine, 0, image_ids, IMAGES[1:]), engine.prefill(1, text_ids)]
    tokens: list[list[int]] = [[], []]
    for _ in range(8):
        for slot in (0, 1):
            tokens[slot].append(int(np.argmax(logits[slot])))
        both = engine.decode([0, 1], [tokens[0][-1], tokens[1][-1]])
        logits = [both[0], both[1]]
    assert tokens == [image_expected, text_expected]
    engine.reset(0)
    engine.reset(1)
    first = _prefill(engine, 0, image_ids, IMAGES[1:])
    assert isinstance(engine, KVEngine)
    engine.copy_prefix(0, 1, len(image_ids) - 1)  # as a second choice of the same prompt starts
    again = engine.prefill(1, image_ids[-1:])  # text after the image: the copied positions go on
    np.testing.assert_allclose(again, first, atol=1e-4, rtol=0)
    engine.reset(0)
    engine.reset(1)


def test_the_portable_graph_takes_the_same_positions(bundle: Path, engine: ImageEngine,
                                                     hf: tuple[Any, Any]) -> None:
    """model.onnx (standard ops, opset-23 RotaryEmbedding on per-token tables) with position_ids
    [3, 1, S] and the image rows: the CPU graph's logits."""
    ids, _ = _reference(hf, IMAGES[:1], "What?", steps=1)
    vision = engine.vision
    assert vision is not None
    prepared = vision.prepare(IMAGES[0])
    (features,) = vision.features([prepared])
    rows = np.array([i for i, t in enumerate(ids) if t == vision.image_token_id])
    assert prepared.grid is not None
    rope = mrope_positions(len(ids), rows, [prepared.grid])
    want = engine.prefill_images(0, ids, rows, features, rope_positions=rope)
    engine.reset(0)
    np.testing.assert_allclose(_portable_logits(bundle, ids, rows, features, rope), want, atol=1e-4, rtol=0)


def test_an_int8_bundle_keeps_an_fp32_vision_graph(checkpoint: Path, bundle: Path, engine: ImageEngine,
                                                   built_bundle: Callable[..., Path],
                                                   hf: tuple[Any, Any]) -> None:
    """int8 quantizes the language model only (its gate on text prompts): the vision graph is the
    fp32 bundle's, byte for byte, and the quantized model takes the rows at their positions."""
    int8 = built_bundle(checkpoint, max_input_len=128, precision="int8")
    meta, fp32 = (json.loads((b / "engine.json").read_text()) for b in (int8, bundle))
    assert meta["precision"] == "int8" and meta["vision"] == fp32["vision"]
    for name in ("model.vision.onnx", "model.vision.onnx.data"):
        assert meta["files"][name]["sha256"] == fp32["files"][name]["sha256"]
    quantized = load_ort_engine(int8, max_slots=1)
    assert isinstance(quantized, ImageEngine)
    ids, _ = _reference(hf, IMAGES[:1], "What?", steps=1)
    got, want = (_prefill(e, 0, ids, IMAGES[:1]) for e in (quantized, engine))
    engine.reset(0)
    quantized.reset(0)
    cosine = float(got @ want / (np.linalg.norm(got) * np.linalg.norm(want)))
    assert cosine > 0.99, cosine


# -- checkpoint layouts and refusals ----------------------------------------------------------

def _hub_config(config: dict[str, Any]) -> dict[str, Any]:
    """Qwen/Qwen2.5-VL-*-Instruct's flat config.json of the same model: the text fields at the top
    level, rope_scaling {"type": "mrope"}, the vision config's older names."""
    text = dict(config["text_config"])
    rope = text.pop("rope_parameters")
    for key in ("model_type", "layer_types", "dtype"):
        text.pop(key, None)
    vision = {k: v for k, v in config["vision_config"].items() if k not in ("rope_parameters", "in_channels")}
    return {**{k: v for k, v in config.items() if k not in ("text_config", "vision_config")}, **text,
            "rope_theta": rope["rope_theta"],
            "rope_scaling": {"type": "mrope", "mrope_section": rope["mrope_section"]},
            "vision_config": {**vision, "model_type": "qwen2_5_vl", "in_chans": 3}}


def test_the_hubs_layouts_build_the_same(checkpoint: Path, bundle: Path, tmp_path: Path,
                                         copy_checkpoint: Callable[[Path], Path]) -> None:
    """The hub's flat config.json, min/max_pixels preprocessor config and chat_template.json; and
    the tensor names of transformers >= 4.52's in-memory layout (model.language_model.*,
    model.visual.*): the same bundle."""
    hub = copy_checkpoint(checkpoint)
    config = json.loads((hub / "config.json").read_text())
    flat = _hub_config(config)
    reference: Any = tf.Qwen2_5_VLConfig.from_dict(flat)
    assert reference.text_config.rope_parameters["mrope_section"] == [2, 3, 3]
    assert reference.vision_config.in_channels == 3
    (hub / "config.json").write_text(json.dumps(flat))
    pre = json.loads((hub / "preprocessor_config.json").read_text())
    size = pre.pop("size")
    pre.update(min_pixels=size["shortest_edge"], max_pixels=size["longest_edge"])
    (hub / "preprocessor_config.json").write_text(json.dumps(pre))
    template = (hub / "chat_template.jinja").read_text()
    (hub / "chat_template.json").write_text(json.dumps({"chat_template": template}))
    (hub / "chat_template.jinja").unlink()
    tensors = load_file(hub / "model.safetensors")
    renamed = {("model.language_model." + k[6:] if k.startswith("model.") else
                "model." + k if k.startswith("visual.") else k): v for k, v in tensors.items()}
    save_file(renamed, hub / "model.safetensors", metadata={"format": "pt"})
    out = tmp_path / "hub-bundle"
    out.mkdir()
    meta = build_bundle(hub, out, EngineBuildSpec(max_kv_cache_capacity=256, max_input_len=128))
    expected = json.loads((bundle / "engine.json").read_text())
    assert meta["vision"] == expected["vision"]
    for name in ("model.ort.onnx", "model.onnx.data", "model.vision.onnx", "model.vision.onnx.data"):
        assert meta["files"][name]["sha256"] == expected["files"][name]["sha256"], name
    assert (out / "chat_template.jinja").read_text() == template


def _edit(copy: Path, name: str, change: Callable[[dict[str, Any]], None]) -> Path:
    raw = json.loads((copy / name).read_text())
    change(raw)
    (copy / name).write_text(json.dumps(raw))
    return copy


def test_refusals_name_the_field(checkpoint: Path, tmp_path: Path,
                                 copy_checkpoint: Callable[[Path], Path]) -> None:
    out = tmp_path / "out"
    out.mkdir()
    with pytest.raises(BuildInputError, match="lora"):
        build_bundle(checkpoint, out, EngineBuildSpec(lora=True))
    with pytest.raises(BuildInputError, match="the smallest image takes 4 prompt tokens"):
        build_bundle(checkpoint, out, EngineBuildSpec(max_input_len=6, max_kv_cache_capacity=64))
    cases: list[tuple[str, Callable[[dict[str, Any]], None], str]] = [
        ("preprocessor_config.json", lambda r: r.update(patch_size=8), "patch_size 8 differs"),
        ("preprocessor_config.json", lambda r: r.update(image_processor_type="Idefics3ImageProcessor"),
         "image_processor_type"),
        ("config.json", lambda r: r["vision_config"].update(hidden_act="relu"), "vision_config.hidden_act"),
        ("config.json", lambda r: r["vision_config"].update(out_hidden_size=32), "out_hidden_size"),
        ("config.json", lambda r: r["text_config"]["rope_parameters"].update(mrope_section=[2, 2, 2]),
         "mrope_section"),
        ("config.json", lambda r: r["vision_config"].update(window_size=4), "window_size"),
    ]
    for name, change, message in cases:
        broken = _edit(copy_checkpoint(checkpoint), name, change)
        with pytest.raises(BuildInputError, match=message):
            build_bundle(broken, out, EngineBuildSpec(max_kv_cache_capacity=256, max_input_len=128))
        import shutil

        shutil.rmtree(broken)
    broken = copy_checkpoint(checkpoint)
    (broken / "preprocessor_config.json").unlink()
    with pytest.raises(BuildInputError, match=r"preprocessor_config\.json"):
        build_bundle(broken, out, EngineBuildSpec())
    assert not any(out.iterdir())


def test_qwen2_vl_is_refused_in_one_line(tmp_path: Path) -> None:
    """Qwen2-VL (LayerNorm blocks, no windows) is not Qwen2.5-VL: the usual refusal."""
    (tmp_path / "config.json").write_text(json.dumps(
        {"architectures": ["Qwen2VLForConditionalGeneration"], "model_type": "qwen2_vl"}))
    refusal = r"unsupported model family 'Qwen2VLForConditionalGeneration'.*vision-language: .*qwen2_5_vl"
    with pytest.raises(UnsupportedModelError, match=refusal):
        check_family(tmp_path)


def test_prepared_images_say_their_grid(engine: ImageEngine) -> None:
    vision = engine.vision
    assert vision is not None
    prepared = vision.prepare(IMAGES[1])
    assert isinstance(prepared, PreparedImage) and prepared.grid == (1, 4, 8) and prepared.rows == 32
    with pytest.raises(ValueError, match="depends on its size"):
        vision.fixed_tokens()
    with pytest.raises(ValueError, match="aspect ratio"):
        vision.prepare(random_image(5, (2000, 8)))


def test_the_scheduler_runs_image_prompts_in_chunks(bundle: Path, hf: tuple[Any, Any]) -> None:
    """Through the scheduler (prefill chunks of 16 tokens, beside a text request, and a second
    choice starting from a copy of the first one's prompt KV): transformers' tokens."""
    from inference.images.features import PromptImage, PromptImages
    from inference.serving.generation import GenerationState
    from inference.serving.sampling import Sampler, SamplingParams
    from inference.serving.scheduler import GenerationRequest
    from tests.support.scheduling import CollectingSink, IdTokens, SchedulerRunner

    engine = load_ort_engine(bundle, max_slots=3)
    assert isinstance(engine, ImageEngine) and engine.vision is not None
    vision = engine.vision
    ids, expected = _reference(hf, IMAGES, "Two?")
    text_ids, text_expected = _reference(hf, [], "Say something.")
    prepared = [vision.prepare(im) for im in IMAGES]
    rows = np.array([i for i, t in enumerate(ids) if t == vision.image_token_id], np.int64)
    features = vision.features(prepared)
    bounds = np.cumsum([0, *(p.rows for p in prepared)])
    images = PromptImages([PromptImage(digest=bytes([k]), tokens=p.tokens, features=f, grid=p.grid,
                                       positions=rows[bounds[k]:bounds[k + 1]])
                           for k, (p, f) in enumerate(zip(prepared, features, strict=True))], vision,
                          rope=mrope_positions(len(ids), rows,
                                               [p.grid for p in prepared if p.grid is not None]))

    def request(prompt: list[int], **fields: Any) -> tuple[GenerationRequest, CollectingSink]:
        sink = CollectingSink()
        state = GenerationState(IdTokens(), prompt_ids=prompt, max_new_tokens=STEPS)  # type: ignore[arg-type]
        sampler = Sampler(SamplingParams(temperature=0.0), engine.info.vocab_size)
        return GenerationRequest(list(prompt), sampler, state, sink, **fields), sink

    with SchedulerRunner(engine, batch=3, prefill_chunk=16) as runner:
        leader, first = request(ids, images=images, cache_prompt=False)
        sibling, second = request(ids, images=images, cache_prompt=False, prefix_from=leader)
        text, third = request(text_ids)
        for req in (leader, sibling, text):
            runner.sched.submit(req)
        assert [first.tokens(), second.tokens(), third.tokens()] == [expected, expected, text_expected]


def test_the_tensorrt_builder_refuses_it(fake_trt: Any, checkpoint: Path, tmp_path: Path) -> None:
    """The vision graph, the image inputs and the M-RoPE positions are the CPU backend's."""
    from inference.builder.trt_backend import TrtBuildSpec, build_trt_bundle

    out = tmp_path / "trt"
    out.mkdir()
    spec = TrtBuildSpec(max_kv_cache_capacity=256, max_input_len=64, timing_cache_dir=tmp_path / "timing")
    with pytest.raises(BuildInputError, match="built by the onnxruntime backend only"):
        build_trt_bundle(checkpoint, out, spec)
    assert not any(out.iterdir())


def test_the_decomposed_graphs_rotate_the_same(checkpoint: Path, hf: tuple[Any, Any], tmp_path: Path,
                                               monkeypatch: pytest.MonkeyPatch) -> None:
    """Where onnxruntime has no opset-23 RotaryEmbedding (before 1.23), both graphs rotate by the
    three ids with standard ops: the same tokens, and the portable graph the CPU graph's logits."""
    from inference.builder import ort_backend

    monkeypatch.setattr(ort_backend, "fused_ops_supported", lambda: False)
    out = tmp_path / "decomposed"
    out.mkdir()
    meta = build_bundle(checkpoint, out, EngineBuildSpec(max_kv_cache_capacity=256, max_input_len=128))
    assert meta["graph_ops"] == "decomposed"
    graph = onnx.load(str(out / "model.ort.onnx"), load_external_data=False).graph
    assert not any(n.op_type == "RotaryEmbedding" for n in graph.node)
    decomposed = load_ort_engine(out, max_slots=1)
    assert isinstance(decomposed, ImageEngine) and decomposed.vision is not None
    ids, expected = _reference(hf, IMAGES, "What is in the picture?")
    assert _greedy(decomposed, ids, IMAGES) == expected
    vision = decomposed.vision
    prepared = [vision.prepare(im) for im in IMAGES]
    rows = np.array([i for i, t in enumerate(ids) if t == vision.image_token_id])
    rope = mrope_positions(len(ids), rows, [p.grid for p in prepared if p.grid is not None])
    features = np.concatenate(vision.features(prepared))
    want = decomposed.prefill_images(0, ids, rows, features, rope_positions=rope)
    np.testing.assert_allclose(_portable_logits(out, ids, rows, features, rope), want, atol=1e-4, rtol=0)


def test_a_1d_bundle_takes_no_rope_positions(llava_bundle: Path) -> None:
    """LLaVA's engine (1D positions) refuses M-RoPE positions rather than ignoring them."""
    llava = load_ort_engine(llava_bundle, max_slots=1)
    assert isinstance(llava, ImageEngine)
    with pytest.raises(ValueError, match="positions are 1D"):
        llava.prefill_images(0, [5, 6], np.zeros(0, np.int64), np.zeros((0, 64), np.float32),
                             rope_positions=np.zeros((3, 2), np.int64))
