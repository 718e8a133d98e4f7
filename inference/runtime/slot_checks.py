"""The argument rules of the Engine protocol's slot calls, for every engine to share.

One home for the checks and their messages, so every engine (the in-place onnxruntime engine,
the TensorRT engine) refuses the same calls in the same words.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from inference.runtime.protocol import EngineInfo


def check_slot(slot: int, max_slots: int) -> None:
    """Raise ``ValueError`` unless ``0 <= slot < max_slots``."""
    if not 0 <= slot < max_slots:
        raise ValueError(f"slot {slot} out of range; this engine has slots 0..{max_slots - 1}")


def check_tokens(token_ids: Sequence[int], vocab_size: int) -> np.ndarray:
    """The ids as a flat int64 array; raise ``ValueError`` for a bad shape or an id outside the vocabulary."""
    ids = np.asarray(token_ids, dtype=np.int64)
    if ids.ndim != 1:
        raise ValueError("token ids must be a flat sequence of integers")
    if ids.size and (ids.min() < 0 or ids.max() >= vocab_size):
        raise ValueError(f"token ids must lie in [0, {vocab_size}); got {ids.min()}..{ids.max()}")
    return ids


def check_prefill(slot: int, length: int, new: int, capacity: int) -> None:
    """A prefill of ``new`` tokens onto ``length`` held positions must fit ``capacity``."""
    if new == 0:
        raise ValueError("prefill needs at least one token")
    if length + new > capacity:
        raise ValueError(
            f"slot {slot} holds {length} positions; adding {new} would exceed "
            f"max_kv_capacity {capacity}; shorten the prompt or build with a larger max_kv_cache_capacity"
        )


def check_extend(slot: int, length: int, new: int, capacity: int) -> None:
    """An extend (speculative verification) appends ``new`` tokens onto a slot that holds a sequence."""
    if new == 0:
        raise ValueError("extend needs at least one token")
    if length == 0:
        raise ValueError(f"slot {slot} is empty; prefill it before extending")
    check_prefill(slot, length, new, capacity)


def check_decode(slots: Sequence[int], n_tokens: int, max_slots: int) -> None:
    """One token per slot, at least one slot, no slot twice, every slot in range."""
    if len(slots) != n_tokens or not slots:
        raise ValueError("decode needs one token per slot and at least one slot")
    if len(set(slots)) != len(slots):
        raise ValueError(f"decode got a slot twice: {list(slots)}")
    for s in slots:
        check_slot(s, max_slots)


def check_decode_lengths(slots: Sequence[int], lengths: Sequence[int], capacity: int) -> None:
    """Every decoded slot holds a sequence and has room for one more position."""
    for s, n in zip(slots, lengths, strict=True):
        if n == 0:
            raise ValueError(f"slot {s} is empty; prefill it before decoding")
        if n + 1 > capacity:
            raise ValueError(
                f"slot {s} is full ({n} positions = max_kv_capacity); reset it or stop generating"
            )


class SlotLengths:
    """The slot bookkeeping the in-place engines share: how many positions each slot holds
    (``_lengths``, one entry per slot), slots and token ids checked against ``_info``."""

    _info: EngineInfo
    _lengths: list[int]

    def _check_slot(self, slot: int) -> None:
        check_slot(slot, self._info.max_slots)

    def _check_tokens(self, token_ids: Sequence[int]) -> np.ndarray:
        return check_tokens(token_ids, self._info.vocab_size)

    def slot_length(self, slot: int) -> int:
        """Number of positions currently held by ``slot``."""
        self._check_slot(slot)
        return self._lengths[slot]

    def reset(self, slot: int) -> None:
        """Empty ``slot`` so a new sequence can use it (its buffer is simply overwritten later)."""
        self._check_slot(slot)
        self._lengths[slot] = 0
