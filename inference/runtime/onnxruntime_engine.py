"""The in-place KV engine: ONNX Runtime's GroupQueryAttention over one preallocated KV pool.

KV layout (recorded in ``engine.json`` under ``kv_cache``): per layer one K and one V buffer
``[max_slots, kv_heads, capacity, head_dim]`` of ``kv_cache.dtype`` (float32, or float16 for a
``--kv-cache-dtype fp16`` build), allocated once when the engine loads.
Slot ``s`` owns row ``s``; it holds positions ``[0, slot_length(s))`` with no padding.

How a step writes in place: the session runs with IO binding and each layer's past and present
are bound to the *same* memory (a pointer to row ``lo`` of the buffer, batch ``B``), so
GroupQueryAttention appends the new positions where they belong and copies nothing else. Nothing
proportional to the context is allocated or copied per step. A decode over slots of different
lengths needs no stacking or padding either: each row's length travels in ``seqlens_k``.

Decoding slots that are not adjacent (say 0 and 3) runs the rows in between too, as passengers:
a passenger row gets a dummy token written at its own length, i.e. past the positions it holds,
so whatever the idle slot keeps (a reusable prefix) stays intact. A full passenger slot (no room
past its length) is emptied instead. The scheduler keeps running slots packed at the low end,
so passengers are rare.

GroupQueryAttention on the CPU refuses a multi-token chunk on top of a past when batch > 1, so
prefill runs one sequence at a time (the scheduler interleaves prefill chunks with decode steps).

Layers that differ (``kv_layers`` in ``engine.json``, Gemma 4): each layer's buffers have
its own heads and head size, and a layer that shares an earlier layer's K/V has no buffers: its
past and present are bound to that layer's (it writes the same values at the same positions). A
KV block of such an engine (:meth:`GqaEngine.export_kv`) is ``[rows, 1, n, unit]``: every buffer's
``[heads, n, head_dim]`` cut into ``head_dim / unit`` pieces of ``unit`` (the head sizes' greatest
common divisor) and stacked, so a block is one array with the tokens on axis 2, as for the others.

Multimodal rotary positions (Qwen2.5-VL's M-RoPE: the graph has a ``position_ids [3, B, S]``
input): a prompt's positions are not its token indices after an image (an image's rows take
grid positions, the text after it continues from their largest + 1), so the engine keeps, per
slot and held position, the position the next token takes (``_next_pos``). A run appends text
at its slot's continuation (all three ids equal: a text-only sequence has the plain positions) or,
for a prefill with images, at the positions the caller gives (:meth:`GqaEngine.prefill_images`'s
``rope_positions``: :func:`inference.runtime.mrope.mrope_positions` of the prompt). Decode and
``extend`` continue from the last; ``truncate`` keeps what the kept positions said,
``copy_prefix`` copies it, ``import_kv`` continues the text before it (a stored block carries no
positions: blocks of a prompt with images are never stored).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import onnxruntime as ort

from inference.build_profile import KV_CACHE_NUMPY_DTYPES
from inference.runtime.kv_layers import kv_layer_shapes
from inference.runtime.ort_session import cpu_session
from inference.runtime.protocol import EngineInfo, VisionModel, whole_runs_end
from inference.runtime.slot_checks import (
    SlotLengths,
    check_decode,
    check_decode_lengths,
    check_extend,
    check_prefill,
)

KV_LAYOUT = "gqa-inplace"
# The attention scratch of one run is heads * chunk * capacity floats: bound the chunk.
_MAX_PREFILL_CHUNK = 512


def _set_hugepage(enabled: bool) -> bool:
    """numpy backs large arrays with transparent huge pages: one touched position of a slot row
    would commit 2 MiB. Returns the previous setting (True where numpy has no such switch)."""
    core = getattr(np, "_core", None) or getattr(np, "core", None)
    setter = getattr(getattr(core, "multiarray", None), "_set_madvise_hugepage", None)
    if setter is None:
        return True
    return bool(setter(enabled))


def onnx_engine_info(meta: dict[str, Any], model_path: Path, *, max_slots: int, threads: int,
                     **extra: Any) -> EngineInfo:
    """The :class:`EngineInfo` of an onnxruntime engine running ``model_path`` of the bundle whose
    ``engine.json`` is ``meta``; ``extra`` adds the engine's own facts to ``info.extra``."""
    return EngineInfo(
        model_type=str(meta["model_type"]),
        vocab_size=int(meta["vocab_size"]),
        max_slots=max_slots,
        max_input_len=int(meta["max_input_len"]),
        max_kv_capacity=int(meta["max_kv_cache_capacity"]),
        eos_token_ids=tuple(int(t) for t in meta.get("eos_token_ids", [])),
        backend="onnxruntime",
        precision=str(meta["precision"]),
        extra={
            "bos_token_id": meta.get("bos_token_id"),
            "architecture": meta.get("architecture"),
            "threads": threads,
            "model_file": model_path.name,
            **extra,
        },
    )


#: ``engine.json``'s ``kv_cache.dtype`` values the engine holds (the profile's, numpy-named).
KV_DTYPES: tuple[str, ...] = tuple(KV_CACHE_NUMPY_DTYPES.values())


def kv_dtype_of(kv: Mapping[str, Any]) -> np.dtype:
    """The K/V buffers' numpy dtype recorded under ``kv_cache`` (float32 when unrecorded)."""
    name = str(kv.get("dtype", "float32"))
    if name not in KV_DTYPES:
        raise ValueError(f"kv_cache.dtype {name!r} is not one this runtime holds ({', '.join(KV_DTYPES)})")
    return np.dtype(name)


class GqaEngine(SlotLengths):
    """An Engine over one onnxruntime session of a bundle's GroupQueryAttention graph."""

    def __init__(self, model_path: Path, meta: dict[str, Any], *, max_slots: int, threads: int,
                 initializers: Mapping[str, np.ndarray] | None = None,
                 profile_prefix: str | None = None) -> None:
        """``initializers``: the graph's external weights from memory; ``profile_prefix``: ONNX
        Runtime's profiler on (see ``cpu_session``; :meth:`end_profiling` writes the trace)."""
        self._session: ort.InferenceSession | None = cpu_session(
            model_path, threads=threads, optimized=model_path.name == meta.get("optimized_model"),
            initializers=initializers, profile_prefix=profile_prefix,
        )
        kv = meta["kv_cache"]
        self._kv_dtype = kv_dtype_of(kv)
        self._layers = int(meta["num_layers"])
        self._kv_heads = int(meta["num_kv_heads"])
        self._head_dim = int(meta["head_dim"])
        self._cap = int(meta["max_kv_cache_capacity"])
        self._vocab = int(meta["vocab_size"])
        self._slots = max_slots
        self._chunk = min(int(meta["max_input_len"]), _MAX_PREFILL_CHUNK)
        # Per layer: (K/V heads, head size, the layer whose buffers it is bound to).
        self._layer_shapes = kv_layer_shapes(meta)
        self._uniform = not meta.get("kv_layers")
        own = [i for i, (_, _, src) in enumerate(self._layer_shapes) if src == i]
        previous = _set_hugepage(False)
        try:
            # Two buffers (K, V) per layer that computes its own K/V.
            self._kv = [np.zeros((max_slots, self._layer_shapes[i][0], self._cap, self._layer_shapes[i][1]),
                                 dtype=self._kv_dtype) for i in own for _ in ("key", "value")]
        finally:
            _set_hugepage(previous)
        index = {layer: 2 * j for j, layer in enumerate(own)}
        #: (past input, present output, buffer) of every layer's K and V
        self._names = [(f"past_key_values.{i}.{kind}", f"present.{i}.{kind}",
                        index[self._layer_shapes[i][2]] + k)
                       for i in range(self._layers) for k, kind in enumerate(("key", "value"))]
        #: a KV block's piece size (:meth:`export_kv`): the head sizes' greatest common divisor
        self._unit = math.gcd(*(buf.shape[3] for buf in self._kv)) if self._kv else self._head_dim
        self._lengths = [0] * max_slots
        self._binding = self._session.io_binding()
        self._bound: tuple[int, int, int] | None = None  # (first row, batch, kept logits) bound
        self._logits: dict[tuple[int, int], np.ndarray] = {}
        #: LoRA: bundles built with adapter inputs (engine.json ``lora``) run one adapter per
        #: session run; each slot names the adapter its sequence uses (None: the base model).
        self.lora = bool(meta.get("lora"))
        # onnxruntime applies RunOptions' active adapters to plain runs only, not to runs with an
        # IO binding (ours), so the engine binds an adapter's parameters itself: every LoRA
        # input gets the adapter's value or, where it targets nothing, the rank-0 default.
        self._lora_defaults: dict[str, ort.OrtValue] = {}
        if self.lora:
            for arg in self._session.get_overridable_initializers():
                if ".lora_" in arg.name:
                    dims = [0 if isinstance(d, str) else int(d) for d in arg.shape]
                    self._lora_defaults[arg.name] = ort.OrtValue.ortvalue_from_numpy(
                        np.zeros(dims, dtype=np.float32))
        self._adapters: dict[str, dict[str, ort.OrtValue]] = {}
        self._bound_adapter: str | None = None
        self._slot_adapter: list[str | None] = [None] * max_slots
        #: Vision-language bundles: the graph's image inputs (engine.json ``vision``), bound on
        #: the prefill runs of chunks that hold image tokens and back to empty after them.
        self._vision: VisionModel | None = None
        self._image_inputs = "vision" in meta
        #: Gemma 3: an image's rows attend to one another both ways, so a run holds them whole.
        self._whole_images = self._image_inputs and meta["vision"].get("image_attention") == "bidirectional"
        self._hidden = int(meta["hidden_size"])
        self._images_bound: tuple[np.ndarray, np.ndarray] | None = None
        #: M-RoPE bundles: per slot and held position, the position the token after it takes.
        self._mrope = "position_ids" in kv.get("inputs", ())
        self._next_pos = np.zeros((max_slots, self._cap if self._mrope else 0), np.int64)
        self._info = onnx_engine_info(
            meta, model_path, max_slots=max_slots, threads=threads, kv_layout=KV_LAYOUT,
            kv_bytes_per_token=int(kv.get("bytes_per_token", self.kv_bytes_per_token)),
        )

    @property
    def info(self) -> EngineInfo:
        """Static facts about the engine."""
        return self._info

    def end_profiling(self) -> Path:
        """Stop ONNX Runtime's profiler (an engine made with ``profile_prefix``); its trace file."""
        if self._session is None:
            raise RuntimeError("the engine is closed")
        return Path(self._session.end_profiling())

    @property
    def vision(self) -> VisionModel | None:
        """The bundle's vision side (None: text-only)."""
        return self._vision

    def attach_vision(self, vision: VisionModel) -> None:
        """Give a vision-language bundle's engine its vision side (the loader does)."""
        if not self._image_inputs:
            raise ValueError("this bundle's graph has no image inputs")
        self._vision = vision

    def set_memory_bytes(self, n: int) -> None:
        """Record the loader's memory estimate (weights + KV) in :attr:`info`."""
        self._info = dataclasses.replace(self._info, memory_bytes=n)

    @property
    def kv_bytes_per_token(self) -> int:
        """KV bytes one position takes over all layers (K and V)."""
        return sum(buf.shape[1] * buf.shape[3] for buf in self._kv) * self._kv_dtype.itemsize

    # --- slot bookkeeping (slot_length, reset: SlotLengths) -------------------------------
    def truncate(self, slot: int, n: int) -> None:
        """Keep only the first ``n`` positions of ``slot``."""
        self._check_slot(slot)
        if not 0 <= n <= self._lengths[slot]:
            raise ValueError(f"cannot truncate slot {slot} of {self._lengths[slot]} positions to {n}")
        self._lengths[slot] = n

    def copy_prefix(self, src: int, dst: int, n: int) -> None:
        """Make ``dst`` hold the first ``n`` positions of ``src``."""
        self._check_slot(src)
        self._check_slot(dst)
        if not 0 <= n <= self._lengths[src]:
            raise ValueError(f"slot {src} holds {self._lengths[src]} positions, not {n}")
        if src != dst:
            for buf in self._kv:
                buf[dst, :, :n] = buf[src, :, :n]
            if self._mrope:
                self._next_pos[dst, :n] = self._next_pos[src, :n]
        self._lengths[dst] = n

    def _block_shape(self, n: int) -> tuple[int, ...]:
        """The shape of an exported block of ``n`` positions."""
        if self._uniform:
            return (len(self._kv), self._kv_heads, n, self._head_dim)
        rows = sum(buf.shape[1] * buf.shape[3] // self._unit for buf in self._kv)
        return (rows, 1, n, self._unit)

    def export_kv(self, slot: int, start: int, n: int) -> np.ndarray:
        """A copy of positions ``[start, start + n)`` of ``slot``: ``[2*layers, kv_heads, n, head_dim]``
        (layers that differ: ``[rows, 1, n, unit]``, see the module docstring)."""
        self._check_slot(slot)
        if start < 0 or n < 0 or start + n > self._lengths[slot]:
            raise ValueError(f"slot {slot} holds {self._lengths[slot]} positions; cannot export "
                             f"[{start}, {start + n})")
        out = np.empty(self._block_shape(n), dtype=self._kv_dtype)
        if self._uniform:
            for j, buf in enumerate(self._kv):
                out[j] = buf[slot, :, start:start + n]
            return out
        row = 0
        for buf in self._kv:
            heads, dim = buf.shape[1], buf.shape[3]
            pieces = heads * dim // self._unit
            part = buf[slot, :, start:start + n].reshape(heads, n, dim // self._unit, self._unit)
            out[row:row + pieces, 0] = part.transpose(0, 2, 1, 3).reshape(pieces, n, self._unit)
            row += pieces
        return out

    def import_kv(self, slot: int, start: int, kv: np.ndarray) -> None:
        """Write ``kv`` (as from :meth:`export_kv`) at ``start``; the slot then holds ``start + n``."""
        self._check_slot(slot)
        n = int(kv.shape[2]) if kv.ndim == 4 else -1
        if kv.shape != self._block_shape(max(n, 0)):
            raise ValueError(f"KV block of shape {kv.shape} does not fit this engine")
        if kv.dtype != self._kv_dtype:
            raise ValueError(f"KV block of dtype {kv.dtype} does not fit this engine's {self._kv_dtype} KV")
        if not 0 <= start <= self._lengths[slot] or start + n > self._cap:
            raise ValueError(f"cannot import {n} positions at {start} into slot {slot} "
                             f"holding {self._lengths[slot]} (capacity {self._cap})")
        if self._uniform:
            for j, buf in enumerate(self._kv):
                buf[slot, :, start:start + n] = kv[j]
        else:
            row = 0
            for buf in self._kv:
                heads, dim = buf.shape[1], buf.shape[3]
                pieces = heads * dim // self._unit
                part = kv[row:row + pieces, 0].reshape(heads, dim // self._unit, n, self._unit)
                buf[slot, :, start:start + n] = part.transpose(0, 2, 1, 3).reshape(heads, n, dim)
                row += pieces
        if self._mrope:  # text continuing what the slot holds before ``start``
            first = self._next_pos[slot, start - 1] if start else 0
            self._next_pos[slot, start:start + n] = first + 1 + np.arange(n)
        self._lengths[slot] = start + n

    # --- LoRA adapters ---------------------------------------------------------------------
    def load_adapter(self, name: str, path: Path) -> None:
        """Load the onnxruntime adapter file ``path`` (:mod:`inference.builder.lora`) as ``name``."""
        if not self.lora:
            raise ValueError("this bundle was built without LoRA inputs; build it with lora enabled")
        params = ort.AdapterFormat.read_adapter(str(path)).get_parameters()
        unknown = sorted(set(params) - set(self._lora_defaults))
        if unknown:
            raise ValueError(f"adapter {name!r} sets {unknown[0]}, which this bundle has no input for")
        if name == self._bound_adapter:
            self._bound_adapter = ""  # rebind on the next run: the values changed
        self._adapters[name] = dict(params)

    def unload_adapter(self, name: str) -> None:
        """Forget adapter ``name``; refused while a slot's sequence uses it."""
        users = [s for s, a in enumerate(self._slot_adapter) if a == name]
        if users:
            raise ValueError(f"adapter {name!r} is in use by slot(s) {users}")
        self._adapters.pop(name, None)

    @property
    def adapters(self) -> tuple[str, ...]:
        """Names of the loaded adapters."""
        return tuple(self._adapters)

    def set_adapter(self, slot: int, name: str | None) -> None:
        """Run ``slot``'s sequence with adapter ``name`` (None: the base model) from now on."""
        self._check_slot(slot)
        if name is not None and name not in self._adapters:
            loaded = ", ".join(self._adapters) or "none"
            raise ValueError(f"adapter {name!r} is not loaded (loaded: {loaded})")
        self._slot_adapter[slot] = name

    def slot_adapter(self, slot: int) -> str | None:
        """The adapter ``slot`` runs with."""
        self._check_slot(slot)
        return self._slot_adapter[slot]

    # --- running ---------------------------------------------------------------------------
    def _bind_kv(self, lo: int, batch: int, keep: int) -> None:
        if self._bound == (lo, batch, keep):
            return
        for past, present, j in self._names:
            buf = self._kv[j]
            shape = [batch, buf.shape[1], self._cap, buf.shape[3]]
            ptr = buf.ctypes.data + lo * buf[0].nbytes
            self._binding.bind_input(past, "cpu", 0, self._kv_dtype.type, shape, ptr)
            self._binding.bind_output(present, "cpu", 0, self._kv_dtype.type, shape, ptr)
        logits = self._logits.get((batch, keep))
        if logits is None:
            logits = self._logits[batch, keep] = np.empty((batch, keep, self._vocab), dtype=np.float32)
        self._binding.bind_output("logits", "cpu", 0, np.float32, list(logits.shape), logits.ctypes.data)
        self._bound = (lo, batch, keep)

    def _bind_images(self, images: tuple[np.ndarray, np.ndarray] | None) -> None:
        """Bind ``(rows [n, 2], features [n, hidden])`` to the graph's image inputs, or empty ones
        where a run has none (a binding stays until replaced; the arrays are kept alive here)."""
        if images is None:
            if self._images_bound is None or not len(self._images_bound[0]):
                return
            images = (np.zeros((0, 2), np.int64), np.zeros((0, self._hidden), np.float32))
        rows, features = images
        # Overridable initializers (their default: empty) bind as OrtValues, as LoRA inputs do.
        self._binding.bind_ortvalue_input("image_rows", ort.OrtValue.ortvalue_from_numpy(rows))
        self._binding.bind_ortvalue_input("image_features", ort.OrtValue.ortvalue_from_numpy(features))
        self._images_bound = images

    def _positions(self, lo: int, past: np.ndarray, new: int, rope: np.ndarray | None) -> np.ndarray:
        """``position_ids [3, B, S]`` of a run of an M-RoPE graph: ``rope`` [3, S] (one row) where
        given, else each row's text continuation (three equal ids)."""
        if rope is not None:
            return np.ascontiguousarray(rope[:, None, :], dtype=np.int64)
        rows = np.arange(lo, lo + past.size)
        first = np.where(past > 0, self._next_pos[rows, np.maximum(past - 1, 0)], 0)
        pos = first[:, None] + np.arange(new, dtype=np.int64)
        return np.ascontiguousarray(np.broadcast_to(pos, (3, *pos.shape)))

    def _run(self, lo: int, ids: np.ndarray, past: np.ndarray, keep: int = 1,
             adapter: str | None = None,
             images: tuple[np.ndarray, np.ndarray] | None = None,
             rope: np.ndarray | None = None) -> np.ndarray:
        """Append ``ids`` [B,S] to rows ``lo..lo+B-1`` holding ``past`` [B] positions; logits of
        the last ``keep`` positions of each row, [B,keep,V]; with ``adapter`` active and the
        embeddings of ``images`` (rows [n, 2]: batch row, chunk position; features) replaced;
        ``rope`` [3, S]: an M-RoPE graph's positions of a one-row run."""
        if self._session is None:
            raise RuntimeError("engine is closed")
        if self._image_inputs:
            self._bind_images(images)
        batch, new = ids.shape
        self._bind_kv(lo, batch, keep)
        seqlens = (past + new - 1).astype(np.int32)
        self._binding.bind_cpu_input("input_ids", np.ascontiguousarray(ids, dtype=np.int64))
        self._binding.bind_cpu_input("seqlens_k", seqlens)
        total = np.array(int(past.max()) + new, dtype=np.int32)
        self._binding.bind_cpu_input("total_sequence_length", total)
        self._binding.bind_cpu_input("logits_to_keep", np.array([keep], dtype=np.int64))
        positions = None
        if self._mrope:
            positions = self._positions(lo, past, new, rope)
            self._binding.bind_cpu_input("position_ids", positions)
        if adapter != self._bound_adapter:
            values = {} if adapter is None else self._adapters[adapter]
            for name, default in self._lora_defaults.items():
                self._binding.bind_ortvalue_input(name, values.get(name, default))
            self._bound_adapter = adapter
        self._session.run_with_iobinding(self._binding)
        if positions is not None:  # where each row's next token goes: after the largest id
            following = positions.max(axis=0) + 1
            for b, held in enumerate(past.tolist()):
                self._next_pos[lo + b, held:held + new] = following[b]
        return self._logits[batch, keep].copy()

    # --- the protocol --------------------------------------------------------------------
    def prefill(self, slot: int, token_ids: Sequence[int]) -> np.ndarray:
        """Append ``token_ids`` to ``slot``'s KV; return logits ``[vocab]`` of the last one."""
        self._check_slot(slot)
        ids = self._check_tokens(token_ids)
        check_prefill(slot, self._lengths[slot], int(ids.size), self._cap)
        logits = np.empty(0, dtype=np.float32)
        for start in range(0, ids.size, self._chunk):
            part = ids[start:start + self._chunk]
            logits = self._run(slot, part[None, :], np.array([self._lengths[slot]]),
                               adapter=self._slot_adapter[slot])[0, 0]
            self._lengths[slot] += part.size
        return logits

    def prefill_images(self, slot: int, token_ids: Sequence[int], rows: np.ndarray,
                       features: np.ndarray, rope_positions: np.ndarray | None = None) -> np.ndarray:
        """:meth:`prefill` with the embeddings of positions ``rows [n]`` of ``token_ids``
        replaced by ``features [n, hidden]`` (a vision-language bundle's image tokens);
        ``rope_positions [3, len(token_ids)]``: the tokens' temporal, height and width positions,
        which an M-RoPE bundle (Qwen2.5-VL) needs for a chunk with image rows."""
        if not self._image_inputs:
            raise ValueError("this bundle is text-only: its graph takes no image features")
        self._check_slot(slot)
        ids = self._check_tokens(token_ids)
        rope = None
        if rope_positions is not None:
            if not self._mrope:
                raise ValueError("this bundle's positions are 1D: it takes no rope_positions")
            rope = np.asarray(rope_positions)
            if rope.shape != (3, ids.size) or not np.issubdtype(rope.dtype, np.integer) or (
                    ids.size and rope.min() < 0) or (ids.size and rope.max() >= self._cap):
                raise ValueError(f"rope_positions must be [3, {ids.size}] positions below {self._cap}, got "
                                 f"shape {rope.shape}")
            rope = rope.astype(np.int64)
        elif self._mrope and len(rows):
            raise ValueError("this bundle's positions are multimodal (M-RoPE): image rows need "
                             "rope_positions")
        rows = np.asarray(rows, dtype=np.int64).reshape(-1)
        features = np.ascontiguousarray(features, dtype=np.float32)
        if rows.size == 0 and features.size == 0:  # a chunk without image rows (of any width)
            features = np.zeros((0, self._hidden), np.float32)
        if features.shape != (rows.size, self._hidden):
            raise ValueError(f"image features of shape {features.shape} for {rows.size} rows of width "
                             f"{self._hidden}")
        if rows.size and (rows.min() < 0 or rows.max() >= ids.size or np.any(np.diff(rows) <= 0)):
            raise ValueError(f"image rows must be ascending positions within the {ids.size} tokens")
        check_prefill(slot, self._lengths[slot], int(ids.size), self._cap)
        logits = np.empty(0, dtype=np.float32)
        start = 0
        while start < ids.size:
            end = min(start + self._chunk, ids.size)
            if self._whole_images:
                end = whole_runs_end(rows, start, end)
            part = ids[start:end]
            lo, hi = np.searchsorted(rows, [start, end])
            mine = rows[lo:hi] - start
            images = (np.stack([np.zeros_like(mine), mine], axis=1), features[lo:hi]) if mine.size else None
            logits = self._run(slot, part[None, :], np.array([self._lengths[slot]]),
                               adapter=self._slot_adapter[slot], images=images,
                               rope=None if rope is None else rope[:, start:start + part.size])[0, 0]
            self._lengths[slot] += part.size
            start = end
        return logits

    def extend(self, slot: int, token_ids: Sequence[int]) -> np.ndarray:
        """Append ``token_ids`` to a non-empty ``slot``; return logits ``[len(token_ids), vocab]``,
        one row per appended position (the graph's ``logits_to_keep`` = the chunk's length)."""
        self._check_slot(slot)
        ids = self._check_tokens(token_ids)
        check_extend(slot, self._lengths[slot], int(ids.size), self._cap)
        rows = []
        for start in range(0, ids.size, self._chunk):
            part = ids[start:start + self._chunk]
            rows.append(self._run(slot, part[None, :], np.array([self._lengths[slot]]), part.size,
                                  adapter=self._slot_adapter[slot])[0])
            self._lengths[slot] += part.size
        return rows[0] if len(rows) == 1 else np.concatenate(rows)

    def decode(self, slots: Sequence[int], token_ids: Sequence[int]) -> np.ndarray:
        """Append one token to each slot; return logits ``[len(slots), vocab]``."""
        check_decode(slots, len(token_ids), self._slots)
        ids = self._check_tokens(token_ids)
        check_decode_lengths(slots, [self._lengths[s] for s in slots], self._cap)
        groups: dict[str | None, list[int]] = {}
        for s in slots:
            groups.setdefault(self._slot_adapter[s], []).append(s)
        if len(groups) == 1:
            return self._decode(slots, ids, next(iter(groups)))
        # One adapter per run: slots of different adapters decode in one run per adapter.
        out = np.empty((len(slots), self._vocab), dtype=np.float32)
        index = {s: i for i, s in enumerate(slots)}
        for adapter, group in groups.items():
            rows = self._decode(group, ids[[index[s] for s in group]], adapter)
            out[[index[s] for s in group]] = rows
        return out

    def _decode(self, slots: Sequence[int], ids: np.ndarray, adapter: str | None) -> np.ndarray:
        lo, hi = min(slots), max(slots)
        batch = hi - lo + 1
        row_ids = np.zeros((batch, 1), dtype=np.int64)
        past = np.array(self._lengths[lo:hi + 1], dtype=np.int64)
        for s, t in zip(slots, ids, strict=True):
            row_ids[s - lo, 0] = t
        wanted = set(slots)
        for s in range(lo, hi + 1):
            if s not in wanted and past[s - lo] >= self._cap:
                # A full passenger has no room past its content: empty it and write at 0.
                self._lengths[s] = 0
                past[s - lo] = 0
        logits = self._run(lo, row_ids, past, adapter=adapter)[:, 0]
        for s in slots:
            self._lengths[s] += 1
        return np.ascontiguousarray(logits[[s - lo for s in slots]])

    def close(self) -> None:
        """Release the session and the KV pool."""
        self._session = None
        self._kv = []
        self._logits = {}
        self._lengths = [0] * self._slots
        self._adapters = {}
        self._images_bound = None
