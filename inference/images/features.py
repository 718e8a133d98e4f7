"""A prompt's images as the scheduler runs them, and the per-model cache of image features.

Each image of a request is known by the SHA-256 of its bytes (:func:`image_digest`): the bytes
as the request sent them (a ``data:`` URL's payload, a local file, a fetched body), before they
are decoded. Why the bytes and not the decoded pixels: a digest of the bytes is known before any
decoding, so a repeated image is neither decoded nor preprocessed nor encoded again, and the same
bytes always decode to the same pixels (Pillow is deterministic and the preprocessing is the
bundle's own), so equal digests mean equal features. The price is that the same picture saved
twice with different bytes (another format or quality, other metadata) is two images to the
caches: a miss, never a wrong answer.

The digest serves twice:

* **Context reuse.** The scheduler keys KV by the prompt's token ids, and every image row has the
  same id (the image token), so :meth:`PromptImages.cache_ids` replaces each image row's id by a
  negative number drawn from its image's digest and its row index (SHAKE-256 of the digest: 63
  bits a row, distinct per row). Token ids are never negative, so the chain of block keys
  (:class:`~inference.serving.context_cache.PrefixStore`) covers the image content: the same text and
  image reuse the KV, another image behind the same text reuses only the text before it. The
  engine still sees the real ids (``prompt_ids``); only the cache sees these.
* **Image features.** :class:`ImageFeatureCache` keeps the encoded features of recent images by
  digest, LRU, bounded in bytes, per loaded model, so a repeated image is not encoded again (nor
  decoded: its bytes are hashed and looked up first). An image whose rows the reused KV covers
  needs no features at all: the scheduler asks :meth:`PromptImages.missing` for what is left to
  prefill once it knows how much it reused, and has only those encoded (in a worker thread).

Thread-safety: the cache is used from request threads (lookups before a request queues) and the
scheduler's encoding thread (stores after an encode), under one lock; a :class:`PromptImages` is
filled by the encoding thread and read by the scheduler thread, under its own lock.
"""

from __future__ import annotations

import hashlib
import logging
import threading
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace

import numpy as np

from inference.runtime.protocol import PreparedImage, VisionModel, whole_runs_end

log = logging.getLogger("inference.image_features")

#: What ``--image-feature-cache-bytes`` defaults to: 64 MiB. A LLaVA 1.5 image is 576 rows of
#: 4,096 float32 (9.4 MB), so this holds the last 7 images of a 7B model (70 of a 0.5B one with
#: 896-wide rows): enough for a conversation that sends its images again each turn, small next to
#: the KV of those images (576 positions of a 7B's KV: ~300 MB).
DEFAULT_IMAGE_CACHE_BYTES = 64 << 20


def image_digest(data: bytes) -> bytes:
    """The digest an image is known by: SHA-256 of its bytes."""
    return hashlib.sha256(data).digest()


def row_ids(digest: bytes, rows: int) -> np.ndarray:
    """The ids context reuse keys an image's ``rows`` rows by: negative int64 numbers from the
    digest (SHAKE-256, 63 bits a row), so no row id equals a token id or a row of another image."""
    stream = np.frombuffer(hashlib.shake_256(b"image rows\0" + digest).digest(8 * rows), dtype="<u8")
    return -((stream >> np.uint64(1)).astype(np.int64)) - 1


@dataclass(frozen=True)
class ImageCacheStats:
    """The feature cache's counters since start, and what it holds now."""

    lookups: int = 0  # images looked up (each image part of each request)
    hits: int = 0  # of those, found: neither decoded nor encoded again
    encodes: int = 0  # images run through the vision encoder
    evictions: int = 0  # entries dropped for the byte limit
    entries: int = 0
    bytes: int = 0
    max_bytes: int = 0

    def as_dict(self) -> dict[str, int]:
        """Plain dict for /health."""
        return dict(self.__dict__)


class ImageFeatureCache:
    """Image features by image digest: LRU, at most ``max_bytes`` of feature arrays (0: off).

    An entry is one image's features ``[rows, hidden]`` float32, read-only (requests share it),
    costing its ``nbytes`` (rows x hidden x 4: 9.4 MB for a LLaVA 1.5 image of a 7B model, 2 KB
    for the tiny test model's 16 x 32) plus a few hundred bytes of bookkeeping. ``listener`` is
    called (in the calling thread) with the new :class:`ImageCacheStats` after each change.
    """

    def __init__(self, max_bytes: int = DEFAULT_IMAGE_CACHE_BYTES, *,
                 listener: Callable[[ImageCacheStats], None] | None = None) -> None:
        if max_bytes < 0:
            raise ValueError("max_bytes must be >= 0")
        self._entries: OrderedDict[bytes, np.ndarray] = OrderedDict()
        self._bytes = 0
        self._lock = threading.Lock()
        self._stats = ImageCacheStats(max_bytes=max_bytes)
        self.listener = listener

    @property
    def max_bytes(self) -> int:
        """The byte limit (0: nothing is kept)."""
        return self._stats.max_bytes

    def get(self, digest: bytes) -> np.ndarray | None:
        """The features of image ``digest`` (most recently used now), or None; counted."""
        with self._lock:
            found = self._entries.get(digest)
            if found is not None:
                self._entries.move_to_end(digest)
            s = self._stats
            self._stats = replace(s, lookups=s.lookups + 1, hits=s.hits + (found is not None))
            stats = self._stats
        self._notify(stats)
        return found

    def put(self, digest: bytes, features: np.ndarray) -> np.ndarray:
        """Keep ``features`` of image ``digest`` (evicting least recently used entries to fit);
        returns the read-only array kept (or given, when it does not fit)."""
        features = np.ascontiguousarray(features, dtype=np.float32)
        features.flags.writeable = False
        size = int(features.nbytes)
        with self._lock:
            if size > self._stats.max_bytes:
                return features
            old = self._entries.pop(digest, None)
            if old is not None:
                self._bytes -= int(old.nbytes)
            evicted = 0
            while self._entries and self._bytes + size > self._stats.max_bytes:
                _, dropped = self._entries.popitem(last=False)
                self._bytes -= int(dropped.nbytes)
                evicted += 1
            self._entries[digest] = features
            self._bytes += size
            self._stats = replace(self._stats, evictions=self._stats.evictions + evicted,
                                  entries=len(self._entries), bytes=self._bytes)
            stats = self._stats
        self._notify(stats)
        return features

    def count_encodes(self, n: int) -> None:
        """``n`` images went through the vision encoder."""
        with self._lock:
            self._stats = replace(self._stats, encodes=self._stats.encodes + n)
            stats = self._stats
        self._notify(stats)

    def stats(self) -> ImageCacheStats:
        """A consistent snapshot of the counters (any thread)."""
        with self._lock:
            return self._stats

    def _notify(self, stats: ImageCacheStats) -> None:
        if self.listener is not None:
            try:
                self.listener(stats)
            except Exception:  # metrics must never fail a request
                log.exception("image cache listener failed")


@dataclass(eq=False)
class PromptImage:
    """One image of a prompt: its digest, its tokens in the prompt, the prompt positions of its
    rows (ascending; set once the prompt is expanded), and its features once known (``prepared``
    until then: what the vision encoder takes)."""

    digest: bytes
    tokens: tuple[int, ...] = ()
    #: The request field it came from (for logs).
    param: str = ""
    prepared: PreparedImage | None = None
    features: np.ndarray | None = None
    positions: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int64))
    #: (t, h, w) of its rows, for multimodal rotary positions (Qwen2.5-VL), else None
    grid: tuple[int, int, int] | None = None
    #: An encode of it is under way (set by :meth:`PromptImages.missing`).
    encoding: bool = field(default=False, repr=False)


class PromptImages:
    """The images of one prompt (shared by its ``n`` choices): the rows they replace, the ids
    context reuse keys them by, and their features, encoded only where the prefill needs them."""

    def __init__(self, images: Sequence[PromptImage], vision: VisionModel,
                 cache: ImageFeatureCache | None = None, *, rope: np.ndarray | None = None) -> None:
        self.images = list(images)
        #: For a language model with multimodal rotary positions (Qwen2.5-VL): every prompt
        #: token's temporal, height and width position ``[3, prompt length]`` (int64), else None.
        self.rope = rope
        for image in self.images:
            if image.features is None and image.prepared is None:
                raise ValueError(f"image {image.param or image.digest.hex()[:12]} has no pixels or features")
        self._vision = vision
        self._cache = cache
        self._lock = threading.Lock()
        self.positions = (np.concatenate([i.positions for i in self.images]).astype(np.int64)
                          if self.images else np.zeros(0, np.int64))
        if np.any(np.diff(np.sort(self.positions)) == 0):
            raise ValueError("two image rows at one prompt position")

    def rope_window(self, start: int, length: int) -> np.ndarray | None:
        """The rotary positions ``[3, length]`` of prompt tokens ``[start, start + length)``, or None."""
        return None if self.rope is None else self.rope[:, start:start + length]

    def chunk_end(self, start: int, end: int) -> int:
        """Where a prefill chunk ``[start, end)`` of the prompt ends: ``end``, or, for a model whose
        image rows attend to one another both ways (Gemma 3), where it cuts no image
        (:func:`~inference.runtime.protocol.whole_runs_end`)."""
        return whole_runs_end(self.positions, start, end) if self._vision.whole_images else end

    def cache_ids(self, prompt_ids: Sequence[int]) -> list[int]:
        """``prompt_ids`` with every image row's id replaced by its :func:`row_ids` entry."""
        ids = np.asarray(prompt_ids, dtype=np.int64).copy()
        for image in self.images:
            if image.positions.size and int(image.positions[-1]) >= len(ids):
                raise ValueError(f"image rows up to {int(image.positions[-1])} in a prompt of {len(ids)}")
            ids[image.positions] = row_ids(image.digest, int(image.positions.size))
        return [int(t) for t in ids]

    def missing(self, position: int) -> list[PromptImage]:
        """The images with a row at or after ``position`` whose features are neither known nor
        being encoded; they are marked as being encoded (the caller encodes them: :meth:`encode`)."""
        with self._lock:
            out = [i for i in self.images if i.features is None and not i.encoding
                   and i.positions.size and int(i.positions[-1]) >= position]
            for image in out:
                image.encoding = True
            return out

    def waiting(self, position: int) -> bool:
        """Whether an image with a row at or after ``position`` has no features yet."""
        with self._lock:
            return any(i.features is None and i.positions.size and int(i.positions[-1]) >= position
                       for i in self.images)

    def encode(self, images: Sequence[PromptImage]) -> None:
        """Run the vision encoder on ``images`` (from :meth:`missing`; a worker thread), keep their
        features on them and in the cache. On failure they are left to encode again."""
        try:
            # One encode per distinct image (a request may send one image twice).
            same: dict[bytes, list[PromptImage]] = {}
            for image in images:
                same.setdefault(image.digest, []).append(image)
            prepared: list[PreparedImage] = []
            for digest, copies in same.items():
                if copies[0].prepared is None:
                    raise ValueError(f"image {copies[0].param or digest.hex()[:12]} has no pixels to encode")
                prepared.append(copies[0].prepared)
            feats = self._vision.features(prepared)
            if self._cache is not None:
                self._cache.count_encodes(len(prepared))
            for digest, rows in zip(same, feats, strict=True):
                rows = np.ascontiguousarray(rows.reshape(-1, rows.shape[-1]), dtype=np.float32)
                if self._cache is not None:
                    rows = self._cache.put(digest, rows)
                for image in same[digest]:
                    if rows.shape[0] != image.positions.size:
                        raise ValueError(f"the vision encoder gave {rows.shape[0]} rows for an image of "
                                         f"{image.positions.size} tokens")
                    with self._lock:
                        image.features = rows
                        image.prepared = None
        finally:
            with self._lock:
                for image in images:
                    image.encoding = False

    def window(self, start: int, length: int) -> tuple[np.ndarray, np.ndarray]:
        """The image rows among prompt positions ``[start, start + length)``: (positions relative
        to ``start``, ascending; their features). Raises when one of them has no features yet."""
        rows: list[np.ndarray] = []
        feats: list[np.ndarray] = []
        with self._lock:
            for image in self.images:
                inside = (image.positions >= start) & (image.positions < start + length)
                if not inside.any():
                    continue
                if image.features is None:
                    raise ValueError(f"image {image.param or image.digest.hex()[:12]} has no features yet")
                rows.append(image.positions[inside] - start)
                feats.append(image.features[inside])
        if not rows:
            return np.zeros(0, np.int64), np.zeros((0, 0), np.float32)
        at = np.concatenate(rows)
        order = np.argsort(at, kind="stable")
        return at[order], np.concatenate(feats)[order]
