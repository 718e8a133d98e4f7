"""Gemma 3 (vision-language) built into a bundle and run by the CPU engine, against transformers on
a tiny random checkpoint: the vision graph's features, greedy tokens for prompts with one and two
images (the image rows attending both ways, as transformers' mask has them), prefill chunks that
keep each image whole (engine and scheduler), the portable graph's mask, int8, the hub's layout
and the refusals."""

from __future__ import annotations

import copy
import json
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import onnxruntime as ort
import pytest
import torch
from PIL import Image

from inference.builder import EngineBuildSpec, build_bundle
from inference.builder.errors import BuildInputError
from inference.builder.model_config import model_config_from
from inference.builder.vision_gemma3 import config_from
from inference.images.features import PromptImage, PromptImages
from inference.runtime.onnxruntime_loader import load_ort_engine
from inference.runtime.protocol import ImageEngine, whole_runs_end
from inference.runtime.vision_gemma3 import Gemma3VisionEncoder
from tests.support.scheduling import SchedulerRunner
from tests.vision.conftest import random_image
from tests.vision.gemma3_checkpoints import TOKENS, write_tiny_gemma3

STEPS = 16
IMAGES = [random_image(1, (40, 50)), random_image(2, (64, 48))]
#: prompt tokens of one image: <start_of_image>, 16 rows, <end_of_image>
PER_IMAGE = TOKENS + 2


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny Gemma 3: SigLIP 32x32 / patch 4, 2 layers, 16 rows an image; Gemma 3 text, 6 layers."""
    return write_tiny_gemma3(tmp_path_factory.mktemp("gemma3"))


@pytest.fixture(scope="module")
def bundle(checkpoint: Path, built_bundle: Callable[..., Path]) -> Path:
    """Built fp32 with room for two images and some text in one prefill chunk."""
    return built_bundle(checkpoint, max_input_len=128)


@pytest.fixture(scope="module")
def hf(checkpoint: Path) -> tuple[Any, Any]:
    tf = pytest.importorskip("transformers")
    model = tf.Gemma3ForConditionalGeneration.from_pretrained(checkpoint, dtype=torch.float32).eval()
    return model, tf.AutoProcessor.from_pretrained(checkpoint)


@pytest.fixture(scope="module")
def engine(bundle: Path) -> ImageEngine:
    loaded = load_ort_engine(bundle, max_slots=1)
    assert isinstance(loaded, ImageEngine)
    return loaded


def _messages(n_images: int, text: str) -> list[dict[str, Any]]:
    return [{"role": "user", "content": [*([{"type": "image"}] * n_images), {"type": "text", "text": text}]}]


def _reference(hf: tuple[Any, Any], images: Sequence[Image.Image], text: str, *,
               causal: bool = False) -> tuple[list[int], list[int], Any]:
    """transformers: (prompt ids, greedy tokens of generate(do_sample=False), processor outputs).
    ``causal``: without token_type_ids, i.e. every row causal (what the images' mask changes)."""
    model, processor = hf
    prompt = processor.apply_chat_template(_messages(len(images), text), add_generation_prompt=True)
    inputs = processor(images=list(images), text=prompt, return_tensors="pt")
    run = {k: v for k, v in inputs.items() if not (causal and k == "token_type_ids")}
    with torch.no_grad():
        out = model.generate(**run, max_new_tokens=STEPS, do_sample=False)
    ids = inputs["input_ids"][0].tolist()
    return ids, out[0, len(ids):].tolist(), inputs


@dataclass(frozen=True)
class _Rows:
    positions: np.ndarray
    features: np.ndarray


def _rows(engine: ImageEngine, ids: list[int], images: Sequence[Image.Image]) -> _Rows:
    vision = engine.vision
    assert vision is not None
    features = np.concatenate(vision.features([vision.prepare(im) for im in images]))
    positions = np.array([i for i, t in enumerate(ids) if t == vision.image_token_id], np.int64)
    return _Rows(positions=positions, features=features)


def _prompt_images(engine: ImageEngine, ids: list[int], images: Sequence[Image.Image],
                   whole: bool) -> PromptImages:
    """The images as the chat path hands them to the scheduler (features known), on a vision side
    whose images are kept whole in a chunk or not."""
    vision = copy.copy(engine.vision)
    assert vision is not None
    vision.whole_images = whole
    rows = _rows(engine, ids, images)
    per = len(rows.positions) // len(images)
    return PromptImages([PromptImage(digest=bytes([k]), tokens=vision.fixed_tokens(),
                                     features=rows.features[k * per:(k + 1) * per],
                                     positions=rows.positions[k * per:(k + 1) * per])
                         for k in range(len(images))], vision)


def _engine_greedy(engine: ImageEngine, ids: list[int], images: Sequence[Image.Image]) -> list[int]:
    rows = _rows(engine, ids, images)
    logits = engine.prefill_images(0, ids, rows.positions, rows.features)
    tokens: list[int] = []
    for _ in range(STEPS):
        tokens.append(int(np.argmax(logits)))
        logits = engine.decode([0], [tokens[-1]])[0]
    engine.reset(0)
    return tokens


def test_bundle_records_its_vision_side(bundle: Path, checkpoint: Path) -> None:
    meta = json.loads((bundle / "engine.json").read_text())
    config = json.loads((checkpoint / "config.json").read_text())
    assert meta["architecture"] == "Gemma3ForConditionalGeneration" and meta["model_type"] == "gemma3_text"
    vision = meta["vision"]
    assert (vision["family"], vision["precision"]) == ("gemma3", "fp32")
    assert vision["image_attention"] == "bidirectional"
    assert (vision["rows_per_image"], vision["tokens_per_image"]) == (TOKENS, PER_IMAGE)
    assert (vision["image_token_id"], vision["placeholder_id"], vision["end_id"]) == (
        config["image_token_index"], config["boi_token_index"], config["eoi_token_index"])
    assert (vision["placeholder_text"], vision["text_around"]) == ("<start_of_image>", "\n\n")
    assert {"model.vision.onnx", "model.vision.onnx.data"} <= set(meta["files"])
    assert meta["inputs"][-2:] == ["image_features", "image_rows"]


def test_vision_features_match_transformers(engine: ImageEngine, hf: tuple[Any, Any]) -> None:
    model, _ = hf
    pixels = torch.randn(3, 3, 32, 32, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        expected = model.model.get_image_features(pixels).pooler_output.numpy()
    assert isinstance(engine.vision, Gemma3VisionEncoder)
    got = engine.vision.encode(pixels.numpy())
    assert got.shape == expected.shape == (3, TOKENS, 64)
    np.testing.assert_allclose(got, expected, atol=1e-4, rtol=0)
    assert np.abs(expected).max() > 1.0  # features of magnitude, so the tolerance means something


@pytest.mark.parametrize("n_images", [1, 2])
def test_greedy_tokens_equal_transformers(engine: ImageEngine, hf: tuple[Any, Any], n_images: int) -> None:
    """The image rows attend to each other both ways as transformers' Gemma 3 has them: a causal
    mask over them (transformers without token_type_ids) answers otherwise, ours does not."""
    images = IMAGES[:n_images]
    ids, expected, inputs = _reference(hf, images, "What is in the picture?")
    _, causal, _ = _reference(hf, images, "What is in the picture?", causal=True)
    assert isinstance(engine.vision, Gemma3VisionEncoder)
    assert ids.count(engine.vision.image_token_id) == TOKENS * n_images
    assert len(expected) == STEPS and len(set(expected)) > 3  # no EOS, no one-token loop
    assert causal != expected
    assert _engine_greedy(engine, ids, images) == expected
    pixels = np.stack([engine.vision.pixels(im) for im in images])
    np.testing.assert_allclose(pixels, inputs["pixel_values"].numpy(), atol=1e-6, rtol=0)


def test_the_image_changes_the_answer(engine: ImageEngine, hf: tuple[Any, Any]) -> None:
    """Swapping the two images changes transformers' answer, and ours with it."""
    ids, forward, _ = _reference(hf, IMAGES, "Compare them.")
    _, backward, _ = _reference(hf, IMAGES[::-1], "Compare them.")
    assert forward != backward
    assert _engine_greedy(engine, ids, IMAGES[::-1]) == backward


def test_the_engine_keeps_each_image_in_one_chunk(checkpoint: Path, built_bundle: Callable[..., Path],
                                                  hf: tuple[Any, Any]) -> None:
    """A bundle whose prefill chunk (the engine's: max_input_len, 20) would cut through both
    images' rows: the engine's chunks end before each image instead, and the answer is
    transformers'."""
    chunked = load_ort_engine(built_bundle(checkpoint, max_input_len=20), max_slots=1)
    assert isinstance(chunked, ImageEngine) and chunked.vision is not None
    ids, expected, _ = _reference(hf, IMAGES, "Two?")
    rows = [i for i, t in enumerate(ids) if t == chunked.vision.image_token_id]
    assert sum(1 for r in rows if r % 20 == 0 and r - 1 in rows) == 2  # plain chunks would cut both
    assert _engine_greedy(chunked, ids, IMAGES) == expected


def test_an_fp16_kv_cache_answers_the_same(checkpoint: Path, built_bundle: Callable[..., Path],
                                            hf: tuple[Any, Any]) -> None:
    """float16 K/V buffers (the image chunks' attention reads them back as float32), chunked."""
    half = load_ort_engine(built_bundle(checkpoint, max_input_len=20, kv_cache_dtype="fp16"), max_slots=1)
    assert isinstance(half, ImageEngine)
    ids, expected, _ = _reference(hf, IMAGES, "Two?")
    assert _engine_greedy(half, ids, IMAGES) == expected


@pytest.mark.parametrize("whole", [True, False])
def test_the_scheduler_keeps_each_image_in_one_chunk(engine: ImageEngine, hf: tuple[Any, Any],
                                                     whole: bool) -> None:
    """The scheduler's prefill chunks (8 tokens, half an image) end where PromptImages.chunk_end
    says: transformers' answer; cut through the images (``whole`` off), the answer is another."""
    ids, expected, _ = _reference(hf, IMAGES, "What is in the picture?")
    runner = SchedulerRunner(engine, prefill_chunk=8)
    try:
        got = runner.run([ids], STEPS, images=_prompt_images(engine, ids, IMAGES, whole),
                         cache_prompt=False)[0]
    finally:
        runner.stop()
    assert (got == expected) is whole


def test_chunk_ends_keep_runs_whole() -> None:
    positions = np.array([3, 4, 5, 6, 9, 10], np.int64)  # two images: 3-6 and 9-10
    assert whole_runs_end(positions, 0, 5) == 3  # before the image the chunk would cut
    assert whole_runs_end(positions, 3, 5) == 7  # the chunk starts at it: on to its end
    assert whole_runs_end(positions, 0, 7) == 7 and whole_runs_end(positions, 0, 3) == 3  # no cut
    assert whole_runs_end(positions, 7, 10) == 9 and whole_runs_end(positions, 9, 10) == 11
    assert whole_runs_end(np.zeros(0, np.int64), 0, 4) == 4


def test_the_portable_graph_honours_the_images_too(bundle: Path, engine: ImageEngine,
                                                   hf: tuple[Any, Any]) -> None:
    """model.onnx (standard ops, an explicit mask) gives the CPU graph's and transformers' logits
    for a prompt with two images in one run."""
    model, _ = hf
    ids, _, inputs = _reference(hf, IMAGES, "Compare them.")
    rows = _rows(engine, ids, IMAGES)
    meta = json.loads((bundle / "engine.json").read_text())
    session = ort.InferenceSession(str(bundle / "model.onnx"), providers=["CPUExecutionProvider"])
    n = len(ids)
    feeds: dict[str, np.ndarray] = {
        "input_ids": np.array([ids], np.int64), "attention_mask": np.ones((1, n), np.int64),
        "position_ids": np.arange(n, dtype=np.int64)[None], "logits_to_keep": np.array([1], np.int64),
        "image_features": rows.features,
        "image_rows": np.stack([np.zeros_like(rows.positions), rows.positions], axis=1)}
    for arg in session.get_inputs():
        if arg.name.startswith("past_key_values."):
            feeds[arg.name] = np.zeros((1, meta["num_kv_heads"], 0, meta["head_dim"]), np.float32)
    portable = session.run(["logits"], feeds)[0][0, -1]
    cpu = engine.prefill_images(0, ids, rows.positions, rows.features)
    engine.reset(0)
    with torch.no_grad():
        reference = model(**inputs).logits[0, -1].numpy()
    np.testing.assert_allclose(portable, reference, atol=1e-4, rtol=0)  # measured 3.8e-6
    np.testing.assert_allclose(cpu, reference, atol=1e-4, rtol=0)  # measured 3.6e-6
    with torch.no_grad():
        causal = model(**{k: v for k, v in inputs.items() if k != "token_type_ids"}).logits[0, -1].numpy()
    assert np.abs(causal - reference).max() > 0.03  # the mask moves these logits (0.06)


def test_an_int8_bundle_keeps_an_fp32_vision_graph(checkpoint: Path, bundle: Path, engine: ImageEngine,
                                                   built_bundle: Callable[..., Path]) -> None:
    """int8 quantizes the language model only: the vision graph is the fp32 bundle's, byte for
    byte, and the quantized language model takes the image rows (logits close to fp32's)."""
    int8 = built_bundle(checkpoint, max_input_len=128, precision="int8")
    meta, fp32 = (json.loads((b / "engine.json").read_text()) for b in (int8, bundle))
    assert meta["precision"] == "int8" and meta["vision"] == fp32["vision"]
    for name in ("model.vision.onnx", "model.vision.onnx.data"):
        assert meta["files"][name]["sha256"] == fp32["files"][name]["sha256"]
    quantized = load_ort_engine(int8, max_slots=1)
    assert isinstance(quantized, ImageEngine) and quantized.vision is not None
    vision = quantized.vision
    ids = [5, 6, *vision.fixed_tokens(), 7, 8, 9]
    (features,) = vision.features([vision.prepare(IMAGES[0])])
    rows = np.arange(3, 3 + TOKENS)
    got, want = (e.prefill_images(0, ids, rows, features) for e in (quantized, engine))
    engine.reset(0)
    quantized.reset(0)
    text_only = quantized.prefill(0, ids)  # the image tokens' own embeddings instead
    assert np.abs(got - text_only).max() > 0.5  # the rows matter
    cosine = float(got @ want / (np.linalg.norm(got) * np.linalg.norm(want)))
    assert cosine > 0.99, cosine


def test_the_hubs_layout_builds_the_same(checkpoint: Path, bundle: Path, tmp_path: Path) -> None:
    """google/gemma-3-*-it's layout: the tower under vision_tower.vision_model.*, the image
    processor in preprocessor_config.json (do_convert_rgb and pan-and-scan null) with
    image_seq_length in processor_config.json, the template in chat_template.json: same bundle."""
    import shutil

    from safetensors.numpy import load_file, save_file

    hub = tmp_path / "hub"
    shutil.copytree(checkpoint, hub)
    tensors = load_file(hub / "model.safetensors")
    renamed = {("vision_tower.vision_model." + k.removeprefix("vision_tower.")
                if k.startswith("vision_tower.") else k): v for k, v in tensors.items()}
    assert renamed != tensors
    save_file(renamed, hub / "model.safetensors", metadata={"format": "pt"})
    processor = json.loads((hub / "processor_config.json").read_text())
    image = {**processor.pop("image_processor"), "do_convert_rgb": None, "do_pan_and_scan": None,
             "pan_and_scan_max_num_crops": None, "processor_class": "Gemma3Processor"}
    (hub / "preprocessor_config.json").write_text(json.dumps(image))
    (hub / "processor_config.json").write_text(json.dumps(processor))
    template = (hub / "chat_template.jinja").read_text()
    (hub / "chat_template.json").write_text(json.dumps({"chat_template": template}))
    (hub / "chat_template.jinja").unlink()
    out = tmp_path / "hub-bundle"
    out.mkdir()
    meta = build_bundle(hub, out, EngineBuildSpec(max_kv_cache_capacity=256, max_input_len=128))
    reference = json.loads((bundle / "engine.json").read_text())
    assert meta["vision"] == reference["vision"]
    assert (out / "chat_template.jinja").read_text() == template
    for name in ("model.ort.onnx", "model.vision.onnx.data"):
        assert meta["files"][name]["sha256"] == reference["files"][name]["sha256"], name


#: google/gemma-3-4b-it's config.json: text_config names only what differs from Gemma3TextConfig.
HUB_4B: dict[str, Any] = {
    "architectures": ["Gemma3ForConditionalGeneration"], "boi_token_index": 255999,
    "eoi_token_index": 256000, "eos_token_id": [1, 106], "image_token_index": 262144,
    "initializer_range": 0.02, "mm_tokens_per_image": 256, "model_type": "gemma3",
    "text_config": {"hidden_size": 2560, "intermediate_size": 10240, "model_type": "gemma3_text",
                    "num_hidden_layers": 34, "rope_scaling": {"factor": 8.0, "rope_type": "linear"},
                    "sliding_window": 1024},
    "torch_dtype": "bfloat16",
    "vision_config": {"hidden_size": 1152, "image_size": 896, "intermediate_size": 4304,
                      "model_type": "siglip_vision_model", "num_attention_heads": 16, "num_hidden_layers": 27,
                      "patch_size": 14, "vision_use_head": False},
}


def test_a_hub_config_takes_transformers_defaults() -> None:
    tf = pytest.importorskip("transformers")
    reference: Any = tf.Gemma3Config.from_dict(HUB_4B)
    text = reference.text_config
    cfg = model_config_from(HUB_4B)
    assert (cfg.vocab_size, cfg.hidden_size, cfg.num_layers, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim,
            cfg.tie_word_embeddings) == (text.vocab_size, text.hidden_size, text.num_hidden_layers,
                                         text.num_attention_heads, text.num_key_value_heads, text.head_dim,
                                         reference.tie_word_embeddings)
    assert [cfg.window(i) for i in range(cfg.num_layers)] == [
        text.sliding_window if t == "sliding_attention" else None for t in text.layer_types]
    assert cfg.query_scale_of(0) == pytest.approx(text.query_pre_attn_scalar ** -0.5)
    full = cfg.rope_of(text.layer_types.index("full_attention"))
    local = cfg.rope_of(0)
    assert full is not None and local is not None
    params = text.rope_parameters
    assert (full.theta, full.rope_type, full.factor) == (params["full_attention"]["rope_theta"], "linear",
                                                         params["full_attention"]["factor"])
    assert (local.theta, local.rope_type) == (params["sliding_attention"]["rope_theta"], "default")
    vision = config_from(HUB_4B, cfg.hidden_size)
    assert (vision.rows, vision.pool, vision.patches_per_side, vision.num_layers) == (256, 4, 64, 27)
    assert (vision.image_token_id, vision.boi_token_id, vision.eoi_token_id) == (262144, 255999, 256000)


def _damaged(checkpoint: Path, tmp_path: Path, config: dict[str, Any] | None = None,
             image: dict[str, Any] | None = None, processor: dict[str, Any] | None = None) -> Path:
    import shutil

    copy = tmp_path / f"damaged-{len(list(tmp_path.iterdir()))}"
    shutil.copytree(checkpoint, copy)
    raw = json.loads((copy / "config.json").read_text())
    for key, value in (config or {}).items():
        if key == "vision_config":
            raw[key] = {**raw[key], **value}
        else:
            raw[key] = value
    (copy / "config.json").write_text(json.dumps(raw))
    proc = json.loads((copy / "processor_config.json").read_text())
    proc["image_processor"].update(image or {})
    proc.update(processor or {})
    (copy / "processor_config.json").write_text(json.dumps(proc))
    return copy


@pytest.mark.parametrize(("config", "image", "processor", "message"), [
    ({}, {"do_pan_and_scan": True}, {}, "do_pan_and_scan"),
    ({"mm_tokens_per_image": 12}, {}, {"image_seq_length": 12}, "mm_tokens_per_image 12 must be a square"),
    ({"mm_tokens_per_image": 9}, {}, {"image_seq_length": 9}, "9 must be a square whose side divides"),
    ({}, {}, {"image_seq_length": 64}, "image_seq_length 64 differs from config.json mm_tokens_per_image 16"),
    ({"vision_config": {"model_type": "clip_vision_model"}}, {}, {}, "vision_config.model_type 'clip_vision"),
    ({}, {"size": {"height": 32, "width": 48}}, {}, "makes 32x48 images"),
    ({"image_token_index": 5000}, {}, {}, "image_token_index 5000 is outside"),
])
def test_refusals_name_the_field(checkpoint: Path, tmp_path: Path, config: dict[str, Any],
                                 image: dict[str, Any], processor: dict[str, Any], message: str) -> None:
    broken = _damaged(checkpoint, tmp_path, config, image, processor)
    out = tmp_path / "out"
    out.mkdir()
    with pytest.raises((BuildInputError, ValueError), match=message) as info:
        build_bundle(broken, out, EngineBuildSpec(max_kv_cache_capacity=256, max_input_len=128))
    assert "\n" not in str(info.value)
    assert not any(out.iterdir())


def test_spec_refusals(checkpoint: Path, tmp_path: Path) -> None:
    out = tmp_path / "out"
    out.mkdir()
    with pytest.raises(BuildInputError, match="lora"):
        build_bundle(checkpoint, out, EngineBuildSpec(lora=True))
    with pytest.raises(BuildInputError, match=f"one image takes {PER_IMAGE} prompt tokens"):
        build_bundle(checkpoint, out, EngineBuildSpec(max_input_len=PER_IMAGE, max_kv_cache_capacity=64))
    with pytest.raises(BuildInputError, match="task 'embed'"):
        build_bundle(checkpoint, out, EngineBuildSpec(task="embed", pooling="mean"))
    assert not any(out.iterdir())


PIXEL_CONFIGS: dict[str, dict[str, Any]] = {
    "gemma-3": {"size": {"height": 32, "width": 32}},
    "bicubic-not-square": {"size": {"height": 48, "width": 40}, "resample": 3},
    "no-normalize": {"size": 30, "do_normalize": False, "rescale_factor": 0.5},
    "own-mean-std": {"size": {"height": 20, "width": 20}, "image_mean": [0.4, 0.5, 0.6], "image_std": 0.3},
}


def _odd_images() -> list[Image.Image]:
    rgba = random_image(5, (33, 47), "RGBA")
    rgba.putalpha(Image.fromarray(np.random.default_rng(6).integers(0, 256, (47, 33), dtype=np.uint8)))
    return [random_image(1, (40, 50)), random_image(2, (301, 97)), random_image(3, (17, 17), "L"),
            random_image(4, (64, 48), "P"), random_image(7, (50, 50), "CMYK"), rgba]


@pytest.mark.parametrize("name", sorted(PIXEL_CONFIGS))
def test_pixel_values_equal_transformers(name: str) -> None:
    """Gemma3ImageProcessorPil (what AutoProcessor picks without torchvision) on odd images."""
    from inference.images.gemma3 import gemma3_preprocess

    tf = pytest.importorskip("transformers")
    processor = tf.Gemma3ImageProcessorPil(**PIXEL_CONFIGS[name])
    ours = gemma3_preprocess(processor.to_dict())
    for image in _odd_images():
        expected = processor(images=[image], return_tensors="np")["pixel_values"][0]
        got = ours(image)
        assert got.dtype == np.float32 and got.shape == expected.shape
        np.testing.assert_allclose(got, expected, atol=1e-6, rtol=0)


def test_autoprocessor_picks_the_pil_backend(hf: tuple[Any, Any]) -> None:
    _, processor = hf
    assert type(processor.image_processor).__name__ == "Gemma3ImageProcessorPil"


@pytest.mark.parametrize("n_images", [0, 1, 2])
def test_input_ids_equal_the_processors(bundle: Path, hf: tuple[Any, Any], n_images: int) -> None:
    """The bundle's tokenizer and template, the newlines written around each placeholder and the
    placeholders expanded give the processor's input ids; the newlines as fixed token ids would
    not (they merge with the text around them: "user\\n" + "\\n\\n")."""
    from inference.openai.images import expand_placeholders
    from inference.serving.tokenizer import load_tokenizer

    _, processor = hf
    images = [random_image(i, (40 + i, 30)) for i in range(n_images)]
    user = [{"type": "text", "text": "Look:"}, *([{"type": "image"}] * n_images),
            {"type": "text", "text": "what is it?"}]
    messages = [{"role": "system", "content": [{"type": "text", "text": "Be brief."}]},
                {"role": "user", "content": user}]
    prompt = processor.apply_chat_template(messages, add_generation_prompt=True)
    expected = processor(images=images or None, text=prompt, return_tensors="np")["input_ids"][0].tolist()
    tok = load_tokenizer(bundle)
    assert tok.apply_chat_template(messages, add_generation_prompt=True) == prompt
    engine = load_ort_engine(bundle, max_slots=1)
    assert isinstance(engine, ImageEngine) and isinstance(engine.vision, Gemma3VisionEncoder)
    vision = engine.vision
    text = vision.prompt_text(prompt) if images else prompt
    ids, rows = expand_placeholders(tok.encode(text), vision, [vision.fixed_tokens()] * n_images)
    assert ids == expected
    assert len(rows) == TOKENS * n_images and all(ids[r] == vision.image_token_id for r in rows)
    if images:
        newlines = tok.encode("\n\n")
        fixed = (*newlines, *vision.fixed_tokens(), *newlines)
        assert expand_placeholders(tok.encode(prompt), vision, [fixed] * n_images)[0] != expected
