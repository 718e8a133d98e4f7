"""Context reuse with images on the tiny LLaVA engine, through the real scheduler: the same image
and text reuse the KV (image included) and give the cold run's greedy tokens; another image behind
the same text reuses the text only; a reuse that cuts into an image still feeds the rest of its
rows; an image the reused KV covers is not encoded, one the feature cache holds neither."""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from inference.images.features import ImageFeatureCache, PromptImage, PromptImages, image_digest
from inference.runtime.onnxruntime_loader import load_ort_engine
from inference.runtime.protocol import ImageEngine, PreparedImage, VisionModel
from inference.serving.context_cache import PrefixStore
from tests.support.scheduling import SchedulerRunner
from tests.vision.conftest import random_image

STEPS = 12
IMAGES = [random_image(21, (40, 36)), random_image(22, (30, 52))]


def _bytes(image: Image.Image) -> bytes:
    import io

    out = io.BytesIO()
    image.save(out, format="PNG")
    return out.getvalue()


class Counting:
    """The engine's vision side with its encodes counted (images encoded, in order)."""

    def __init__(self, vision: VisionModel) -> None:
        self.inner = vision
        self.image_token_id = vision.image_token_id
        self.placeholder_id = vision.placeholder_id
        self.tokens_per_image = vision.tokens_per_image
        self.max_image_tokens = vision.max_image_tokens
        self.max_image_tokens_per_image = vision.max_image_tokens_per_image
        self.whole_images = vision.whole_images
        self.encoded = 0

    def fixed_tokens(self) -> tuple[int, ...]:
        return self.inner.fixed_tokens()

    def prompt_text(self, text: str) -> str:
        return self.inner.prompt_text(text)

    def prepare(self, image: Image.Image) -> PreparedImage:
        return self.inner.prepare(image)

    def features(self, images: Sequence[PreparedImage]) -> list[np.ndarray]:
        self.encoded += len(images)
        return self.inner.features(images)


@pytest.fixture(scope="module")
def engine(llava_bundle: Path) -> ImageEngine:
    loaded = load_ort_engine(llava_bundle, max_slots=2)
    assert isinstance(loaded, ImageEngine) and loaded.vision is not None
    return loaded


@pytest.fixture(scope="module")
def cold_engine(llava_bundle: Path) -> ImageEngine:
    """An engine of its own for the cold runs (the runner's keeps its slots' KV)."""
    loaded = load_ort_engine(llava_bundle, max_slots=1)
    assert isinstance(loaded, ImageEngine)
    return loaded


@pytest.fixture
def vision(engine: ImageEngine) -> Counting:
    assert engine.vision is not None
    return Counting(engine.vision)


def _prompt(engine: ImageEngine, before: int, after: int, seed: int = 0) -> tuple[list[int], np.ndarray]:
    """``before`` text ids, one image's tokens, ``after`` text ids; and the image rows."""
    assert engine.vision is not None
    token, per = engine.vision.image_token_id, engine.vision.tokens_per_image
    assert per is not None
    rng = np.random.default_rng(seed)
    text = [int(t) for t in rng.integers(5, 300, size=before + after) if t != token]
    text += [7] * (before + after - len(text))
    ids = text[:before] + [token] * per + text[before:]
    return ids, np.arange(before, before + per)


def _images(vision: Counting, image: Image.Image, rows: np.ndarray,
            cache: ImageFeatureCache | None = None) -> PromptImages:
    """What the chat path hands the scheduler: the image by digest, its features from the cache
    or its pixels to encode."""
    data = _bytes(image)
    digest = image_digest(data)
    features = cache.get(digest) if cache is not None else None
    prepared = None if features is not None else vision.prepare(Image.open(__import__("io").BytesIO(data)))
    return PromptImages([PromptImage(digest, vision.fixed_tokens(), prepared=prepared, features=features,
                                     positions=rows)], vision, cache)


@pytest.fixture
def runner(engine: ImageEngine) -> Iterator[SchedulerRunner]:
    with SchedulerRunner(engine, batch=1, context_cache=PrefixStore("llava", max_records=64),
                         prefill_chunk=24, save_delay=0.05) as r:
        yield r


Cold = Callable[[Sequence[int], Image.Image, np.ndarray], list[int]]


@pytest.fixture
def cold(cold_engine: ImageEngine, vision: Counting) -> Cold:
    """Greedy tokens of a prompt and image without context reuse, on an engine of its own."""
    def run(ids: Sequence[int], image: Image.Image, rows: np.ndarray) -> list[int]:
        with SchedulerRunner(cold_engine, batch=1, prefill_chunk=24) as r:
            return r.run([ids], STEPS, images=_images(vision, image, rows))[0]

    return run


def _reused(runner: SchedulerRunner) -> int:
    stats = runner.sched.context_cache_stats()
    assert stats is not None
    return stats.tokens_reused


def test_the_same_image_and_text_reuse_the_kv_and_answer_as_cold(
        engine: ImageEngine, vision: Counting, runner: SchedulerRunner, cold: Cold) -> None:
    ids, rows = _prompt(engine, 70, 10)
    expected = cold(ids, IMAGES[0], rows)
    encoded = vision.encoded
    first = runner.run([ids], STEPS, images=_images(vision, IMAGES[0], rows))[0]
    assert vision.encoded == encoded + 1 and _reused(runner) == 0
    # The same again (the feature cache off: only the KV reuse spares the encode).
    second = runner.run([ids], STEPS, images=_images(vision, IMAGES[0], rows))[0]
    assert first == second == expected
    assert _reused(runner) >= len(ids) - 1  # the slot's KV (and maybe its tail record's logits)
    assert vision.encoded == encoded + 1  # the reused KV covered the image: never encoded again
    # The same image and text after another request took the slot: from the records, not the slot.
    other, other_rows = _prompt(engine, 30, 5, seed=3)
    runner.run([other], STEPS, images=_images(vision, IMAGES[1], other_rows))
    before, encoded = _reused(runner), vision.encoded
    third = runner.run([ids], STEPS, images=_images(vision, IMAGES[0], rows))[0]
    assert third == expected and _reused(runner) - before == len(ids)  # a block and the tail record
    assert vision.encoded == encoded


def test_a_prefix_covering_the_image_spares_its_encode(
        engine: ImageEngine, vision: Counting, runner: SchedulerRunner, cold: Cold) -> None:
    """Another question after the same text and image: the reused KV ends after the image, the
    rest is prefilled, and the image (its pixels at hand, the feature cache off) is not encoded."""
    ids, rows = _prompt(engine, 30, 10)
    runner.run([ids], STEPS, images=_images(vision, IMAGES[0], rows))
    follow = [*ids[: int(rows[-1]) + 1], 11, 12, 13, 14, 15, 16]
    expected = cold(follow, IMAGES[0], rows)
    before, encoded = _reused(runner), vision.encoded
    assert runner.run([follow], STEPS, images=_images(vision, IMAGES[0], rows))[0] == expected
    assert _reused(runner) - before == int(rows[-1]) + 1  # up to the image's last row
    assert vision.encoded == encoded


def test_another_image_behind_the_same_text_reuses_only_the_text(
        engine: ImageEngine, vision: Counting, runner: SchedulerRunner, cold: Cold) -> None:
    ids, rows = _prompt(engine, 70, 10)
    first = runner.run([ids], STEPS, images=_images(vision, IMAGES[0], rows))[0]
    expected = cold(ids, IMAGES[1], rows)
    before, encoded = _reused(runner), vision.encoded
    got = runner.run([ids], STEPS, images=_images(vision, IMAGES[1], rows))[0]
    assert got == expected and got != first  # the image decides: a reuse of the first one's KV would show
    assert _reused(runner) - before == 70  # the text before the image, not one image row
    assert vision.encoded == encoded + 1


def test_a_reuse_that_cuts_into_an_image_feeds_the_rest_of_its_rows(
        engine: ImageEngine, vision: Counting, runner: SchedulerRunner, cold: Cold) -> None:
    """The prompt ends with the image: all but its last row come back from the slot, the last row
    is prefilled with its own feature row (the image encoded for it)."""
    ids, rows = _prompt(engine, 40, 12)
    runner.run([ids], STEPS, images=_images(vision, IMAGES[0], rows))
    cut = ids[: int(rows[-1]) + 1]
    expected = cold(cut, IMAGES[0], rows)
    before, encoded = _reused(runner), vision.encoded
    calls: list[tuple[np.ndarray, np.ndarray]] = []
    prefill_images = engine.prefill_images

    def recorded(slot: int, chunk: Sequence[int], at: np.ndarray, features: np.ndarray) -> np.ndarray:
        calls.append((at.copy(), features.copy()))
        return prefill_images(slot, chunk, at, features)

    engine.prefill_images = recorded  # type: ignore[method-assign,assignment]
    try:
        got = runner.run([cut], STEPS, images=_images(vision, IMAGES[0], rows))[0]
    finally:
        del engine.prefill_images
    assert got == expected
    assert _reused(runner) - before == len(cut) - 1
    assert vision.encoded == encoded + 1
    # One prefill with image rows: the last token, fed the image's last feature row.
    (full,) = vision.inner.features([vision.inner.prepare(IMAGES[0])])
    assert len(calls) == 1 and calls[0][0].tolist() == [0]
    np.testing.assert_array_equal(calls[0][1], full[-1:])


def test_the_feature_cache_spares_the_encode_of_a_repeated_image(
        engine: ImageEngine, vision: Counting, runner: SchedulerRunner, cold: Cold) -> None:
    """Another text before the same image: its KV cannot be reused, its features are cached."""
    cache = ImageFeatureCache(1 << 20)
    ids, rows = _prompt(engine, 20, 8, seed=1)
    runner.run([ids], STEPS, images=_images(vision, IMAGES[0], rows, cache))
    encoded = vision.encoded
    moved, moved_rows = _prompt(engine, 25, 8, seed=2)
    expected = cold(moved, IMAGES[0], moved_rows)
    got = runner.run([moved], STEPS, images=_images(vision, IMAGES[0], moved_rows, cache))[0]
    assert got == expected
    stats = cache.stats()
    assert vision.encoded == encoded + 1  # the cold run's own encode only
    assert (stats.lookups, stats.hits, stats.encodes, stats.entries) == (2, 1, 1, 1)
    assert stats.bytes == 16 * 64 * 4  # one entry: 16 rows of the language model's 64-wide embedding


def test_image_blocks_survive_a_restart_in_the_unchanged_record_format(tmp_path: Path) -> None:
    """A block holding image rows is written to disk with its (negative) row ids as tokens, in
    the format text records use, and found again after a restart only with the same image."""
    from inference.images.features import row_ids
    from inference.serving.context_disk import DiskRecords

    digest = image_digest(b"a picture")
    tokens = [5] * 20 + row_ids(digest, 30).tolist() + [6] * 14
    kv = np.random.default_rng(1).standard_normal((2, 2, 64, 4)).astype(np.float32)
    store = PrefixStore("bundle", max_records=8, disk=DiskRecords(tmp_path, max_bytes=1 << 20))
    key = store.block_keys(tokens)[0]
    assert store.insert(key, tokens, kv)
    store.close()  # the writer's queue is flushed
    again = PrefixStore("bundle", max_records=8, disk=DiskRecords(tmp_path, max_bytes=1 << 20))
    found = again.fetch(again.block_keys(tokens), tokens)
    assert len(found) == 1 and np.array_equal(found[0], kv)
    other = [5] * 20 + row_ids(image_digest(b"another picture"), 30).tolist() + [6] * 14
    assert not again.fetch(again.block_keys(other), other)
    again.close()
