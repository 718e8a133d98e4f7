"""The Engine protocol: what serving code may use of an engine, and nothing more.

KV lives in ``info.max_slots`` preallocated per-sequence slots. A slot holds one sequence's
positions ``[0, slot_length(slot))`` with no padding. ``prefill`` appends a chunk of tokens to
one slot (call it repeatedly for chunked prefill); ``decode`` appends exactly one token to each
of several slots and runs them together. Both return float32 logits for the last appended
token of each slot. ``reset`` empties a slot for reuse.

:class:`VerifyingEngine` adds what speculative decoding needs: ``extend`` appends several tokens
to one slot and returns logits for *every* appended position (so ``k`` proposed tokens are
checked in one run), and ``truncate`` drops the positions of the tokens that were rejected.

:class:`KVEngine` (a VerifyingEngine) adds what context reuse needs: sharing a prefix between
slots (``copy_prefix``) and moving KV positions out of and into a slot (``export_kv`` /
``import_kv``) so that prefixes can outlive the slot that computed them.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

import numpy as np


@dataclass(frozen=True)
class EngineInfo:
    """Static facts about a loaded engine."""

    model_type: str
    vocab_size: int
    max_slots: int
    max_input_len: int
    max_kv_capacity: int
    eos_token_ids: tuple[int, ...] = ()
    backend: str = "onnxruntime"
    precision: str = "fp32"
    #: Where the engine runs (``cpu``, ``cuda:0``) and what it holds there: weights + KV slots.
    device: str = "cpu"
    memory_bytes: int = 0
    extra: dict[str, object] = field(default_factory=dict)


@runtime_checkable
class Engine(Protocol):
    """A loaded engine. Not thread-safe: one caller (the scheduler thread) drives it."""

    @property
    def info(self) -> EngineInfo: ...

    def prefill(self, slot: int, token_ids: Sequence[int]) -> np.ndarray:
        """Append ``token_ids`` to ``slot``'s KV; return logits ``[vocab]`` of the last one.

        Raises ``ValueError`` when the slot would exceed ``info.max_kv_capacity``.
        """
        ...

    def decode(self, slots: Sequence[int], token_ids: Sequence[int]) -> np.ndarray:
        """Append one token to each slot; return logits ``[len(slots), vocab]``."""
        ...

    def slot_length(self, slot: int) -> int:
        """Number of positions currently held by ``slot``."""
        ...

    def reset(self, slot: int) -> None:
        """Empty ``slot`` so a new sequence can use it."""
        ...

    def close(self) -> None:
        """Release the engine's resources."""
        ...


@runtime_checkable
class VerifyingEngine(Engine, Protocol):
    """An Engine that can score several appended tokens at once and take them back
    (speculative decoding: verify ``k`` proposed tokens in one run, drop the rejected ones)."""

    def extend(self, slot: int, token_ids: Sequence[int]) -> np.ndarray:
        """Append ``token_ids`` (one or more) to ``slot``'s KV, which must hold at least one
        position; return float32 logits ``[len(token_ids), vocab]``: row ``i`` is the
        distribution of the token that follows ``token_ids[i]``. The last row equals what
        :meth:`prefill` of the same tokens returns.

        Raises ``ValueError`` when the slot is empty or would exceed ``info.max_kv_capacity``.
        """
        ...

    def truncate(self, slot: int, n: int) -> None:
        """Keep the first ``n`` positions of ``slot`` (``n <= slot_length(slot)``); appending
        after it gives exactly the logits as if the dropped positions had never been appended."""
        ...


@runtime_checkable
class KVEngine(VerifyingEngine, Protocol):
    """An Engine whose slots' KV can be cut, shared and saved (for context reuse)."""

    @property
    def kv_bytes_per_token(self) -> int:
        """KV bytes one position takes over all layers."""
        ...

    def copy_prefix(self, src: int, dst: int, n: int) -> None:
        """Make ``dst`` hold exactly the first ``n`` positions of ``src``."""
        ...

    def export_kv(self, slot: int, start: int, n: int) -> np.ndarray:
        """A copy of ``slot``'s positions ``[start, start + n)``; opaque but for ``shape[2] == n``."""
        ...

    def import_kv(self, slot: int, start: int, kv: np.ndarray) -> None:
        """Write an :meth:`export_kv` result at ``start`` (``<= slot_length``); the slot ends after it."""
        ...


@runtime_checkable
class Embedder(Protocol):
    """An engine that turns token ids into vectors (an embedding bundle): one per input,
    L2-normalised. Thread-safe: calls are serialised inside."""

    dimensions: int
    max_input_len: int
    #: Sizes ``dimensions`` may be cut to (Matryoshka): None for none, [] for any.
    truncations: list[int] | None

    def check(self, inputs: Sequence[Sequence[int]]) -> None:
        """Raise ``ValueError`` (naming the input) for an input :meth:`embed` would refuse."""
        ...

    def embed(self, inputs: Sequence[Sequence[int]]) -> np.ndarray:
        """Unit vectors ``[len(inputs), dimensions]`` float32, in order."""
        ...


def whole_runs_end(positions: np.ndarray, start: int, end: int) -> int:
    """Where a prefill chunk ``[start, end)`` ends so that it cuts no run of consecutive
    ``positions`` (ascending): ``end``, or, where a run crosses it, the run's start when the chunk
    holds positions before that run, else the run's end (the chunk grows to hold the whole run)."""
    i = int(np.searchsorted(positions, end))  # positions[i - 1] < end <= positions[i]
    if i == 0 or i == len(positions) or positions[i - 1] != end - 1 or positions[i] != end:
        return end
    lo = i - 1  # the run holding end - 1 and end: back to its first position ...
    while lo > 0 and positions[lo - 1] == positions[lo] - 1:
        lo -= 1
    if positions[lo] > start:
        return int(positions[lo])
    hi = i  # ... or on to its last
    while hi + 1 < len(positions) and positions[hi + 1] == positions[hi] + 1:
        hi += 1
    return int(positions[hi]) + 1


@dataclass(frozen=True)
class PreparedImage:
    """One image ready for the vision graph: ``inputs`` (the graph's inputs for this image alone,
    e.g. ``pixel_values [tiles, 3, h, w]``) and ``tokens``, which replace the chat template's
    placeholder in the prompt; the entries equal to the image token are its feature rows, in
    order."""

    inputs: Mapping[str, np.ndarray]
    tokens: tuple[int, ...]
    image_token_id: int
    #: (t, h, w): the grid of the image's feature rows, for a language model with multimodal
    #: rotary positions (Qwen2.5-VL; :func:`inference.runtime.mrope.mrope_positions`), else None
    grid: tuple[int, int, int] | None = None

    @property
    def rows(self) -> int:
        """Feature rows of this image (image tokens among :attr:`tokens`)."""
        return sum(1 for t in self.tokens if t == self.image_token_id)


@runtime_checkable
class VisionModel(Protocol):
    """A bundle's vision side: image -> :class:`PreparedImage` (its vision-graph inputs and the
    prompt tokens standing for it) -> the feature rows of its image tokens. A family whose images
    take a number of tokens that depends on their size (tiles, dynamic resolution) says so with
    ``tokens_per_image`` None. Thread-safe: requests prepare and encode their images in worker
    threads, beside the scheduler."""

    #: the token whose embeddings the image features replace (the feature rows)
    image_token_id: int
    #: the token the chat template writes for each image, replaced by :attr:`PreparedImage.tokens`
    placeholder_id: int
    #: The bundle's limits (``engine.json`` ``vision``): image tokens (feature rows) of one
    #: request, of one image.
    max_image_tokens: int
    max_image_tokens_per_image: int
    #: each image's rows attend to one another both ways (Gemma 3): prefill chunks keep them whole
    whole_images: bool

    def prompt_text(self, text: str) -> str:
        """The rendered prompt of a request with images as its processor tokenizes it (Gemma 3:
        ``"\n\n"`` around each placeholder, which merge with the text around them); ``text``
        itself for the others."""
        ...

    @property
    def tokens_per_image(self) -> int | None:
        """The length of every image's tokens, or None where it depends on the image."""
        ...

    def fixed_tokens(self) -> tuple[int, ...]:
        """The tokens of any image, for a family with a fixed ``tokens_per_image`` (the prompt is
        counted without decoding its images); ``ValueError`` for the others."""
        ...

    def prepare(self, image: Any) -> PreparedImage:
        """A decoded (Pillow) image as the vision graph takes it, with its prompt tokens."""
        ...

    def features(self, images: Sequence[PreparedImage]) -> list[np.ndarray]:
        """Each image's feature rows ``[image.rows, hidden]`` float32, in order (one or several
        graph runs)."""
        ...


@runtime_checkable
class ImageEngine(Engine, Protocol):
    """An Engine whose language model takes image features in place of image-token embeddings."""

    @property
    def vision(self) -> VisionModel | None:
        """The vision side (None: the bundle is text-only)."""
        ...

    def prefill_images(self, slot: int, token_ids: Sequence[int], rows: np.ndarray,
                       features: np.ndarray, rope_positions: np.ndarray | None = None) -> np.ndarray:
        """:meth:`Engine.prefill` with the embeddings of chunk positions ``rows [n]`` replaced by
        ``features [n, hidden]``; ``rope_positions [3, len(token_ids)]``: the chunk's multimodal
        rotary positions (:attr:`PromptImages.rope`), for an engine whose language model takes them."""
        ...
