"""The image side of context reuse and the feature cache, in process: row ids from image digests,
the LRU byte bound and its counters, and a prompt's images encoded only where they are missing."""

from __future__ import annotations

import threading
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import pytest

from inference.images.features import (
    ImageCacheStats,
    ImageFeatureCache,
    PromptImage,
    PromptImages,
    image_digest,
    row_ids,
)
from inference.runtime.protocol import PreparedImage


@dataclass
class _Vision:
    """Features of an image: its pixel values' mean, once per row (encode calls counted)."""

    image_token_id: int = 9
    placeholder_id: int = 9
    tokens_per_image: int | None = 3
    max_image_tokens: int = 48
    max_image_tokens_per_image: int = 3
    whole_images: bool = False
    calls: list[int] = field(default_factory=list)

    def prompt_text(self, text: str) -> str:
        return text

    def fixed_tokens(self) -> tuple[int, ...]:
        return (self.image_token_id,) * 3

    def prepare(self, image: Any) -> PreparedImage:
        raise AssertionError("not decoded here")

    def features(self, images: Sequence[PreparedImage]) -> list[np.ndarray]:
        self.calls.append(len(images))
        rows = np.arange(3, dtype=np.float32)
        return [(float(im.inputs["pixel_values"].mean()) + rows[:, None] * np.ones((1, 2), np.float32))
                .astype(np.float32) for im in images]


def _image(value: float, positions: list[int], data: bytes | None = None) -> PromptImage:
    digest = image_digest(data if data is not None else str(value).encode())
    prepared = PreparedImage(inputs={"pixel_values": np.full((1, 3, 2, 2), value, np.float32)},
                             tokens=(9, 9, 9), image_token_id=9)
    return PromptImage(digest=digest, tokens=prepared.tokens, positions=np.asarray(positions, np.int64),
                       prepared=prepared)


def test_row_ids_are_negative_distinct_per_row_and_per_image_and_stable() -> None:
    a, b = image_digest(b"cat"), image_digest(b"dog")
    rows = row_ids(a, 576)
    assert rows.dtype == np.int64 and (rows < 0).all() and len(set(rows.tolist())) == 576
    assert (row_ids(a, 576) == rows).all() and (row_ids(a, 10) == rows[:10]).all()
    assert not set(row_ids(b, 576).tolist()) & set(rows.tolist())


def test_cache_ids_replace_image_rows_only() -> None:
    first, second = _image(1.0, [1, 2, 3]), _image(2.0, [5, 6, 7])
    images = PromptImages([first, second], _Vision())
    ids = images.cache_ids([4, 9, 9, 9, 8, 9, 9, 9, 7])
    assert [ids[i] for i in (0, 4, 8)] == [4, 8, 7]
    assert ids[1:4] == row_ids(first.digest, 3).tolist() and ids[5:8] == row_ids(second.digest, 3).tolist()
    # The same text with another image: equal up to the image, never after its first row.
    other = PromptImages([_image(3.0, [1, 2, 3]), second], _Vision()).cache_ids([4, 9, 9, 9, 8, 9, 9, 9, 7])
    assert other[0] == ids[0] and all(x != y for x, y in zip(other[1:4], ids[1:4], strict=True))


def test_the_feature_cache_is_lru_by_bytes_with_counters() -> None:
    seen: list[ImageCacheStats] = []
    row = np.ones((4, 8), np.float32)  # 128 bytes an entry
    cache = ImageFeatureCache(300, listener=seen.append)
    keys = [image_digest(bytes([i])) for i in range(3)]
    assert cache.get(keys[0]) is None
    kept = cache.put(keys[0], row)
    assert not kept.flags.writeable  # shared between requests: read-only
    cache.put(keys[1], row * 2)
    assert cache.get(keys[0]) is not None  # keys[0] most recent now: keys[1] goes first
    cache.put(keys[2], row * 3)
    assert cache.get(keys[1]) is None and cache.get(keys[0]) is not None
    stats = cache.stats()
    assert (stats.lookups, stats.hits, stats.evictions, stats.entries, stats.bytes, stats.max_bytes) == (
        4, 2, 1, 2, 256, 300)
    assert seen[-1] == stats
    assert cache.put(keys[1], np.ones((100, 8), np.float32)) is not None  # too big: not kept
    assert cache.stats().entries == 2
    off = ImageFeatureCache(0)
    off.put(keys[0], row)
    assert off.get(keys[0]) is None and off.stats().entries == 0
    with pytest.raises(ValueError):
        ImageFeatureCache(-1)


def test_the_feature_cache_counts_right_from_many_threads() -> None:
    cache = ImageFeatureCache(64 * 32)
    keys = [image_digest(bytes([i])) for i in range(8)]

    def work(n: int) -> None:
        for i in range(200):
            key = keys[(n + i) % 8]
            if cache.get(key) is None:
                cache.put(key, np.full((1, 8), n, np.float32))

    threads = [threading.Thread(target=work, args=(n,)) for n in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    stats = cache.stats()
    assert stats.lookups == 1200 and stats.entries == 8 and stats.bytes == 8 * 32


def test_only_missing_images_are_encoded_once_and_cached() -> None:
    vision = _Vision()
    cache = ImageFeatureCache(1 << 20)
    first, second = _image(1.0, [1, 2, 3]), _image(2.0, [5, 6, 7])
    twice = _image(1.0, [9, 10, 11])  # the first image again, in the same request
    images = PromptImages([first, second, twice], vision, cache)
    assert images.missing(8) == [twice]  # what a reuse up to position 8 leaves to prefill
    assert images.missing(8) == []  # marked: no second encode while this one runs
    images.encode([twice])
    assert twice.features is not None and twice.prepared is None and first.features is None
    assert cache.get(first.digest) is not None  # the same bytes: the first image is cached now
    assert images.waiting(0) and not images.waiting(8)
    todo = images.missing(0)
    assert todo == [first, second]
    images.encode(todo)
    assert vision.calls == [1, 2] and cache.stats().encodes == 3
    rows, feats = images.window(2, 5)  # positions 2..6: first image's rows 1-2, second's 0-1
    assert rows.tolist() == [0, 1, 3, 4]
    assert feats[:, 0].tolist() == [2.0, 3.0, 2.0, 3.0]


def test_a_window_over_rows_without_features_is_refused() -> None:
    images = PromptImages([_image(1.0, [1, 2, 3])], _Vision())
    rows, _ = images.window(4, 4)
    assert rows.size == 0
    with pytest.raises(ValueError, match="no features yet"):
        images.window(0, 3)
    with pytest.raises(ValueError, match="no pixels or features"):
        PromptImages([PromptImage(digest=b"x", positions=np.arange(3))], _Vision())


def test_a_failed_encode_leaves_the_images_to_encode_again() -> None:
    class Broken(_Vision):
        def features(self, images: Sequence[PreparedImage]) -> list[np.ndarray]:
            raise RuntimeError("vision graph failed")

    images = PromptImages([_image(1.0, [1, 2, 3])], Broken())
    todo = images.missing(0)
    with pytest.raises(RuntimeError):
        images.encode(todo)
    assert images.missing(0) == todo
