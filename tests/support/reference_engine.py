"""The reference Engine over a bundle's portable graph (``model.onnx``, standard ops), for tests.

Serving uses :mod:`inference.runtime.onnxruntime_engine` (KV written in place); the engine tests
compare it with this one (:func:`load_portable_engine`), which copies the whole KV every step.

Each slot keeps its own per-layer K/V arrays ``[1, kv_heads, length, head_dim]`` holding
positions ``[0, length)`` with no padding; the graph's ``present`` outputs become the next
step's ``past`` inputs without a copy. Decoding several slots of different lengths together
left-pads their K/V into one batch and masks the padding.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import onnxruntime as ort

from inference.runtime.errors import EngineLoadError
from inference.runtime.onnxruntime_engine import onnx_engine_info
from inference.runtime.onnxruntime_loader import read_engine_meta
from inference.runtime.ort_session import available_cores, cpu_session
from inference.runtime.protocol import EngineInfo
from inference.runtime.slot_checks import check_extend, check_prefill

_KEEP_LAST = np.array([1], dtype=np.int64)


class OrtEngine:
    """An Engine over one onnxruntime session of a bundle's decoder graph."""

    def __init__(self, model_path: Path, meta: dict[str, Any], *, max_slots: int, threads: int) -> None:
        self._session: ort.InferenceSession | None = cpu_session(
            model_path, threads=threads, optimized=model_path.name != meta.get("portable_model", "model.onnx")
        )
        self._layers = int(meta["num_layers"])
        self._kv_heads = int(meta["num_kv_heads"])
        self._head_dim = int(meta["head_dim"])
        self._past_names = [n for n in meta["inputs"] if n.startswith("past_key_values.")]
        self._output_names = list(meta["outputs"])
        self._info = onnx_engine_info(meta, model_path, max_slots=max_slots, threads=threads)
        # Per slot: the 2*layers past arrays (K, V per layer) or None when empty.
        self._kv: list[list[np.ndarray] | None] = [None] * max_slots

    @property
    def info(self) -> EngineInfo:
        """Static facts about the engine."""
        return self._info

    # --- slot bookkeeping ----------------------------------------------------------------
    def _check_slot(self, slot: int) -> None:
        if not 0 <= slot < self._info.max_slots:
            raise ValueError(f"slot {slot} out of range; this engine has slots 0..{self._info.max_slots - 1}")

    def _check_tokens(self, token_ids: Sequence[int]) -> np.ndarray:
        ids = np.asarray(token_ids, dtype=np.int64)
        if ids.ndim != 1:
            raise ValueError("token ids must be a flat sequence of integers")
        if ids.size and (ids.min() < 0 or ids.max() >= self._info.vocab_size):
            raise ValueError(
                f"token ids must lie in [0, {self._info.vocab_size}); got {ids.min()}..{ids.max()}"
            )
        return ids

    def slot_length(self, slot: int) -> int:
        """Number of positions currently held by ``slot``."""
        self._check_slot(slot)
        kv = self._kv[slot]
        return 0 if kv is None else int(kv[0].shape[2])

    def reset(self, slot: int) -> None:
        """Empty ``slot`` so a new sequence can use it."""
        self._check_slot(slot)
        self._kv[slot] = None

    def _empty_past(self, batch: int) -> list[np.ndarray]:
        empty = np.zeros((batch, self._kv_heads, 0, self._head_dim), dtype=np.float32)
        return [empty] * (2 * self._layers)

    def _run(self, feed: dict[str, np.ndarray]) -> list[np.ndarray]:
        if self._session is None:
            raise RuntimeError("engine is closed")
        return list(self._session.run(self._output_names, feed))

    # --- the protocol --------------------------------------------------------------------
    def _append(self, slot: int, ids: np.ndarray, *, all_logits: bool) -> np.ndarray:
        """Run ``ids`` onto ``slot`` in chunks of max_input_len, each on top of the previous
        chunk's KV; logits ``[n, vocab]`` of every position, or ``[vocab]`` of the last."""
        length = self.slot_length(slot)
        rows: list[np.ndarray] = []
        chunk = self._info.max_input_len
        for start in range(0, ids.size, chunk):
            part = ids[start:start + chunk]
            past = self._kv[slot] or self._empty_past(1)
            pos = length + start
            feed = {
                "input_ids": part[None, :],
                "attention_mask": np.ones((1, pos + part.size), dtype=np.int64),
                "position_ids": np.arange(pos, pos + part.size, dtype=np.int64)[None, :],
                "logits_to_keep": np.array([part.size if all_logits else 1], dtype=np.int64),
            }
            feed.update(zip(self._past_names, past, strict=True))
            outs = self._run(feed)
            self._kv[slot] = outs[1:]
            rows.append(outs[0][0])
        return np.concatenate(rows) if all_logits else rows[-1][-1]

    def prefill(self, slot: int, token_ids: Sequence[int]) -> np.ndarray:
        """Append ``token_ids`` to ``slot``'s KV; return logits ``[vocab]`` of the last one."""
        self._check_slot(slot)
        ids = self._check_tokens(token_ids)
        check_prefill(slot, self.slot_length(slot), int(ids.size), self._info.max_kv_capacity)
        return self._append(slot, ids, all_logits=False)

    def extend(self, slot: int, token_ids: Sequence[int]) -> np.ndarray:
        """Append ``token_ids`` to a non-empty ``slot``; return logits ``[len(token_ids), vocab]``."""
        self._check_slot(slot)
        ids = self._check_tokens(token_ids)
        check_extend(slot, self.slot_length(slot), int(ids.size), self._info.max_kv_capacity)
        return self._append(slot, ids, all_logits=True)

    def truncate(self, slot: int, n: int) -> None:
        """Keep only the first ``n`` positions of ``slot``."""
        length = self.slot_length(slot)
        if not 0 <= n <= length:
            raise ValueError(f"cannot truncate slot {slot} of {length} positions to {n}")
        kv = self._kv[slot]
        if n == 0 or kv is None:
            self._kv[slot] = None
        elif n < length:
            self._kv[slot] = [np.ascontiguousarray(a[:, :, :n]) for a in kv]

    def decode(self, slots: Sequence[int], token_ids: Sequence[int]) -> np.ndarray:
        """Append one token to each slot; return logits ``[len(slots), vocab]``."""
        if len(slots) != len(token_ids) or not slots:
            raise ValueError("decode needs one token per slot and at least one slot")
        if len(set(slots)) != len(slots):
            raise ValueError(f"decode got a slot twice: {list(slots)}")
        ids = self._check_tokens(token_ids)
        lengths = [self.slot_length(s) for s in slots]
        for s, n in zip(slots, lengths, strict=True):
            if n == 0:
                raise ValueError(f"slot {s} is empty; prefill it before decoding")
            if n + 1 > self._info.max_kv_capacity:
                raise ValueError(
                    f"slot {s} is full ({n} positions = max_kv_capacity); reset it or stop generating"
                )
        batch, longest = len(slots), max(lengths)
        if batch == 1:
            past = self._kv[slots[0]]
            assert past is not None
        else:
            past = []
            for j in range(2 * self._layers):
                stacked = np.zeros((batch, self._kv_heads, longest, self._head_dim), dtype=np.float32)
                for b, s in enumerate(slots):
                    kv = self._kv[s]
                    assert kv is not None
                    stacked[b, :, longest - lengths[b]:] = kv[j][0]
                past.append(stacked)
        mask = np.ones((batch, longest + 1), dtype=np.int64)
        for b, n in enumerate(lengths):
            mask[b, : longest - n] = 0
        feed = {
            "input_ids": ids[:, None],
            "attention_mask": mask,
            "position_ids": np.asarray(lengths, dtype=np.int64)[:, None],
            "logits_to_keep": _KEEP_LAST,
        }
        feed.update(zip(self._past_names, past, strict=True))
        outs = self._run(feed)
        if batch == 1:
            self._kv[slots[0]] = outs[1:]
        else:
            for b, s in enumerate(slots):
                pad = longest - lengths[b]
                self._kv[s] = [np.ascontiguousarray(o[b:b + 1, :, pad:]) for o in outs[1:]]
        return np.ascontiguousarray(outs[0][:, -1, :])

    def close(self) -> None:
        """Release the session and all KV."""
        self._session = None
        self._kv = [None] * self._info.max_slots


def load_portable_engine(bundle_dir: Path, *, max_slots: int = 1, threads: int | None = None) -> OrtEngine:
    """The reference engine over a bundle's portable graph (``model.onnx``): KV copied every step."""
    bundle_dir = Path(bundle_dir)
    meta = read_engine_meta(bundle_dir)
    portable = meta.get("portable_model", "model.onnx")
    if not portable:
        raise EngineLoadError(f"bundle {bundle_dir} has no portable graph ({meta.get('precision')} bundles "
                              "keep only the CPU graph)")
    model = bundle_dir / str(portable)
    n_threads = available_cores() if threads is None else threads
    return OrtEngine(model, meta, max_slots=max_slots, threads=n_threads)


__all__ = ["OrtEngine", "load_portable_engine"]
